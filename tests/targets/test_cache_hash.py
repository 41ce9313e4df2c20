"""Compiles of one model under different policies never share stale code; equal ones share it.

The policy shapes the ATen graph the rewrite produces (HYBRID quantizes
grad_output to E5M2, E4M3 does not), and that graph is what Inductor's FX
graph cache keys on: equal graphs may share code, different ones may not.
"""

import contextlib
import logging
import pathlib
import re
import unittest.mock

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache, run_and_get_code

import fp8graph
import fp8graph.gemm.scaled_gemm
from fp8graph import DelayedScaling, Float8CurrentScaling, Format
from fp8graph.targets import cache_hash
from fp8graph.targets.linear_tensorwise import linear_fp8_target
from fp8graph.targets.linear_tiled import linear_tiled_target
from fp8graph.targets.matmul import matmul_fp8_target
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


def _delayed_step(recipe):
    """A training step with ``recipe`` from a fresh Dynamo; the input gradient and the AOTAutograd cache counters."""
    torch._dynamo.reset()
    counters.clear()
    model = build("mlp", "tiny")
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    # One graph, casting at every call (a kept weight copy would add a second graph, reading it).
    compiled = fp8graph.compile(model, policy=recipe, compiler="inductor", cache_weights=False)
    for _ in range(2):  # the second step casts with scales from the first one's amaxes
        compiled(x).sum().backward()
    return x.grad, dict(counters["aot_autograd"])


def test_aot_autograd_cache_reuses_a_graph_only_for_the_same_recipe():
    """fp8graph's graph targets carry a hash of what they compute, so AOTAutograd caches
    their graphs (a warm start skips the AOT trace); another recipe, or another fp8graph
    source with the same target names, must miss."""
    margin_0, margin_1 = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=1)
    bypasses = _BypassReasons()
    cache_log = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    level = cache_log.level
    cache_log.addHandler(bypasses)
    cache_log.setLevel(logging.INFO)
    # The caches on, whatever an earlier test in this process left switched.
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        grad, first = _delayed_step(margin_0)
        grad_again, again = _delayed_step(margin_0)
        margin_1_grad, other = _delayed_step(margin_1)
        with _another_fp8graph_source():
            _, new_source = _delayed_step(margin_0)
    assert new_source.get("autograd_cache_miss") == 1 and "autograd_cache_hit" not in new_source
    cache_log.removeHandler(bypasses)
    cache_log.setLevel(level)
    assert first.get("autograd_cache_saved") == 1 and "autograd_cache_hit" not in first, bypasses.reasons
    assert again.get("autograd_cache_hit") == 1
    torch.testing.assert_close(grad_again, grad, rtol=0, atol=0)
    assert other.get("autograd_cache_miss") == 1 and "autograd_cache_hit" not in other
    torch._dynamo.reset()
    margin_1_reference = _eager_delayed_grad(margin_1)
    torch.testing.assert_close(margin_1_grad, margin_1_reference, rtol=1e-6, atol=1e-6)


class _BypassReasons(logging.Handler):
    """What AOTAutograd's cache logs when it bypasses a graph, for the assertion's message."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reasons = []

    def emit(self, record):
        message = record.getMessage()
        if "ypass" in message:
            self.reasons.append(message)


def _eager_delayed_grad(recipe):
    model = build("mlp", "tiny")
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    compiled = fp8graph.compile(model, policy=recipe, compiler="eager", cache_weights=False)
    for _ in range(2):
        compiled(x).sum().backward()
    return x.grad


@contextlib.contextmanager
def _another_fp8graph_source():
    """As if fp8graph's source had changed: new hashes for newly made targets."""
    targets = (linear_fp8_target, linear_tiled_target, matmul_fp8_target)
    for target in targets:
        target.cache_clear()
    with unittest.mock.patch.object(cache_hash, "source_hash", lambda: "another source"):
        yield
    for target in targets:
        target.cache_clear()


def test_a_target_made_again_with_the_same_identity_is_the_one_published():
    """A cached factory called with its defaults spelled out makes the same target, not a second function
    under the same name (pickle, and so the cache, would refuse graphs calling the first)."""
    from fp8graph.gemm.scaled_gemm import Lowering

    recipe = DelayedScaling(amax_history_len=4)
    short = linear_fp8_target(recipe, Lowering.EMULATED)
    spelled_out = linear_fp8_target(recipe, Lowering.EMULATED, True, False, None)
    assert spelled_out is short
    assert getattr(cache_hash, short.__qualname__) is short


def test_the_hash_covers_every_module_a_target_traces_through():
    """A target's graph is what the GEMM, numerics and kernel modules it calls trace to: a change to any of
    them must miss the cache. (The hash once covered ``fp8graph/targets`` alone, and a changed scale layout in
    ``fp8graph/gemm`` was served the graph compiled before it.)"""
    import fp8graph.passes

    hashed = {path for _, path in cache_hash.hashed_sources()}
    for package in (fp8graph, fp8graph.passes):
        for folder in package.__path__:
            sources = set(pathlib.Path(folder).resolve().rglob("*.py"))
            assert sources and sources <= hashed, sorted(map(str, sources - hashed))[:5]
    assert pathlib.Path(fp8graph.gemm.scaled_gemm.__file__).resolve() in hashed
