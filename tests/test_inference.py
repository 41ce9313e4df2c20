"""Inference with ``freeze_weights``: each weight quantized once, when compiling.

    linear -> gelu -> linear -> gelu -> linear (the tiny MLP, two FP8 sites)

Under ``torch.no_grad()`` Inductor's freezing turns the parameters into
constants and folds what depends on them alone, the weights' amax, scale and
FP8 copy, so a call quantizes only its activations.
"""

import copy
import dataclasses
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fp8graph
from fp8graph.passes.sites import GatheredExpertSite
from fp8graph.models import build

# A reduction over a tensor compiles to C++ that calls max_propagate_nan once per reduced vector.
AMAX_REDUCTION = "max_propagate_nan"


# A frozen constant (E, N, K) in BF16: an expert weight kept in high precision. The router's (E, H) weight is
# kept in BF16 by design; Inductor makes it a frozen constant where oneDNN packs BF16 linears (AMX CPUs).
_EXPERT_WEIGHT_HP = re.compile(r"torch\.bfloat16 \(4, \d+, \d+\)")


def _compile_and_run(model, x, **kwargs):
    torch._dynamo.reset()
    compiled = fp8graph.compile(model, compiler="inductor", **kwargs)
    output, code = run_and_get_code(compiled, x)
    return compiled, output, "\n".join(code)


@pytest.mark.inductor
def test_frozen_weights_are_quantized_once_when_compiling():
    model = build("mlp", "tiny")
    x = torch.randn(32, 64)
    with torch.no_grad():
        _, output, code = _compile_and_run(model, x)
        _, frozen_output, frozen_code = _compile_and_run(model, x, freeze_weights=True)
    torch.testing.assert_close(frozen_output, output)  # the same FP8 numerics
    # Per call, the frozen graph reduces only the two inputs, not the two weights.
    assert code.count(AMAX_REDUCTION) == 2 * frozen_code.count(AMAX_REDUCTION) > 0


@pytest.mark.inductor
def test_freezing_leaves_training_graphs_alone():
    x = torch.randn(32, 64)
    grads = []
    for freeze_weights in (False, True):
        torch._dynamo.reset()
        model = build("mlp", "tiny")
        compiled = fp8graph.compile(model, compiler="inductor", freeze_weights=freeze_weights)
        compiled(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for grad, frozen_grad in zip(*grads, strict=True):
        torch.testing.assert_close(frozen_grad, grad, rtol=0, atol=0)


def test_freeze_weights_needs_inductor():
    with pytest.raises(ValueError, match="freeze_weights needs an nn.Module and compiler='inductor'"):
        fp8graph.compile(build("mlp", "tiny"), compiler="aot_eager", freeze_weights=True)


def _train_then_infer(model, x, compiler="inductor", **kwargs):
    """Two training steps, then one inference call on inputs of another range; its output and stats."""
    torch._dynamo.reset()
    compiled = fp8graph.compile(model, compiler=compiler, stats=True, **kwargs)
    for _ in range(2):
        compiled(x).sum().backward()
    compiled.fp8graph_stats.record(0)
    with torch.no_grad():
        output = compiled(3 * x)
    return output, compiled.fp8graph_stats.record(1)


@pytest.mark.inductor
@pytest.mark.parametrize("recipe", [fp8graph.Float8CurrentScaling(), fp8graph.DelayedScaling()],
                         ids=lambda r: r.name)
def test_frozen_graphs_keep_stats_and_delayed_scales(recipe):
    """Frozen graphs take buffers as graph attributes, not inputs: stats and delayed
    scales must reach their sites all the same and give what unfrozen graphs give."""
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    model = build("mlp", "tiny")
    frozen_model = copy.deepcopy(model)
    # Both cast the weights at every call: a kept copy would hold the first call's cast, whose delayed scale
    # is the empty history's (the weights never change here), where the frozen graph casts with the last one's.
    output, rows = _train_then_infer(model, x, compiler="eager", policy=recipe, cache_weights=False)
    frozen_output, frozen_rows = _train_then_infer(frozen_model, x, policy=recipe, freeze_weights=True)
    # The reference runs the unfrozen graph with fp8graph's eager compiler (no Inductor compile of its own).
    # Freezing folds the weight's amax, scale and cast into constants computed by ATen when
    # compiling, where the frozen graph's other casts run in Inductor's kernels: an fp32 scale
    # may differ in its last bit (measured on an AVX2 CPU: outputs within 1.5e-7, exact on
    # AVX-512), far below FP8's own error. A scale or stat that did not reach its site would
    # be off by whole percents.
    torch.testing.assert_close(frozen_output, output, rtol=1e-5, atol=1e-6)
    assert [(r.path, r.role) for r in frozen_rows] == [(r.path, r.role) for r in rows] == [
        ("up", "input"), ("up", "weight"), ("mid", "input"), ("mid", "weight")]
    for frozen_row, row in zip(frozen_rows, rows):
        # Folded at compile time, a weight's SQNR may round differently in the last bits.
        assert dataclasses.astuple(frozen_row)[3:] == pytest.approx(dataclasses.astuple(row)[3:], rel=1e-5)


@pytest.mark.inductor
def test_frozen_expert_weights_are_fp8_constants():
    """A MoE block's expert weights (E, N, K) are cast once, when compiling: the frozen code holds them as FP8
    constants and no BF16 expert weight, and computes what the unfrozen graph does (up to FP8 casts of
    intermediates Inductor keeps in fp32 where aot_eager rounds them to BF16 first: 38 dB apart)."""
    from helpers import sqnr_db

    model = build("moe", "tiny", dtype=torch.bfloat16).eval()
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = fp8graph.compile(copy.deepcopy(model), compiler="aot_eager")(x)
        _, output, code = _compile_and_run(model, x, freeze_weights=True)
    constants = [line for line in code.splitlines() if line.startswith("_frozen_param") and "= None  #" in line]
    assert sum("float8_e4m3fn (4, 64, 64)" in line for line in constants) == 1  # gate_up, (E, 2I, H)
    assert sum("float8_e4m3fn (4, 32, 64)" in line for line in constants) == 1  # down, (E, H, I) cast along I
    assert not any(_EXPERT_WEIGHT_HP.search(line) for line in constants), "no expert weight in high precision"
    assert sqnr_db(expected.float(), output.float()) > 30


@pytest.mark.inductor
@pytest.mark.parametrize("weights", ["enk", "ekn"])
def test_moe_decode_reads_frozen_fp8_expert_weights_by_expert_id(weights):
    """transformers' batched_mm experts (decode: bmm(W[expert_ids], x)) with frozen weights: each expert GEMM is
    rewritten, the frozen code holds the expert weights as FP8 constants (E, N, K) in the layout the GEMV reads,
    and no BF16 expert weight; the output is what the same weights give in the grouped form (prefill), frozen,
    in FP8 (bit for bit on this CPU; 45 dB allows the two GEMMs' fp32 sums another order). Without freezing
    the decode form is kept, with the reason."""
    from helpers import sqnr_db

    model = build("moe", "tiny", dtype=torch.bfloat16, weights=weights, implementation="batched_mm").eval()
    grouped = build("moe", "tiny", dtype=torch.bfloat16, weights=weights).eval()
    grouped.load_state_dict(model.state_dict())
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    reasons = [r.reason for r in fp8graph.explain(model, x) if r.op == "bmm"]
    assert len(reasons) == 2 and all("needs frozen weights" in reason for reason in reasons)
    with torch.no_grad():
        _, expected, _ = _compile_and_run(grouped, x, freeze_weights=True)
        compiled, output, code = _compile_and_run(model, x, freeze_weights=True)
    decisions = [d for d in compiled.fp8graph_backend.decisions if isinstance(d.site, GatheredExpertSite)]
    assert len(decisions) == 2 and all(d.rewritten for d in decisions)
    constants = [line for line in code.splitlines() if line.startswith("_frozen_param") and "= None  #" in line]
    # FP8 constants as the GEMV reads them (bytes, K contiguous): gate_up (E, 2I, H), down (E, H, I).
    assert sum("uint8 (4, 64, 64) (4096, 64, 1)" in line for line in constants) == 1
    assert sum("uint8 (4, 64, 32) (2048, 32, 1)" in line for line in constants) == 1
    assert not any(_EXPERT_WEIGHT_HP.search(line) for line in constants), "no expert weight in high precision"
    assert sqnr_db(expected.float(), output.float()) > 45
