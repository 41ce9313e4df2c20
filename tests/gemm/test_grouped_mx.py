"""MXFP8 expert GEMMs on SM 10.x (``fp8graph.gemm.grouped_mx``): the scale layouts against torch's own reference
(``to_blocked`` of each group, concatenated, as torch's tests of ``_scaled_grouped_mm`` build them), a reader
of those layouts that recomputes each group's product from them, and the calls against torch's meta checks.
No SM 10.x GPU runs here: ``tests/test_gpu.py`` compares the native GEMMs with the emulation on one."""

import pytest
import torch
from torch.testing._internal.common_quantized import from_blocked, to_blocked

from fp8graph.gemm.grouped_mx import (blocked_column_groups, blocked_row_groups, grouped_mx_gemm,
                                      grouped_mx_gemm_weights)
from fp8graph.gemm.native_tiled import swizzle_mx_scales
from helpers import group_bounds

_E8M0 = torch.float8_e8m0fnu


def _bytes(*shape, seed=0):
    return torch.randint(100, 150, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))



@pytest.mark.parametrize("shape", [(128, 4), (200, 6), (33, 1), (256, 64)])
def test_a_matrix_is_swizzled_as_torchs_reference_lays_it_out(shape):
    scale = _bytes(*shape)
    assert torch.equal(swizzle_mx_scales(scale), to_blocked(scale.view(_E8M0)).view(torch.uint8).flatten())


@pytest.mark.parametrize("ends", [[40, 40, 300, 333], [0, 0, 128], [256, 256, 512, 600]], ids=str)
def test_row_groups_are_laid_out_one_after_another(ends):
    offsets = torch.tensor(ends, dtype=torch.int32)
    scale = _bytes(int(offsets[-1]) + 7, 8)  # 7 rows in no group
    expected = torch.cat([to_blocked(scale[start:end].view(_E8M0)).view(torch.uint8).flatten()
                          for start, end in group_bounds(offsets) if end > start])
    laid_out = blocked_row_groups(scale, offsets).flatten()
    assert torch.equal(laid_out[:expected.numel()], expected)  # the rest is the bound's tail, never read


@pytest.mark.parametrize("ends", [[4, 4, 12, 13], [0, 9], [1, 2, 3, 20]], ids=str)
@pytest.mark.parametrize("rows", [64, 200])
def test_column_groups_are_laid_out_one_after_another(ends, rows):
    offsets = torch.tensor(ends, dtype=torch.int32)  # in scale columns (blocks of 32 tokens)
    scale = _bytes(rows, int(offsets[-1]))
    expected = torch.cat([to_blocked(scale[:, start:end].contiguous().view(_E8M0)).view(torch.uint8).flatten()
                          for start, end in group_bounds(offsets) if end > start])
    laid_out = blocked_column_groups(scale, offsets).flatten()
    assert torch.equal(laid_out[:expected.numel()], expected)


def _dequantized(data_fp8, flat_scales, position, padded_rows):
    """``data_fp8`` (R, C) dequantized with its blocked scales read from ``flat_scales`` at ``position`` (the
    layout torch's reference writes: R padded to 128, C / 32 padded to 4); returns it and the next position."""
    rows, columns = data_fp8.shape
    size = padded_rows * (-(-(columns // 32) // 4) * 4)
    scales = from_blocked(data_fp8, flat_scales[position:position + size].view(_E8M0), 32)
    return data_fp8.float() * scales.float().repeat_interleave(32, 1), position + size


def _padded_128(rows):
    return -(-rows // 128) * 128


def _read_rows_form(a, b, scale_a, scale_b, offs, out_dtype):
    """The rows form as torch's tests lay it out, read back: group e's rows (their scales one block after
    another) times expert e's matrix (its scales in row e)."""
    assert all(end % 32 == 0 for end in offs.tolist()) and b.stride(1) == 1  # (E, K, N) column-major
    output, position = torch.zeros(a.shape[0], b.shape[2]), 0
    for expert, (start, end) in enumerate(group_bounds(offs)):
        if end > start:
            rows, position = _dequantized(a[start:end], scale_a.flatten(), position, _padded_128(end - start))
            weight, _ = _dequantized(b[expert].t(), scale_b[expert], 0, _padded_128(b.shape[2]))
            output[start:end] = rows @ weight.t()
    return output.to(out_dtype)


def _read_weights_form(a, b, scale_a, scale_b, offs, out_dtype):
    """The weights form read back: each group of columns of a (N, S') and of b^T (K, S'), its scales a block."""
    assert all(end % 32 == 0 for end in offs.tolist()) and b.stride(0) == 1  # (S', K) column-major
    b_t = b.t()
    output, positions = torch.zeros(len(offs), a.shape[0], b.shape[1]), [0, 0]
    for expert, (start, end) in enumerate(group_bounds(offs)):
        if end > start:
            a_group, positions[0] = _dequantized(a[:, start:end], scale_a.flatten(), positions[0],
                                                 _padded_128(a.shape[0]))
            b_group, positions[1] = _dequantized(b_t[:, start:end], scale_b.flatten(), positions[1],
                                                 _padded_128(b_t.shape[0]))
            output[expert] = a_group @ b_group.t()
    return output.to(out_dtype)


def _powers_of_two(*shape):
    return 2.0 ** torch.randint(-3, 4, shape).float()


def test_the_rows_form_reads_back_as_each_groups_product(monkeypatch):
    """grouped_mx_gemm pads the groups to 32 rows, lays out the scales, calls the kernel and gathers the rows
    back: with the kernel replaced by a reader of torch's layout, it computes each group's product."""
    torch.manual_seed(0)
    offsets = torch.tensor([40, 40, 100, 133], dtype=torch.int32)
    experts, depth, columns = 4, 64, 48
    a_fp8, a_scale = torch.randn(140, depth).to(torch.float8_e4m3fn), _powers_of_two(140, depth // 32)
    b_fp8 = torch.randn(experts, columns, depth).to(torch.float8_e4m3fn)
    b_scale = _powers_of_two(experts, columns, depth // 32)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _read_rows_form)
    output = grouped_mx_gemm(a_fp8, a_scale, b_fp8, b_scale, offsets, torch.float32)
    expected = torch.zeros(140, columns)
    a_dq = a_fp8.float() / a_scale.repeat_interleave(32, 1)
    for expert, (start, end) in enumerate(group_bounds(offsets)):
        expected[start:end] = a_dq[start:end] @ (b_fp8[expert].float()
                                                 / b_scale[expert].repeat_interleave(32, 1)).t()
    torch.testing.assert_close(output, expected.bfloat16().float())
    assert torch.all(output[133:] == 0), "rows in no group"


def test_the_weights_form_reads_back_as_each_groups_product(monkeypatch):
    torch.manual_seed(0)
    offsets = torch.tensor([64, 64, 160, 192], dtype=torch.int32)  # groups of tokens, padded to 32
    tokens, rows, columns = 224, 40, 200
    a_fp8, a_scale = torch.randn(rows, tokens).to(torch.float8_e4m3fn), _powers_of_two(rows, tokens // 32)
    b_fp8, b_scale = torch.randn(columns, tokens).to(torch.float8_e4m3fn), _powers_of_two(columns, tokens // 32)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _read_weights_form)
    output = grouped_mx_gemm_weights(a_fp8, a_scale, b_fp8, b_scale, offsets, torch.float32)
    a_dq = a_fp8.float() / a_scale.repeat_interleave(32, 1)
    b_dq = b_fp8.float() / b_scale.repeat_interleave(32, 1)
    expected = torch.stack([a_dq[:, start:end] @ b_dq[:, start:end].t()
                            for start, end in group_bounds(offsets)])
    torch.testing.assert_close(output, expected.bfloat16().float())


def test_the_mxfp8_expert_target_computes_on_the_native_path_what_it_emulates(monkeypatch):
    """The whole MXFP8 expert GEMM (forward, grad_input, grad_weight) with the native lowering, its kernel
    replaced by the readers of torch's layout, against the exact emulation: equal up to the kernel's BF16
    output, with ragged groups, an empty expert and rows in no group."""
    from fp8graph.gemm.scaled_gemm import Lowering
    from fp8graph.recipes.scaling import MXFP8BlockScaling
    from fp8graph.targets.grouped import grouped_fp8_target

    torch.manual_seed(0)
    offsets = torch.tensor([13, 13, 90, 150], dtype=torch.int32)
    x, w, grad = torch.randn(155, 64), torch.randn(4, 96, 64), torch.randn(155, 96)
    results = []
    for lowering in (Lowering.SCALED_MM, Lowering.EMULATED):
        if lowering is Lowering.SCALED_MM:
            monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda a, b, *args, **kwargs: (
                _read_rows_form if b.dim() == 3 else _read_weights_form)(a, b, *args, **kwargs))
        x_run, w_run = x.clone().requires_grad_(), w.clone().requires_grad_()
        output = grouped_fp8_target(MXFP8BlockScaling(), lowering)(x_run, w_run, offsets)
        output.backward(grad)
        results.append((output, x_run.grad, w_run.grad))
        monkeypatch.undo()
    for native, emulated in zip(*results):
        torch.testing.assert_close(native, emulated, rtol=1e-2, atol=1e-2 * emulated.abs().max().item())


def test_both_forms_pass_torchs_meta_checks():
    meta = dict(device="meta")
    S, E, N, K = 200, 4, 256, 128
    offsets = torch.empty(E, dtype=torch.int32, **meta)
    output = grouped_mx_gemm(torch.empty(S, K, dtype=torch.float8_e4m3fn, **meta), torch.empty(S, K // 32, **meta),
                             torch.empty(E, N, K, dtype=torch.float8_e4m3fn, **meta),
                             torch.empty(E, N, K // 32, **meta), offsets, torch.float32)
    assert output.shape == (S, N) and output.dtype == torch.float32
    padded = -(-(S + 32 * E) // 32) * 32  # padded_group_rows' bound
    grad_weight = grouped_mx_gemm_weights(torch.empty(N, padded, dtype=torch.float8_e4m3fn, **meta),
                                          torch.empty(N, padded // 32, **meta),
                                          torch.empty(K, padded, dtype=torch.float8_e4m3fn, **meta),
                                          torch.empty(K, padded // 32, **meta), offsets, torch.bfloat16)
    assert grad_weight.shape == (E, N, K)
