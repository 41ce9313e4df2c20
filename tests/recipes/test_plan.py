"""The plan: what a policy gives every weight, before anything is traced (``fp8graph.recipes.plan``)."""

import pytest
import torch

import fp8graph
from fp8graph import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Policy
from fp8graph.models import build
from fp8graph.recipes.plan import Plan
from fp8graph.recipes.scaling import misaligned


def test_each_weight_has_one_entry_with_its_recipes_rule_and_shape_reason():
    model = build("mlp", "tiny")  # up (128, 64), mid (64, 128), head (10, 64)
    plan = fp8graph.plan(model, Policy(rules=[("mid", DelayedScaling())]))
    rows = {entry.qualified_name: entry.describe(plan.policy) for entry in plan}
    assert rows == {
        "up.weight": "current(HYBRID) by default",
        "mid.weight": f"{DelayedScaling()} by rule 0 ('mid')",
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


def test_a_rule_on_the_token_count_leaves_the_weight_undecided_until_traced():
    rule = (lambda path, module, site: site.M > 64, Float8CurrentScaling())
    plan = Plan(build("mlp", "tiny"), Policy(default=None, rules=[rule]))
    entry = next(iter(plan))
    assert entry.recipes.recipes == (Float8CurrentScaling(), None) and entry.recipes.undecided


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
