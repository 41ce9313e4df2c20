"""Lowering choice and the cuBLAS path, checked on CPU.

``lowering="scaled_mm"`` on CPU runs the graph the GPU runs (padding,
layouts, ``torch._scaled_mm`` calls) on ``_scaled_mm``'s CPU kernel: the
products of FP8 values are exact in fp32, so it agrees with the emulation up
to accumulation order.
"""

import re

import pytest
import torch

import fp8graph
import fp8graph.backend
import fp8graph.passes.pipeline
import fp8graph.gemm.scaled_gemm
from fp8graph import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling
from fp8graph.targets.linear_tensorwise import linear_fp8_target
from fp8graph.targets.linear_tiled import linear_tiled_target
from fp8graph.gemm.padding import pad_reduction_dim
from fp8graph.gemm.scaled_gemm import Lowering, NoNativeGemm, choose_lowering, has_cpu_kernel, scaled_gemm
from helpers import sqnr_db
from fp8graph.models import build
from fp8graph.numerics.quantize import quantize_current


def test_auto_lowering_emulates_on_cpu():
    assert choose_lowering(torch.device("cpu")) is Lowering.EMULATED
    assert choose_lowering(torch.device("cpu"), "emulated") is Lowering.EMULATED


# torch 2.13's CPU kernel takes row-wise scales; torch 2.11's takes per-tensor scales only.
ROWWISE_ON_CPU = has_cpu_kernel(Float8RowwiseScaling())
needs_rowwise_on_cpu = pytest.mark.skipif(not ROWWISE_ON_CPU, reason="this torch's CPU _scaled_mm takes "
                                                                      "per-tensor scales only")


def test_scaled_mm_can_be_asked_for_on_cpu_where_its_kernel_runs_the_recipe():
    cpu = torch.device("cpu")
    for recipe in (None, Float8CurrentScaling(), Float8RowwiseScaling()):
        assert choose_lowering(cpu, "auto", recipe) is Lowering.EMULATED  # the CPU kernel is slow
    for recipe in (None, Float8CurrentScaling()):
        assert choose_lowering(cpu, "scaled_mm", recipe) is Lowering.SCALED_MM
    if ROWWISE_ON_CPU:
        assert choose_lowering(cpu, "scaled_mm", Float8RowwiseScaling()) is Lowering.SCALED_MM
    else:
        with pytest.raises(ValueError, match=r"rowwise.* needs a CUDA device"):
            choose_lowering(cpu, "scaled_mm", Float8RowwiseScaling())


CUDA = torch.device("cuda")
CURRENT, ROWWISE, BLOCK, MX = (Float8CurrentScaling(), Float8RowwiseScaling(), fp8graph.Float8BlockScaling(),
                               fp8graph.MXFP8BlockScaling())


@pytest.mark.parametrize("recipe,capability,native", [
    (CURRENT, (8, 0), False), (CURRENT, (8, 9), True), (CURRENT, (9, 0), True), (CURRENT, (10, 0), True),
    (ROWWISE, (8, 6), False), (ROWWISE, (9, 0), True),
    (BLOCK, (8, 9), False), (BLOCK, (9, 0), True), (BLOCK, (10, 0), False),
    (MX, (9, 0), False), (MX, (10, 0), True), (MX, (12, 0), False),
])
def test_a_cuda_device_without_the_recipes_gemm_gets_no_silent_emulation(recipe, capability, native):
    """The decision, given a compute capability: native GEMM, or a refusal naming recipe and device."""
    if native:
        assert choose_lowering(CUDA, "auto", recipe, capability=capability) is Lowering.SCALED_MM
        assert choose_lowering(CUDA, "scaled_mm", recipe, capability=capability) is Lowering.SCALED_MM
    else:
        with pytest.raises(NoNativeGemm, match=rf"{re.escape(recipe.name)} has no native FP8 GEMM on cuda "
                                                rf"\(compute capability {capability[0]}\.{capability[1]}\)"):
            choose_lowering(CUDA, "auto", recipe, capability=capability)
        with pytest.raises(ValueError, match=r"lowering='scaled_mm': .* many times slower than BF16") as raised:
            choose_lowering(CUDA, "scaled_mm", recipe, capability=capability)
        assert not isinstance(raised.value, NoNativeGemm)  # asked for explicitly: an error, not a reason
    # Emulation only when asked for; the CPU always emulates.
    assert choose_lowering(CUDA, "emulated", recipe, capability=capability) is Lowering.EMULATED
    assert choose_lowering(torch.device("cpu"), "auto", recipe) is Lowering.EMULATED


def test_activation_matmuls_are_emulated_on_cuda_only_when_asked():
    with pytest.raises(NoNativeGemm, match="activation matmul"):
        choose_lowering(CUDA, "auto", CURRENT, capability=(9, 0), form="batched")
    assert choose_lowering(CUDA, "emulated", CURRENT, capability=(9, 0), form="batched") is Lowering.EMULATED
    assert choose_lowering(torch.device("cpu"), "scaled_mm", CURRENT, form="batched") is Lowering.EMULATED


def _passes_on_a_pretend_gpu(monkeypatch, capability, policy):
    """Run fp8graph's passes over a tiny Llama's graph as if its parameters were on a GPU of ``capability``."""
    monkeypatch.setattr(fp8graph.passes.pipeline, "graph_device", lambda example_inputs: CUDA)
    monkeypatch.setattr(fp8graph.gemm.scaled_gemm, "_capability", lambda device: capability)
    backend = fp8graph.backend.FP8Backend(policy=policy, compiler="eager", model=(model := build("llama", "tiny-blocks")))
    tokens = torch.randint(0, 250, (2, 16))
    torch._dynamo.optimize(backend)(model)(tokens)
    return backend.decisions


def test_sites_stay_in_high_precision_with_the_reason_when_the_device_lacks_the_recipes_gemm(monkeypatch):
    decisions = _passes_on_a_pretend_gpu(monkeypatch, (9, 0), fp8graph.Policy(default=MX))
    down_proj = next(d for d in decisions if d.site.path == "model.layers.0.mlp.down_proj")
    assert not down_proj.rewritten
    assert down_proj.reason.startswith("mxfp8(E4M3, 1x32, E8M0) has no native FP8 GEMM on cuda (compute capability "
                                       "9.0): it needs a CUDA device of compute capability 10.x (SM100)")
    assert not any(d.rewritten for d in decisions)


def test_a_strict_policy_raises_naming_the_module_when_the_device_lacks_the_recipes_gemm(monkeypatch):
    with pytest.raises(Exception, match=r"model.layers.0.self_attn.q_proj \(linear\): block\(1x128/128x128, "
                                        r"pow2\) has no native FP8 GEMM on cuda \(compute capability 10.0\)"):
        _passes_on_a_pretend_gpu(monkeypatch, (10, 0), fp8graph.Policy(default=BLOCK, strict=True))


def test_unknown_lowering_is_refused():
    with pytest.raises(ValueError, match="lowering must be one of"):
        choose_lowering(torch.device("cpu"), "cutlass")


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("k", [1, 17, 30, 32])
def test_reduction_dim_padding_is_exact(fp8_dtype, k):
    # The weight-gradient GEMM reduces over tokens: M=17 tokens gives K=17 there.
    a_fp8, a_scale = quantize_current(torch.randn(48, k), fp8_dtype)
    b_fp8, b_scale = quantize_current(torch.randn(k, 32), torch.float8_e4m3fn)
    a_padded, b_padded = pad_reduction_dim(a_fp8, b_fp8)
    assert a_padded.shape[1] % 16 == 0 and a_padded.shape[1] == b_padded.shape[0]
    assert a_padded.dtype == fp8_dtype and b_padded.dtype == torch.float8_e4m3fn
    unpadded = scaled_gemm(a_fp8, a_scale, b_fp8, b_scale, torch.float32, Lowering.EMULATED)
    padded = scaled_gemm(a_padded, a_scale, b_padded, b_scale, torch.float32, Lowering.EMULATED)
    torch.testing.assert_close(padded, unpadded, rtol=0, atol=0)
    assert (a_padded.float()[:, k:] == 0).all() and (b_padded.float()[k:] == 0).all()


def _three_gemms(target, tokens, generator_seed=0):
    """output, grad_input and grad_weight of ``target`` on (tokens, 256) x (384, 256), bfloat16 out."""
    generator = torch.Generator().manual_seed(generator_seed)
    input_hp = torch.randn(tokens, 256, generator=generator, dtype=torch.bfloat16).requires_grad_()
    weight_hp = torch.randn(384, 256, generator=generator, dtype=torch.bfloat16).requires_grad_()
    grad_output = torch.randn(tokens, 384, generator=generator, dtype=torch.bfloat16)
    output = target(input_hp, weight_hp)
    output.backward(grad_output)
    return output.detach().float(), input_hp.grad.float(), weight_hp.grad.float()


def _delayed_target(recipe, lowering):
    """A delayed-scaling linear with fresh state (scale 1, empty history): its transposed layouts go through
    ``fp8graph::transpose_fp8`` on the scaled_mm path."""
    def linear(input_hp, weight_hp):
        history, scale = torch.zeros(2, recipe.amax_history_len), torch.ones(2)
        grad_history, grad_scale = torch.zeros(1, recipe.amax_history_len), torch.ones(1)
        return linear_fp8_target(recipe, lowering)(input_hp, weight_hp, None, None, history, scale, grad_history,
                                                   grad_scale)
    return linear


@pytest.mark.parametrize("tokens", [512, 17])  # 17: the weight-gradient GEMM's K is zero-padded to 32
@pytest.mark.parametrize("recipe, target_of", [
    pytest.param(Float8CurrentScaling(), linear_fp8_target, id="current"),
    pytest.param(DelayedScaling(amax_history_len=4), _delayed_target, id="delayed"),
    pytest.param(Float8RowwiseScaling(), linear_tiled_target, id="rowwise", marks=needs_rowwise_on_cpu)])
def test_scaled_mm_path_matches_emulation_on_cpu(recipe, target_of, tokens):
    native = _three_gemms(target_of(recipe, Lowering.SCALED_MM), tokens)
    emulated = _three_gemms(target_of(recipe, Lowering.EMULATED), tokens)
    for name, on_kernel, reference in zip(("output", "grad_input", "grad_weight"), native, emulated):
        # Same FP8 products; accumulation order and one bfloat16 rounding differ.
        # Measured: 52-53 dB.
        assert sqnr_db(reference, on_kernel) > 45, name


@pytest.mark.parametrize("policy", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_llama_trains_through_the_scaled_mm_path_on_cpu(policy):
    """The whole model with the GPU's GEMM calls: token counts that need padding, symbolic under dynamic=True;
    delayed scaling with its transposed layouts read from FP8 (``fp8graph::transpose_fp8``). The emulated
    reference runs fp8graph's eager compiler (the same ATen ops as aot_eager, without AOTAutograd's trace)."""
    results = {}
    for lowering, compiler in (("emulated", "eager"), ("scaled_mm", "aot_eager")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build("llama", "tiny")
        compiled = fp8graph.compile(model, policy=policy, compiler=compiler, lowering=lowering, dynamic=True)
        losses = []
        for sequence in (17, 40):
            tokens = torch.randint(0, 250, (2, sequence), generator=torch.Generator().manual_seed(sequence))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(tokens, labels=tokens).loss
            loss.backward()
            losses.append(loss.item())
        lowerings = {d.lowering for d in compiled.fp8graph_backend.decisions if d.rewritten}
        assert lowerings == {Lowering(lowering)}
        results[lowering] = losses, [p.grad for p in model.parameters()]
    (emulated_losses, emulated_grads), (native_losses, native_grads) = results.values()
    torch.testing.assert_close(native_losses, emulated_losses, rtol=1e-3, atol=0)
    for native, emulated in zip(native_grads, emulated_grads, strict=True):
        # Measured: 27 dB at worst (embedding: differences in one GEMM flip FP8 roundings
        # of the next); a wrong layout or scale gives a few dB.
        assert sqnr_db(emulated.float(), native.float()) > 20
