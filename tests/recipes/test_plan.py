"""The plan: what a policy gives every weight, before anything is traced (``fp8graph.recipes.plan``)."""

import dataclasses
import re

import pytest
import torch

import fp8graph
import fp8graph.backend
from fp8graph import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Policy
from fp8graph.models import build
from fp8graph.recipes.plan import Plan
from fp8graph.recipes.scaling import misaligned


def test_each_weight_has_one_entry_with_its_recipes_rule_and_shape_reason():
    model = build("mlp", "tiny")  # up (128, 64), mid (64, 128), head (10, 64)
    plan = fp8graph.plan(model, Policy(rules=[("mid", DelayedScaling())]))
    rows = {entry.qualified_name: entry.describe(plan.policy) for entry in plan}
    assert rows == {
        "up.weight": "current(HYBRID) by default, FP8 copy cached",  # cache_weights="auto"
        "mid.weight": f"{DelayedScaling()} by rule 0 ('mid'), FP8 copy cached",
        "head.weight": "current(HYBRID) (kept: N=10 is not a multiple of 16) by default",
    }
    assert [e.may_be_fp8 for e in plan] == [True, True, False]
    assert plan.entry(model.mid.weight).recipes.recipes == (DelayedScaling(),)
    assert plan.entry(model.mid.bias) is None  # vectors have no GEMM of their own
    with pytest.raises(KeyError, match="does not hold"):
        plan.recipes(torch.zeros(16, 16))
    assert "3 weights" in str(plan)
    with pytest.raises(TypeError, match="needs an nn.Module"):
        fp8graph.plan(lambda x: x)


def test_a_table_only_looked_up_is_planned_in_high_precision_and_a_tied_one_as_its_linear():
    """An embedding's table no GEMM reads: the plan said "FP8 copy cached" for it, and no copy was ever kept."""
    untied = build("llama", "tiny", vocab_size=256)
    rows = {entry.qualified_name: entry for entry in fp8graph.plan(untied)}
    table = rows["model.embed_tokens.weight"]
    assert table.describe(Policy()) == "high precision: read by index or convolved, never a GEMM's operand"
    assert table.fp8_copy is None
    assert rows["lm_head.weight"].fp8_copy == "cached"
    tied = build("llama", "tiny", vocab_size=256)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    shared = {entry.qualified_name: entry for entry in fp8graph.plan(tied)}["model.embed_tokens.weight"]
    assert shared.multiplied and shared.fp8_copy == "cached"  # lm_head multiplies it


def test_an_expert_weight_is_planned_with_the_reason_its_gemms_cannot_run_the_recipe_the_trace_gives():
    """Block scaling on expert GEMMs: the plan said the experts run it, and every expert site stayed in high
    precision (``passes.annotate``), for the reason the plan now gives too."""
    model = build("moe", "tiny", dtype=torch.bfloat16, hidden=128, expert_width=128)  # whole 128x128 tiles
    block = Float8BlockScaling()
    experts = [entry for entry in fp8graph.plan(model, block) if entry.path == "experts"]
    assert len(experts) == 2 and not any(entry.may_be_fp8 for entry in experts)
    sites = [record for record in fp8graph.explain(model, torch.randn(2, 8, 128).bfloat16(), policy=block)
             if record.path == "experts"]
    assert sites and not any(record.rewritten for record in sites)
    for entry in experts:
        assert entry.describe(Policy(default=block)) == f"{block} (kept: {sites[0].reason}) by default"


def test_a_rule_on_the_token_count_leaves_the_weight_undecided_until_traced():
    rule = (lambda path, module, site: site.M > 64, Float8CurrentScaling())
    plan = Plan(build("mlp", "tiny"), Policy(default=None, rules=[rule]))
    entry = next(iter(plan))
    assert entry.recipes.recipes == (Float8CurrentScaling(), None) and entry.recipes.undecided


def test_a_predicate_giving_a_reason_decides_the_weight_before_tracing():
    """A reason is a match, as for the traced site: the kept weight gets no delayed-scaling state."""
    keep = (lambda path, module, site: "stays in BF16" if path == "mid" else False, None)
    model = build("mlp", "tiny")
    plan = Plan(model, Policy(default=DelayedScaling(), rules=[keep]))
    mid, up = plan.entry(model.mid.weight), plan.entry(model.up.weight)
    assert mid.recipes.recipes == (None,) and not mid.recipes.undecided and not mid.may_be_fp8
    assert up.recipes.recipes == (DelayedScaling(),)
    fp8graph.compile(model, policy=Policy(default=DelayedScaling(), rules=[keep]), compiler="aot_eager")
    assert not any(name.startswith("mid.fp8graph_") for name in model.state_dict())


def test_block_recipes_need_whole_tiles():
    plan = Plan(build("llama", "tiny"), Float8BlockScaling())  # hidden 64: not a multiple of 128
    q_proj = next(e for e in plan if e.qualified_name == "model.layers.0.self_attn.q_proj.weight")
    assert not q_proj.may_be_fp8 and "is not a multiple of 128 (block" in q_proj.describe(plan.policy)


def test_signatures_are_equal_for_instances_the_policy_treats_alike():
    model = build("llama", "tiny", num_hidden_layers=4)
    plan = Plan(model, Policy(rules=[("model.layers.0.*", None), ("*.3.mlp.*", DelayedScaling())]))
    signatures = [plan.signature(f"model.layers.{i}") for i in range(4)]
    assert signatures[1] == signatures[2]
    assert len(set(signatures)) == 3
    assert plan.signature("model.layers.1.mlp") == plan.signature("model.layers.2.mlp")
    assert plan.signature("model.layers.1.mlp") != plan.signature("model.layers.3.mlp")


@pytest.mark.parametrize("recipe, dims, reason", [
    (None, dict(K=64, N=48), None),
    (None, dict(K=30, N=48), "K=30 is not a multiple of 16"),
    (Float8CurrentScaling(), dict(K=64, N=40), "N=40 is not a multiple of 16"),
    (Float8BlockScaling(), dict(K=128, N=64), f"N=64 is not a multiple of 128 ({Float8BlockScaling().name} tiles)"),
    (Float8BlockScaling(), dict(K=256, N=128), None),
])
def test_eligibility_is_written_once(recipe, dims, reason):
    assert misaligned(recipe, **dims) == reason


def _compiled_decisions(model, policy, plan=None):
    backend = fp8graph.backend.FP8Backend(policy, compiler="eager", model=model, plan=plan)
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x)
    return backend.decisions


def test_each_traced_site_is_joined_to_its_weights_plan_entry():
    model = build("mlp", "tiny")
    policy = Policy(rules=[("mid", None)])
    decisions = _compiled_decisions(model, policy)
    planned = {d.site.path: d.planned for d in decisions}
    plan = Plan(model, policy)
    assert planned == {"up": plan.entry(model.up.weight), "mid": plan.entry(model.mid.weight),
                       "head": plan.entry(model.head.weight)}
    assert all(d.recipe in d.planned.recipes.recipes for d in decisions if d.rewritten)


def test_a_site_running_a_recipe_its_plan_does_not_hold_is_kept_with_the_reason_or_refused_when_strict():
    """Delayed state, weight copies and FSDP2's gathers were arranged from the plan: a traced site that would
    run another recipe stays in high precision saying so (an error naming the module under a strict policy),
    never a site without the buffers it needs."""
    for policy in (Policy(), Policy(strict=True)):
        model = build("mlp", "tiny")
        plan = Plan(model, policy)
        entry = plan.entry(model.up.weight)
        plan._entries[id(model.up.weight)] = dataclasses.replace(
            entry, recipes=dataclasses.replace(entry.recipes, recipes=(None,)))  # a plan that kept up
        reason = r"traced, the policy gives it current\(HYBRID\), which the plan of up.weight"
        if policy.strict:
            with pytest.raises(Exception, match=r"fp8graph: up \(linear\): " + reason):
                _compiled_decisions(model, policy, plan)
            continue
        [up] = [decision for decision in _compiled_decisions(model, policy, plan) if decision.site.path == "up"]
        assert not up.rewritten and re.search(reason, up.reason)


def test_the_entry_holds_what_is_arranged_before_tracing():
    """Delayed state's history length, the kept FP8 copy's recipe and FSDP2's gather recipe come from the entry."""
    from fp8graph.recipes.plan import UNDECIDED

    delayed = DelayedScaling(amax_history_len=8)
    on_tokens = (lambda path, module, site: path == "mid" and site.M > 64, fp8graph.Float8RowwiseScaling())
    model = build("mlp", "tiny")
    plan = Plan(model, Policy(default=delayed, rules=[("up", Float8CurrentScaling()), on_tokens]))
    up, mid, head = plan[model.up.weight], plan[model.mid.weight], plan[model.head.weight]
    assert (up.decided, up.delayed, up.cached) == (Float8CurrentScaling(), None, Float8CurrentScaling())
    # mid's copy is laid out for delayed scaling: a site the rule gives row-wise when traced reads none.
    assert (mid.decided, mid.delayed, mid.cached) == (UNDECIDED, delayed, delayed)
    assert (head.decided, head.delayed, head.cached) == (delayed, delayed, None)  # N=10: never in FP8
    two_lengths = Plan(model, Policy(default=delayed, rules=[(lambda path, module, site: site.M > 64,
                                                              DelayedScaling(amax_history_len=16))]))
    with pytest.raises(ValueError, match=r"^up: .* amax histories of lengths \[8, 16\]"):
        two_lengths[model.up.weight].delayed


def test_the_entry_says_how_its_fp8_weight_copy_lives():
    model = build("mlp", "tiny")  # head (10, 64) never runs in FP8
    policy = Policy(rules=[("mid", DelayedScaling())])
    copies = {name: [e.fp8_copy for e in fp8graph.plan(model, policy, **options)]
              for name, options in (("per call", dict(cache_weights=False)), ("cached", {}),
                                    ("frozen", dict(freeze_weights=True)))}
    # Delayed scaling's copy keeps the scale it was cast with (fp8graph.buffers.weight_cache).
    assert copies == {"per call": ["per call", "per call", None], "cached": ["cached", "cached", None],
                      "frozen": ["frozen", "frozen", None]}
    assert "FP8 copy cached" in fp8graph.plan(model, policy, cache_weights=True).entry(model.up.weight).describe(policy)
    compiled = fp8graph.compile(model, compiler="eager", cache_weights=True)
    assert compiled.fp8graph_backend.plan.entry(model.up.weight).fp8_copy == "cached"
    with pytest.raises(ValueError, match="weight_copies must be one of"):
        Plan(model, policy, "sometimes")
