"""Compiles of one model under different policies never share stale code.

The policy shapes the ATen graph the rewrite produces (HYBRID quantizes
grad_output to E5M2, E4M3 does not), and that graph is what Inductor's FX
graph cache keys on: equal graphs may share code, different ones may not.
"""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fp8graph
from fp8graph import Float8CurrentScaling, Format
from fp8graph.models import build

pytestmark = pytest.mark.inductor


def test_policies_get_their_own_code_with_the_fx_graph_cache_on():
    model, x = build("mlp", "tiny"), torch.randn(64, 64)

    def step(compiled):
        model.zero_grad(set_to_none=True)
        compiled(x).sum().backward()
        return model.up.weight.grad.clone()

    results = {}
    with torch._inductor.config.patch(fx_graph_cache=True):
        for policy in (Float8CurrentScaling(), Float8CurrentScaling(Format.E4M3), Float8CurrentScaling()):
            torch._dynamo.reset()
            grad, (forward_code, backward_code) = run_and_get_code(
                step, fp8graph.compile(model, policy=policy, compiler="inductor"))
            results.setdefault(policy, []).append((grad, len(re.findall("e5m2", backward_code, re.I))))
    (hybrid_grad, hybrid_e5m2), (hybrid_again_grad, hybrid_again_e5m2) = results[Float8CurrentScaling()]
    [(e4m3_grad, e4m3_e5m2)] = results[Float8CurrentScaling(Format.E4M3)]
    assert hybrid_e5m2 > 0 and hybrid_again_e5m2 > 0  # grad_output cast to E5M2
    assert e4m3_e5m2 == 0  # ... and not under Format.E4M3, even right after a HYBRID compile
    assert not torch.equal(hybrid_grad, e4m3_grad)
    torch.testing.assert_close(hybrid_again_grad, hybrid_grad, rtol=0, atol=0)
