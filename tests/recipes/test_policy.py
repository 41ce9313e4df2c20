"""Policy resolution as a pure function (tables of cases), and policies in compiled models."""

import copy
import logging
import pickle
import re

import pytest
import torch
from torch import nn

import fp8graph
from fp8graph import Float8CurrentScaling, Format, Policy
from fp8graph.models import build
from fp8graph.recipes.policy import SiteInfo, normalize_policy, resolve
from helpers import compile_fp8, fp8_sites_compiled, fp8_target_count, graphs_per_unit, sqnr_db

HYBRID = Float8CurrentScaling()
E4M3 = Float8CurrentScaling(Format.E4M3)
POW2 = Float8CurrentScaling(power_2_scales=True)
LINEAR = SiteInfo(op="linear", M=32, K=64, N=128, dtype=torch.float32)
WIDE = SiteInfo(op="linear", M=32, K=64, N=4096, dtype=torch.float32)
SCORES = SiteInfo(op="matmul", M=128, K=16, N=16, dtype=torch.float32, is_linear=False)

POLICY = Policy(
    default=HYBRID,
    rules=[
        ("lm_head", None),
        ("model.layers.0.*", None),
        (re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_proj"), POW2),
        ("*.mlp.*", E4M3),
        (nn.Embedding, E4M3),
        (lambda path, module, site: site.N is not None and site.N >= 4096, E4M3),
    ],
)


@pytest.mark.parametrize("path,site,module_type,expected_recipe,expected_rule", [
    ("lm_head", LINEAR, nn.Linear, None, 0),
    ("model.layers.0.mlp.up_proj", LINEAR, nn.Linear, None, 1),         # first match wins over rule 3
    ("model.layers.1.self_attn.q_proj", LINEAR, nn.Linear, POW2, 2),
    ("model.layers.1.self_attn.v_proj", LINEAR, nn.Linear, HYBRID, None),  # regex must match whole path
    ("model.layers.10.self_attn.k_proj", LINEAR, nn.Linear, POW2, 2),
    ("model.layers.1.mlp.down_proj", LINEAR, nn.Linear, E4M3, 3),
    ("model.layers.1.self_attn.o_proj", WIDE, nn.Linear, E4M3, 5),       # predicate on the shape
    ("model.layers.1.self_attn.o_proj", LINEAR, nn.Linear, HYBRID, None),
    ("model.embed", LINEAR, nn.Embedding, E4M3, 4),                      # class pattern
    ("model.layers.1.self_attn", SCORES, None, None, None),              # matmuls never take the default
])
def test_resolution_table(path, site, module_type, expected_recipe, expected_rule):
    resolution = resolve(POLICY, path, site, module_type=module_type)
    assert (resolution.recipe, resolution.rule_index) == (expected_recipe, expected_rule)


def test_class_patterns_match_subclasses_and_prefer_the_module_instance():
    class MyLinear(nn.Linear):
        pass

    policy = Policy(default=None, rules=[(nn.Linear, E4M3)])
    assert resolve(policy, "x", LINEAR, module_type=MyLinear).recipe == E4M3
    assert resolve(policy, "x", LINEAR, module=MyLinear(16, 16), module_type=None).recipe == E4M3
    assert resolve(policy, "x", LINEAR, module_type=nn.Conv1d).recipe is None


def test_predicates_see_path_module_and_site():
    seen = []
    policy = Policy(rules=[(lambda path, module, site: seen.append((path, module, site)) or False, None)])
    module = nn.Linear(64, 128)
    resolve(policy, "a.b", LINEAR, module=module)
    assert seen == [("a.b", module, LINEAR)]


def test_an_explicit_rule_opts_activation_matmuls_in():
    policy = Policy(rules=[("*.self_attn", HYBRID)])
    assert resolve(policy, "model.layers.1.self_attn", SCORES).recipe == HYBRID


@pytest.mark.parametrize("kwargs,message", [
    ({"default": "fp8"}, "Policy.default must be a recipe or None"),
    ({"rules": [("*.mlp.*",)]}, r"Policy rule 0 must be a \(pattern, recipe\) pair"),
    ({"rules": [(42, HYBRID)]}, "Policy rule 0: pattern must be a glob string"),
    ({"rules": [(int, HYBRID)]}, "Policy rule 0: class pattern int is not an nn.Module subclass"),
    ({"rules": [("lm_head", None), ("*", "E4M3")]}, r"Policy rule 1 \('\*'\) recipe must be a recipe or None"),
    ({"strict": 1}, "Policy.strict must be bool"),
])
def test_invalid_policies_raise_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Policy(**kwargs)


def test_policies_are_immutable_values():
    assert Policy(rules=[("lm_head", None)]) == Policy(rules=[("lm_head", None)])
    assert hash(Policy()) == hash(Policy())
    assert Policy() != Policy(default=E4M3)
    with pytest.raises(AttributeError):
        Policy().strict = True
    assert normalize_policy(E4M3) == Policy(default=E4M3)
    assert normalize_policy(None) == Policy()


def _is_mlp(path, module, site):
    return ".mlp." in path


def test_policies_copy_deep_copy_and_pickle_as_equal_values():
    policy = Policy(default=POW2, rules=[("lm_head", None), (re.compile(r".*\.q_proj"), E4M3), (_is_mlp, None),
                                         (torch.nn.Linear, E4M3)], strict=True)
    for copied in (copy.copy(policy), copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
        assert copied == policy and hash(copied) == hash(policy)
        with pytest.raises(AttributeError):
            copied.strict = False


def test_mixed_recipes_and_high_precision_compile_into_one_graph():
    model = build("llama", "tiny")
    policy = Policy(rules=[
        ("lm_head", None),
        ("*.mlp.*", E4M3),
        ("*.self_attn.*", POW2),
    ])
    compiled, backend = compile_fp8(model, policy=policy)
    tokens = torch.randint(0, 250, (2, 16))
    compiled(tokens, labels=tokens).loss.backward()
    assert set(graphs_per_unit(backend)) == {1}
    recipes = {d.site.path: d.recipe for d in backend.decisions}
    assert recipes["lm_head"] is None
    assert recipes["model.layers.1.mlp.gate_proj"] == E4M3
    assert recipes["model.layers.0.self_attn.o_proj"] == POW2
    assert fp8_sites_compiled(backend) == 14
    assert sqnr_db(model(tokens).logits, compiled(tokens).logits) > 20
    report = fp8graph.explain(compiled, tokens)
    assert [r.rule for r in report if r.path == "lm_head"] == ["rule 0 ('lm_head')"]
    assert report.unmatched_rules == []


def test_explicit_rule_that_cannot_apply_is_reported_or_raises_when_strict():
    model = build("llama", "tiny")  # lm_head has N=250
    tokens = torch.randint(0, 250, (2, 16))
    lenient = Policy(rules=[("lm_head", E4M3)])
    [record] = [r for r in fp8graph.explain(model, tokens, policy=lenient) if r.path == "lm_head"]
    assert record.reason == "N=250 is not a multiple of 16; rule 0 ('lm_head') asks for current(E4M3)"
    strict = Policy(rules=[("lm_head", E4M3)], strict=True)
    with pytest.raises(Exception, match=r"lm_head \(linear\): rule 0 \('lm_head'\) asks for current\(E4M3\), "
                                        r"but N=250 is not a multiple of 16"):
        fp8graph.compile(model, policy=strict, compiler="eager")(tokens)


def test_rules_that_match_nothing_are_reported_or_raise_when_strict():
    model = build("mlp", "tiny")
    x = torch.randn(4, 64)
    report = fp8graph.explain(model, x, policy=Policy(rules=[("*.mlp.*", E4M3), ("up", E4M3)]))
    assert report.unmatched_rules == ["rule 0 ('*.mlp.*')"]
    assert "policy rules that matched no site: rule 0 ('*.mlp.*')" in str(report)
    with pytest.raises(ValueError, match=r"policy rules that match no site: rule 0 \('\*.mlp.\*'\)"):
        fp8graph.explain(model, x, policy=Policy(rules=[("*.mlp.*", E4M3)], strict=True))


def test_compile_holds_strict_policies_to_their_rules_at_the_first_call(caplog):
    """Strict means the same in compile as in explain: the first call raises, naming the rule."""
    x = torch.randn(4, 64)
    strict = fp8graph.compile(build("mlp", "tiny"), policy=Policy(rules=[("nope.*", None)], strict=True),
                              compiler="aot_eager")
    with pytest.raises(ValueError, match=r"policy rules that match no site: rule 0 \('nope\.\*'\)"):
        strict(x)
    lenient = fp8graph.compile(build("mlp", "tiny"), policy=Policy(rules=[("nope.*", None), ("up", E4M3)]),
                               compiler="aot_eager")
    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        for _ in range(3):
            lenient(x)
    assert caplog.text.count("policy rules that match no site: rule 0 ('nope.*')") == 1  # once, not per call


def test_the_backend_string_refuses_a_strict_policy_with_rules_and_names_each_graph_s_unmatched_rules(caplog):
    """``torch.compile(backend="fp8")`` compiles each graph on its own, so it cannot tell which rules match no site
    of the model: a strict policy's rules are refused (they ran unchecked before), and a lenient one's unmatched
    rules are logged for each graph at INFO, not as a warning (another graph may hold their sites)."""
    x = torch.randn(4, 64)
    strict = Policy(rules=[("nope.*", None)], strict=True)
    with pytest.raises(Exception, match="a strict policy with rules needs fp8graph.compile"):
        torch.compile(build("mlp", "tiny"), backend="fp8", options={"policy": strict, "compiler": "aot_eager"})(x)
    torch._dynamo.reset()
    strict_without_rules = Policy(default=E4M3, strict=True)  # strict about recipes a site cannot take: checkable
    torch.compile(build("mlp", "tiny"), backend="fp8", options={"policy": strict_without_rules,
                                                               "compiler": "aot_eager"})(x)
    torch._dynamo.reset()
    lenient = Policy(rules=[("nope.*", None), ("up", E4M3)])
    with caplog.at_level(logging.INFO, logger="fp8graph"):
        torch.compile(build("mlp", "tiny"), backend="fp8", options={"policy": lenient, "compiler": "aot_eager"})(x)
    unmatched = [r for r in caplog.records if "match no site of this graph" in r.getMessage()]
    assert len(unmatched) == 1 and unmatched[0].levelno == logging.INFO
    assert "rule 0 ('nope.*')" in unmatched[0].getMessage() and "rule 1" not in unmatched[0].getMessage()


def test_bare_backend_matches_class_rules_by_module_type():
    model = build("mlp", "tiny")
    policy = Policy(default=None, rules=[(nn.Linear, E4M3)])
    compiled = torch.compile(model, backend="fp8", options={"policy": policy, "compiler": "aot_eager"})
    compiled(torch.randn(4, 64))
    assert torch._dynamo.utils.counters["fp8graph"]["sites_rewritten"] == 2


def test_weight_recipes_before_tracing_read_conv1d_weights_as_in_by_out_and_leave_rules_on_m_open():
    from transformers.pytorch_utils import Conv1D

    from fp8graph.recipes.policy import resolve_weight

    delayed = fp8graph.DelayedScaling()
    wide = Policy(default=None, rules=[(lambda path, module, site: site.N > site.K, delayed)])
    conv1d = Conv1D(256, 64)  # GPT-2's c_fc: weight (in=64, out=256), so K=64, N=256
    linear = nn.Linear(64, 256)  # weight (out=256, in=64): the same site
    assert resolve_weight(wide, "c_fc", conv1d, conv1d.weight).recipes == (delayed,)
    assert resolve_weight(wide, "fc", linear, linear.weight).recipes == (delayed,)
    # A weight of an unknown module may be multiplied either way round: both recipes stay possible.
    free = nn.Parameter(torch.zeros(256, 64))
    assert resolve_weight(wide, "free", None, free).recipes == (delayed, None)
    on_m = Policy(default=None, rules=[(lambda path, module, site: site.M >= 4, delayed)])
    possible = resolve_weight(on_m, "fc", linear, linear.weight)
    assert possible.recipes == (delayed, None) and possible.undecided == ("rule 0 (<lambda>)",)
    # Which GEMM of an expert MLP a site is, the traced graph alone knows too.
    on_stage = Policy(default=None, rules=[(lambda path, module, site: site.expert_stage == 0, delayed)])
    experts = nn.Parameter(torch.zeros(4, 256, 64))
    possible = resolve_weight(on_stage, "experts", None, experts)
    assert possible.recipes == (delayed, None) and possible.undecided == ("rule 0 (<lambda>)",)


def test_a_delayed_rule_on_m_gets_its_state_and_is_decided_per_traced_site():
    model = build("mlp", "tiny")
    policy = Policy(default=None, rules=[(lambda path, module, site: site.M >= 4, fp8graph.DelayedScaling())])
    compiled, backend = compile_fp8(model, policy=policy)
    x = torch.randn(8, 64, requires_grad=True)
    compiled(x).sum().backward()
    decisions = {d.site.path: d for d in backend.decisions}
    for path in ("up", "mid"):  # before the fix: TypeError from the rule, at state registration (M None)
        assert isinstance(decisions[path].recipe, fp8graph.DelayedScaling), decisions[path].reason
        assert model.get_submodule(path).fp8graph_amax_history_weight[0, 0] > 0  # the input's amax recorded
    assert decisions["head"].reason.startswith("N=10 is not a multiple of 16")


def test_gpt2_delayed_rule_on_k_and_n_reads_conv1d_weights_the_right_way_round():
    model = build("gpt2", "tiny")  # n_embd 64: c_fc is (in=64, out=256), c_proj of the MLP (256, 64)
    policy = Policy(default=None, rules=[(lambda path, module, site: site.N > site.K, fp8graph.DelayedScaling())])
    compiled, backend = compile_fp8(model, policy=policy)
    tokens = torch.randint(0, 256, (2, 16))
    compiled(tokens, labels=tokens).loss.backward()
    decisions = {d.site.path: d for d in backend.decisions}
    c_fc = decisions["transformer.h.0.mlp.c_fc"]
    # Before the fix: kept in high precision, "delayed scaling has no state in this graph".
    assert isinstance(c_fc.recipe, fp8graph.DelayedScaling), c_fc.reason
    assert isinstance(decisions["transformer.h.0.attn.c_attn"].recipe, fp8graph.DelayedScaling)  # (64, 192)
    c_proj = decisions["transformer.h.0.mlp.c_proj"]  # N=64 < K=256: the rule does not match
    assert c_proj.recipe is None and c_proj.reason == "policy keeps it in high precision"
    assert model.transformer.h[0].mlp.c_fc.fp8graph_amax_history_weight[0, 0] > 0


def test_two_history_lengths_a_weight_may_get_before_tracing_are_refused_naming_the_rule():
    policy = Policy(default=fp8graph.DelayedScaling(),
                    rules=[(lambda path, module, site: site.M >= 4, fp8graph.DelayedScaling(amax_history_len=16))])
    with pytest.raises(ValueError, match=r"up: .* lengths \[16, 1024\] \(undecided: rule 0 \(<lambda>\)\)"):
        fp8graph.compile(build("mlp", "tiny"), policy=policy)


def test_rules_on_what_only_the_traced_graph_knows_are_decided_per_site():
    """A rule reading ``op`` or ``gate`` is undecided before tracing (the plan guesses every weight's site a
    linear that is no gate) and decides each traced site: a router named by ``site.gate`` runs the rule's
    recipe, and GPT-2's Conv1D sites are ``addmm``, not ``linear``."""
    from fp8graph.models.moe import MoEBlock

    e4m3 = Float8CurrentScaling(fp8_format=Format.E4M3)
    torch.manual_seed(0)
    block = MoEBlock(hidden=64, experts=16, top_k=2, expert_width=32).to(torch.bfloat16)
    compiled = fp8graph.compile(block, policy=Policy(rules=[(lambda path, module, site: site.gate, e4m3)]),
                                compiler="aot_eager")
    compiled(torch.randn(2, 8, 64, dtype=torch.bfloat16))
    [gate] = [d for d in compiled.fp8graph_backend.decisions if d.site.gate]
    assert gate.recipe == e4m3
    model = build("gpt2", "tiny")
    compiled = fp8graph.compile(model, policy=Policy(rules=[(lambda path, module, site: site.op == "linear", None)]),
                                compiler="aot_eager")
    tokens = torch.randint(0, 250, (2, 16))
    compiled(tokens, labels=tokens)
    assert {d.site.op for d in compiled.fp8graph_backend.decisions if d.rewritten} == {"addmm"}


def test_a_weight_multiplied_otherwise_than_the_plan_guessed_is_kept_with_the_reason_or_refused_when_strict():
    """``x @ linear.weight`` multiplies an nn.Linear's (N, K) weight as (K, N): a rule on K decides the traced site
    otherwise than the plan did, whose buffers would not serve it."""

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 128)

        def forward(self, x):
            return x @ self.lin.weight

    rule = (lambda path, module, site: site.K == 128, Float8CurrentScaling(fp8_format=Format.E4M3))
    compiled = fp8graph.compile(Parent(), policy=Policy(rules=[rule]), compiler="aot_eager")
    x = torch.randn(8, 128)
    assert torch.equal(compiled(x), x @ compiled.lin.weight)
    [decision] = compiled.fp8graph_backend.decisions
    assert not decision.rewritten and "which the plan of lin.weight" in decision.reason
    strict = fp8graph.compile(Parent(), policy=Policy(rules=[rule], strict=True), compiler="aot_eager")
    with pytest.raises(Exception, match="which the plan of lin.weight"):
        strict(x)
