"""``fp8graph::swiglu_backward_placed`` and ``fp8graph::swiglu_backward_amax``: SwiGLU's backward between two expert
GEMMs, cast as the first GEMM's grad_output and laid out for its grad_weight by one kernel; and their row-wise forms,
``swiglu_backward_rowwise`` and ``swiglu_backward_rowwise_amax`` (the rows a scale a row, the layout a scale a group
and column).

The Triton kernel is checked against the ops' references by Triton's interpreter (a fresh process,
``TRITON_INTERPRET=1``), compiled for sm_90 and sm_100 in ``tests/kernels/test_kernels_compile.py``, and run on a
GPU in ``tests/test_gpu.py``.
"""

import pytest
import torch

from fp8graph.kernels.quantize_tiles import triton_available
from fp8graph.kernels.swiglu_backward import (amax_blocks, swiglu_backward_amax, swiglu_backward_placed,
                                              swiglu_backward_rowwise, swiglu_backward_rowwise_amax)
from fp8graph.kernels.transpose_fp8 import transpose_fp8
from fp8graph.numerics.groups import padded_group_bound, padded_group_sources, quantize_group_columns, row_groups
from fp8graph.numerics.quantize import amax_to_scale, finite_magnitude, quantize
from helpers import cases_checked_under_triton_interpreter

OFFSETS = torch.tensor([5, 5, 30, 40], dtype=torch.int32)  # an empty group; rows 40.. in no group


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.triton_interpreter
def test_the_triton_kernel_equals_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_swiglu_backward.py") == 70


def _autograd_gradient(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gate_up`` through ``silu(gate) * up``, by autograd in fp32."""
    gate_up = gate_up_hp.float().requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(grad_h_hp.float())
    return gate_up.grad


def test_the_ops_are_swiglus_gradient_cast_as_rows_and_placed_with_each_groups_block_amaxes():
    torch.manual_seed(0)
    gate_up_hp = torch.randn(44, 200, dtype=torch.bfloat16) * 3
    grad_h_hp = torch.randn(44, 100, dtype=torch.bfloat16) * torch.logspace(0, 8, 100, base=2.0).bfloat16()
    grad_h_hp[3, 70] = float("nan")
    scale = torch.tensor(0.5)
    rows_fp8, placed, amax = swiglu_backward_placed(gate_up_hp, grad_h_hp, scale, OFFSETS, 16)
    gradient = _autograd_gradient(gate_up_hp, grad_h_hp)
    # Against autograd's gradient (another order of the same products): within one E4M3 step, nearly all equal.
    expected_fp8 = quantize(gradient, scale, torch.float8_e4m3fn)
    finite = ~gradient.isnan()
    got, expected = rows_fp8.float()[finite], expected_fp8.float()[finite]
    assert ((got - expected).abs() <= expected.abs() / 8 + 2.0 ** -9).all()
    assert (got != expected).float().mean() < 0.01
    assert rows_fp8.float()[~finite].isnan().all()
    sources, _ = padded_group_sources(OFFSETS, 44, 16)
    assert placed.shape == (200, padded_group_bound(44, 4, 16)) and placed.is_contiguous()
    assert torch.equal(placed.view(torch.uint8), transpose_fp8(rows_fp8, sources).view(torch.uint8))
    # Each group's (and the rows in no group's) amax of each half's blocks of 64 columns (100: a block and a
    # part), NaN left out, the gate half's first: their max is the gradient's amax.
    groups = row_groups(OFFSETS, 44)
    assert amax.shape == (5, amax_blocks(100)) == (5, 4)
    for group in range(5):
        in_group = finite_magnitude(gradient[groups == group])
        for block, columns in enumerate((slice(0, 64), slice(64, 100), slice(100, 164), slice(164, 200))):
            expected = in_group[:, columns].max() if in_group.shape[0] else torch.tensor(0.0)
            torch.testing.assert_close(amax[group, block], expected, rtol=1e-6, atol=0)
    assert torch.equal(swiglu_backward_amax(gate_up_hp, grad_h_hp, OFFSETS), amax)
    finite_h = grad_h_hp.nan_to_num()  # opcheck compares outputs with assert_close, to which NaN is unequal
    # Without the layout (no grad_weight): the same rows and amaxes, nothing laid out.
    rows_alone = swiglu_backward_placed(gate_up_hp, grad_h_hp, scale, OFFSETS, 16, layout=False)
    assert rows_alone[1].shape == (200, 0)
    assert torch.equal(rows_alone[0].view(torch.uint8), rows_fp8.view(torch.uint8))
    assert torch.equal(rows_alone[2], amax)
    for layout in (True, False):
        torch.library.opcheck(torch.ops.fp8graph.swiglu_backward_placed,
                              (gate_up_hp, finite_h, scale, OFFSETS, 16, layout),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.fp8graph.swiglu_backward_amax, (gate_up_hp, finite_h, OFFSETS),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_bad_operands_are_refused_with_what_the_ops_take():
    gate_up_hp, grad_h_hp = torch.randn(8, 32), torch.randn(8, 16)
    with pytest.raises(ValueError, match="swiglu_backward_amax's grad_h_hp is a 2-D high-precision tensor"):
        swiglu_backward_amax(gate_up_hp, grad_h_hp.to(torch.float8_e4m3fn), OFFSETS)
    with pytest.raises(ValueError, match=r"takes gate_up_hp \(S, 2 I\) and grad_h_hp \(S, I\)"):
        swiglu_backward_amax(gate_up_hp, torch.randn(8, 15), OFFSETS)
    with pytest.raises(ValueError, match="offsets are a non-empty 1-D integer tensor"):
        swiglu_backward_amax(gate_up_hp, grad_h_hp, OFFSETS.float())
    with pytest.raises(ValueError, match="swiglu_backward_placed's scale is one float32 value on cpu"):
        swiglu_backward_placed(gate_up_hp, grad_h_hp, torch.ones(2), OFFSETS, 16)


def test_the_rowwise_ops_are_swiglus_gradient_cast_a_scale_a_row_and_a_scale_a_group_and_column():
    """Row-wise: each row's amax and each group's columns' (the rows in no group's last), and the gradient cast
    with the scales they give, as rows a scale a row and laid out a scale a group and column: what row-wise's cast
    of autograd's fp32 gradient gives (``quantize_group_columns``, then the padded transpose), within one E4M3
    step where the two gradients' products are ordered otherwise (nearly all equal)."""
    torch.manual_seed(0)
    gate_up_hp = torch.randn(44, 200, dtype=torch.bfloat16) * 3
    grad_h_hp = torch.randn(44, 100, dtype=torch.bfloat16) * torch.logspace(0, 8, 100, base=2.0).bfloat16()
    gradient = _autograd_gradient(gate_up_hp, grad_h_hp)
    row_amax, column_amax = swiglu_backward_rowwise_amax(gate_up_hp, grad_h_hp, OFFSETS)
    torch.testing.assert_close(row_amax, finite_magnitude(gradient).amax(dim=1), rtol=1e-6, atol=0)
    expected_fp8, expected_column_scale = quantize_group_columns(gradient, OFFSETS, torch.float8_e4m3fn, True)
    assert column_amax.shape == (5, 200)
    column_scale = amax_to_scale(column_amax, torch.float8_e4m3fn, True)
    torch.testing.assert_close(column_scale[:4], expected_column_scale, rtol=1e-6, atol=0)
    row_scale = amax_to_scale(row_amax, torch.float8_e4m3fn, True)
    rows_fp8, placed = swiglu_backward_rowwise(gate_up_hp, grad_h_hp, row_scale, column_scale, OFFSETS, 16)
    sources, _ = padded_group_sources(OFFSETS, 44, 16)
    for got, expected in ((rows_fp8, quantize(gradient, row_scale[:, None], torch.float8_e4m3fn)),
                          (placed, transpose_fp8(expected_fp8, sources))):
        assert got.shape == expected.shape and got.is_contiguous()
        got, expected = got.float(), expected.float()
        assert ((got - expected).abs() <= expected.abs() / 8 + 2.0 ** -9).all()
        assert (got != expected).float().mean() < 0.01
    # Each row's largest magnitude is cast into the format's top binade (a power-of-2 scale: 224 to 448).
    row_largest = rows_fp8.float().abs().amax(dim=1)
    assert ((row_largest >= 224) & (row_largest <= 448)).all()
    torch.library.opcheck(torch.ops.fp8graph.swiglu_backward_rowwise_amax, (gate_up_hp, grad_h_hp, OFFSETS),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    rows_alone, no_layout = swiglu_backward_rowwise(gate_up_hp, grad_h_hp, row_scale, column_scale, OFFSETS, 16,
                                                    layout=False)
    assert no_layout.shape == (200, 0) and torch.equal(rows_alone.view(torch.uint8), rows_fp8.view(torch.uint8))
    for layout in (True, False):
        torch.library.opcheck(torch.ops.fp8graph.swiglu_backward_rowwise,
                              (gate_up_hp, grad_h_hp, row_scale, column_scale, OFFSETS, 16, layout),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_bad_operands_of_the_rowwise_ops_are_refused_with_what_they_take():
    gate_up_hp, grad_h_hp = torch.randn(8, 32), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"swiglu_backward_rowwise_amax takes gate_up_hp \(S, 2 I\)"):
        swiglu_backward_rowwise_amax(gate_up_hp, torch.randn(8, 15), OFFSETS)
    with pytest.raises(ValueError, match=r"swiglu_backward_rowwise's row_scale is a float32 tensor of shape \(8,\)"):
        swiglu_backward_rowwise(gate_up_hp, grad_h_hp, torch.ones(7), torch.ones(5, 32), OFFSETS, 16)
    with pytest.raises(ValueError, match=r"column_scale is a float32 tensor of shape \(5, 32\) on cpu"):
        swiglu_backward_rowwise(gate_up_hp, grad_h_hp, torch.ones(8), torch.ones(4, 32), OFFSETS, 16)
    with pytest.raises(ValueError, match=r"column_scale is a float32 tensor of shape \(5, 32\) on cpu"):
        swiglu_backward_rowwise(gate_up_hp, grad_h_hp, torch.ones(8), torch.ones(5, 32, dtype=torch.float64),
                                OFFSETS, 16)
