"""The scaled grouped GEMM: exact emulation, and the native call's layouts and padding checked on meta tensors."""

import pytest
import torch

from fp8graph.gemm.grouped_gemm import (group_columns_for_grad_weight, grouped_scaled_gemm, grouped_scaled_gemm_weights,
                                        placed_for_grad_weight)
from fp8graph.gemm.scaled_gemm import Lowering, NoNativeGemm, choose_lowering
from fp8graph.kernels.transpose_fp8 import transpose_fp8
from fp8graph.numerics.groups import padded_group_sources
from fp8graph.recipes.scaling import Float8CurrentScaling, Float8RowwiseScaling, MXFP8BlockScaling

FP8 = torch.float8_e4m3fn
OFFSETS = torch.tensor([5, 5, 30, 40, 40], dtype=torch.int32)  # experts 1 and 4 empty; rows 40.. in no group
S, K, N, E = 44, 32, 48, 5


def _fp8(*shape, seed):
    torch.manual_seed(seed)
    return torch.randn(*shape).to(FP8)


def _groups():
    ends = OFFSETS.tolist()
    return list(zip([0, *ends[:-1]], ends))


def test_rows_form_is_each_groups_scaled_product_exactly():
    a, b = _fp8(S, K, seed=0), _fp8(E, K, N, seed=1)
    a_inverse, b_inverse = torch.rand(S) + 0.5, torch.rand(E, N) + 0.5
    output = grouped_scaled_gemm(a, a_inverse, b, b_inverse, OFFSETS, torch.float32, Lowering.EMULATED)
    for expert, (start, end) in enumerate(_groups()):
        expected = (a[start:end].double() @ b[expert].double()) * a_inverse[start:end, None].double() \
            * b_inverse[expert].double()
        torch.testing.assert_close(output[start:end].double(), expected, rtol=1e-6, atol=1e-5)
    assert torch.all(output[40:] == 0), "rows in no group"


def test_weights_form_reduces_each_groups_tokens_exactly_and_empty_experts_are_zero():
    a, b = _fp8(S, N, seed=2), _fp8(S, K, seed=3)
    a_inverse, b_inverse = torch.rand(E, N) + 0.5, torch.rand(E, K) + 0.5
    output = grouped_scaled_gemm_weights(a, a_inverse, b, b_inverse, OFFSETS, torch.float32, Lowering.EMULATED)
    assert output.shape == (E, N, K)
    for expert, (start, end) in enumerate(_groups()):
        expected = (a[start:end].double().t() @ b[start:end].double()) * a_inverse[expert, :, None].double() \
            * b_inverse[expert, None, :].double()
        torch.testing.assert_close(output[expert].double(), expected, rtol=1e-6, atol=1e-5)
    assert torch.all(output[[1, 4]] == 0)


def test_padding_groups_to_16_tokens_changes_no_product():
    """The native weights form lays each operand out transposed, every group zero-padded to a multiple of 16
    tokens (fp8graph::transpose_fp8 of the padded groups' source rows): zero rows add nothing."""
    a, b = _fp8(S, N, seed=4), _fp8(S, K, seed=5)
    sources, padded_offsets = padded_group_sources(OFFSETS, S, 16)
    a_padded = transpose_fp8(a, sources)  # (N, S')
    b_padded = transpose_fp8(b, sources)  # (K, S')
    assert a_padded.shape == (N, sources.shape[0]) and b_padded.shape == (K, sources.shape[0])
    pads = sources < 0
    assert torch.all(a_padded.view(torch.uint8)[:, pads] == 0) and torch.all(b_padded.view(torch.uint8)[:, pads] == 0)
    ones_n, ones_k = torch.ones(E, N), torch.ones(E, K)
    padded = grouped_scaled_gemm_weights(a_padded.t(), ones_n, b_padded.t(), ones_k, padded_offsets, torch.float32,
                                         Lowering.EMULATED)
    unpadded = grouped_scaled_gemm_weights(a, ones_n, b, ones_k, OFFSETS, torch.float32, Lowering.EMULATED)
    assert torch.equal(padded, unpadded)


def test_native_lowering_passes_torch_scaled_grouped_mm_its_layouts_and_scales():
    """On meta tensors, torch._scaled_grouped_mm's own checks (E4M3, A row-major, B column-major, 1-D scales of
    the right lengths, BF16 out) pass for every GEMM the target makes."""
    meta = dict(device="meta")
    offsets = torch.empty(E, dtype=torch.int32, **meta)
    x = torch.empty(S, K, dtype=FP8, **meta)
    w = torch.empty(E, N, K, dtype=FP8, **meta)
    output = grouped_scaled_gemm(x, torch.empty(S, **meta), w.transpose(-2, -1), torch.empty(E, N, **meta), offsets,
                                 torch.bfloat16, Lowering.SCALED_MM, use_fast_accum=True)
    assert output.shape == (S, N)
    grad = torch.empty(S, N, dtype=FP8, **meta)
    w_t = torch.empty(E, K, N, dtype=FP8, **meta)  # the grad_input cast, along N
    grad_input = grouped_scaled_gemm(grad, torch.empty(S, **meta), w_t.transpose(-2, -1), torch.empty(E, K, **meta),
                                     offsets, torch.float32, Lowering.SCALED_MM)
    assert grad_input.shape == (S, K) and grad_input.dtype == torch.float32
    x_placed = placed_for_grad_weight(x, offsets, Lowering.SCALED_MM)  # (K, S'): groups padded to 16 tokens
    assert x_placed.shape == (K, -(-(S + 16 * E) // 16) * 16)
    grad_placed = placed_for_grad_weight(grad, offsets, Lowering.SCALED_MM)  # (N, S')
    grad_weight = grouped_scaled_gemm_weights(grad_placed, torch.empty(E, N, **meta), x_placed,
                                              torch.empty(E, K, **meta), offsets, torch.bfloat16, Lowering.SCALED_MM)
    assert grad_weight.shape == (E, N, K)
    # Row-wise: each operand cast per group and column and placed by one kernel, read by the same GEMM.
    grad_hp, x_hp = torch.empty(S, N, dtype=torch.bfloat16, **meta), torch.empty(S, K, dtype=torch.bfloat16, **meta)
    (grad_g, grad_scale), (x_g, x_scale) = (group_columns_for_grad_weight(t, offsets, Lowering.SCALED_MM, True)
                                            for t in (grad_hp, x_hp))
    assert grad_g.shape == grad_placed.shape and x_g.shape == x_placed.shape and x_g.dtype == FP8
    assert grad_scale.shape == (E, N) and x_scale.shape == (E, K)
    grad_weight = grouped_scaled_gemm_weights(grad_g, grad_scale, x_g, x_scale, offsets, torch.bfloat16,
                                              Lowering.SCALED_MM)
    assert grad_weight.shape == (E, N, K)


def test_row_wise_operands_placed_by_one_kernel_are_the_emulations_casts_laid_out():
    """``group_columns_for_grad_weight``: on the native path the op's cast, placed (groups padded to 16 tokens,
    transposed), is the emulated path's cast, rows for rows, with the same scales; gathered rows too."""
    torch.manual_seed(6)
    x_hp = torch.randn(S, K, dtype=torch.bfloat16) * torch.logspace(-3, 3, K, dtype=torch.bfloat16)
    gather = torch.randint(0, S, (S,))
    for index in (None, gather):
        x_emulated, scale_emulated = group_columns_for_grad_weight(x_hp, OFFSETS, Lowering.EMULATED, True, index)
        x_placed, scale = group_columns_for_grad_weight(x_hp, OFFSETS, Lowering.SCALED_MM, True, index)
        sources, _ = padded_group_sources(OFFSETS, S, 16)
        assert torch.equal(scale, scale_emulated)
        assert torch.equal(x_placed.view(torch.uint8), transpose_fp8(x_emulated, sources).view(torch.uint8))


def test_grouped_lowering_is_native_on_sm90_and_mxfp8_on_sm100_never_on_cpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for recipe in (Float8CurrentScaling(), Float8RowwiseScaling()):
        assert choose_lowering(cuda, "auto", recipe, capability=(9, 0), form="grouped") is Lowering.SCALED_MM
        assert choose_lowering(cpu, "auto", recipe, form="grouped") is Lowering.EMULATED
        with pytest.raises(NoNativeGemm, match="_scaled_grouped_mm"):
            choose_lowering(cuda, "auto", recipe, capability=(8, 9), form="grouped")
        with pytest.raises(ValueError, match="_scaled_grouped_mm"):
            choose_lowering(cpu, "scaled_mm", recipe, form="grouped")
    with pytest.raises(NoNativeGemm, match="MXFP8 form"):
        choose_lowering(cuda, "auto", MXFP8BlockScaling(), capability=(9, 0), form="grouped")
    assert choose_lowering(cuda, "auto", MXFP8BlockScaling(), capability=(10, 0), form="grouped") is Lowering.SCALED_MM


def test_the_decode_form_is_native_where_its_triton_kernel_runs():
    """Expert weights gathered per token run fp8graph's gathered GEMV (Triton, SM >= 8.9): emulated on CPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for recipe in (Float8CurrentScaling(), Float8RowwiseScaling()):
        for capability in ((8, 9), (9, 0), (10, 0)):
            assert choose_lowering(cuda, "auto", recipe, capability=capability, form="gathered") is Lowering.SCALED_MM
        assert choose_lowering(cpu, "auto", recipe, form="gathered") is Lowering.EMULATED
        with pytest.raises(NoNativeGemm, match="gathered FP8 GEMV"):
            choose_lowering(cuda, "auto", recipe, capability=(8, 0), form="gathered")
        with pytest.raises(ValueError, match="gathered FP8 GEMV"):
            choose_lowering(cpu, "scaled_mm", recipe, form="gathered")
