"""``fp8graph::quantize_group_columns_placed``, ``fp8graph::quantize_rows_placed``,
``fp8graph::quantize_weighted_rows_placed`` and ``fp8graph::quantize_weighted_rows_rowwise``: a grouped GEMM's
weight-gradient operand cast (per group and column, or per tensor with its rows written too, each row weighted or
not; weighted and per group and column with its rows written too, each with its own scale) and laid out for the GEMM
by one kernel.

The Triton kernel is checked byte for byte against the op's reference by Triton's interpreter (a fresh process,
``TRITON_INTERPRET=1``), compiled for sm_90 and sm_100 in ``tests/kernels/test_kernels_compile.py``, and run on a
GPU in ``tests/test_gpu.py``.
"""

import pytest
import torch

from fp8graph.kernels.group_columns import (quantize_expert_columns, quantize_expert_columns_into_,
                                            quantize_group_columns_placed, quantize_rows_placed,
                                            quantize_weighted_rows_placed, quantize_weighted_rows_rowwise,
                                            takes_expert_destinations, takes_expert_weight)
from fp8graph.kernels.quantize_tiles import triton_available
from fp8graph.kernels.transpose_fp8 import transpose_fp8
from fp8graph.numerics.groups import padded_group_bound, padded_group_sources, quantize_group_columns, row_groups
from fp8graph.numerics.quantize import amax_to_scale, finite_magnitude, quantize
from helpers import cases_checked_under_triton_interpreter

OFFSETS = torch.tensor([5, 5, 30, 40], dtype=torch.int32)  # an empty group; rows 40.. in no group


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.triton_interpreter
def test_the_triton_kernel_equals_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_group_columns.py") == 103


def test_the_op_is_the_group_column_cast_placed_and_traces_with_its_fake():
    torch.manual_seed(0)
    x_hp = torch.randn(44, 48, dtype=torch.bfloat16)
    x_t_fp8, scale = quantize_group_columns_placed(x_hp, OFFSETS, 16, False)
    x_fp8, expected_scale = quantize_group_columns(x_hp, OFFSETS, torch.float8_e4m3fn)
    sources, _ = padded_group_sources(OFFSETS, 44, 16)
    assert x_t_fp8.shape == (48, padded_group_bound(44, 4, 16)) and x_t_fp8.is_contiguous()
    assert torch.equal(scale, expected_scale)
    assert torch.equal(x_t_fp8.view(torch.uint8), transpose_fp8(x_fp8, sources).view(torch.uint8))
    # (opcheck's schema test compares outputs by arithmetic, which FP8 dtypes lack on CPU.)
    for gather_index in (None, torch.randint(0, 44, (50,))):
        torch.library.opcheck(torch.ops.fp8graph.quantize_group_columns_placed,
                              (x_hp, OFFSETS, 16, True, gather_index),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_bad_operands_are_refused_with_what_the_op_takes():
    x_hp = torch.randn(8, 16)
    with pytest.raises(ValueError, match="2-D high-precision tensor"):
        quantize_group_columns_placed(x_hp.to(torch.float8_e4m3fn), OFFSETS, 16, False)
    with pytest.raises(ValueError, match="non-empty 1-D integer tensor"):
        quantize_group_columns_placed(x_hp, OFFSETS.float(), 16, False)
    with pytest.raises(ValueError, match="gather_index is a 1-D int64 tensor"):
        quantize_group_columns_placed(x_hp, OFFSETS, 16, False, torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("power_2", [False, True])
def test_the_expert_op_is_each_experts_column_cast_transposed_and_the_group_cast_of_its_rows(power_2):
    """``fp8graph::quantize_expert_columns``: each expert's columns cast along N with their own scale (the amax of
    the finite magnitudes), stored (E, K, N) contiguous; the same bytes and scales as the per-group-and-column cast
    of the (E N, K) rows with each expert's N rows a group. An expert without rows or columns, and none at all, give
    empty casts of their shapes."""
    torch.manual_seed(0)
    weight = torch.randn(3, 24, 40, dtype=torch.bfloat16) * 50
    weight[1, 5, 7], weight[2, :, 3] = float("nan"), 0.0
    weight_t_fp8, scale = quantize_expert_columns(weight, power_2)
    expected_scale = amax_to_scale(finite_magnitude(weight).amax(dim=1), torch.float8_e4m3fn, power_2)
    expected = quantize(weight, expected_scale[:, None, :], torch.float8_e4m3fn).transpose(-2, -1)
    assert weight_t_fp8.shape == (3, 40, 24) and weight_t_fp8.is_contiguous() and scale.shape == (3, 40)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(weight_t_fp8.view(torch.uint8), expected.contiguous().view(torch.uint8))
    rows_fp8, group_scale = quantize_group_columns(weight.reshape(72, 40), torch.tensor([24, 48, 72]),
                                                   torch.float8_e4m3fn, power_2)
    assert torch.equal(group_scale, scale)
    assert torch.equal(rows_fp8.view(torch.uint8).reshape(3, 24, 40).transpose(-2, -1), weight_t_fp8.view(torch.uint8))
    for shape in ((0, 24, 40), (3, 0, 40), (3, 24, 0)):
        empty_fp8, empty_scale = quantize_expert_columns(torch.zeros(shape, dtype=torch.bfloat16), power_2)
        assert empty_fp8.shape == (shape[0], shape[2], shape[1]) and empty_scale.shape == (shape[0], shape[2])
    torch.library.opcheck(torch.ops.fp8graph.quantize_expert_columns, (weight.nan_to_num(), power_2),  # NaN != NaN
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    # Written into a kept copy's buffers: the same bytes and scales, in place.
    copy_fp8, copy_scale = torch.empty(3, 40, 24, dtype=torch.float8_e4m3fn), torch.empty(3, 40)
    assert quantize_expert_columns_into_(weight, power_2, copy_fp8, copy_scale) is None
    assert torch.equal(copy_fp8.view(torch.uint8), weight_t_fp8.view(torch.uint8)) and torch.equal(copy_scale, scale)
    torch.library.opcheck(torch.ops.fp8graph.quantize_expert_columns_into_,
                          (weight.nan_to_num(), power_2, copy_fp8, copy_scale), test_utils=("test_faketensor",))


def test_bad_operands_of_the_expert_op_are_refused_with_what_it_takes():
    with pytest.raises(ValueError, match="3-D high-precision expert weight"):
        quantize_expert_columns(torch.randn(8, 16), False)
    with pytest.raises(ValueError, match="3-D high-precision expert weight"):
        quantize_expert_columns(torch.randn(2, 8, 16).to(torch.float8_e4m3fn), False)
    with pytest.raises(ValueError, match="at most 1024 experts"):
        quantize_expert_columns(torch.randn(1025, 1, 1), False)
    with pytest.raises(ValueError, match="casts a 3-D high-precision expert weight"):  # the weight before its buffers
        quantize_expert_columns_into_(torch.randn(8, 16), False, torch.empty(2, 16, 8, dtype=torch.float8_e4m3fn),
                                      torch.empty(2, 16))
    weight = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match=r"writes weight_t_fp8 as a contiguous torch.float8_e4m3fn tensor of shape "
                                         r"\(2, 16, 8\)"):
        quantize_expert_columns_into_(weight, False, torch.empty(2, 8, 16, dtype=torch.float8_e4m3fn),
                                      torch.empty(2, 16))
    with pytest.raises(ValueError, match="not contiguous"):
        quantize_expert_columns_into_(weight, False, torch.empty(2, 16, 8, dtype=torch.float8_e4m3fn),
                                      torch.empty(16, 2).t())
    # What the op takes: K contiguous, at most 1024 experts; a weight read transposed keeps Inductor's row cast.
    assert takes_expert_weight(weight) and not takes_expert_weight(torch.randn(2, 16, 8).transpose(-2, -1))
    assert not takes_expert_weight(torch.randn(1025, 1, 1))
    # Where the target writes a kept copy through the op: the same conditions as the op's refusals above.
    copy_fp8, copy_scale = torch.empty(2, 16, 8, dtype=torch.float8_e4m3fn), torch.empty(2, 16)
    assert takes_expert_destinations(weight, copy_fp8, copy_scale)
    assert not takes_expert_destinations(weight, copy_fp8.transpose(-2, -1), copy_scale)
    assert not takes_expert_destinations(weight, copy_fp8, torch.empty(16, 2).t())
    assert not takes_expert_destinations(weight, copy_fp8, copy_scale.bfloat16())
    assert not takes_expert_destinations(weight.transpose(-2, -1).contiguous().transpose(-2, -1),
                                         copy_fp8, copy_scale)


def test_the_per_tensor_op_is_the_cast_rows_and_their_placed_copy_with_each_groups_column_amaxes():
    torch.manual_seed(0)
    x_hp = torch.randn(30, 48, dtype=torch.bfloat16) * 100
    x_hp[3, 7] = float("nan")
    gather_index = torch.randint(0, 30, (44,))
    scale = torch.tensor(3.0)
    rows_fp8, x_t_fp8, amax = quantize_rows_placed(x_hp, scale, OFFSETS, 16, gather_index)
    rows_hp = x_hp[gather_index]
    expected_fp8 = quantize(rows_hp, scale, torch.float8_e4m3fn)
    sources, _ = padded_group_sources(OFFSETS, 44, 16)
    assert torch.equal(rows_fp8.view(torch.uint8), expected_fp8.view(torch.uint8))
    assert x_t_fp8.shape == (48, padded_group_bound(44, 4, 16)) and x_t_fp8.is_contiguous()
    assert torch.equal(x_t_fp8.view(torch.uint8), transpose_fp8(expected_fp8, sources).view(torch.uint8))
    # Each group's (and the rows in no group's) amax of each block of 64 columns, NaN left out: their max is the
    # rows' amax. 100 columns: a block and a part.
    wide_hp = torch.randn(30, 100, dtype=torch.bfloat16) * torch.logspace(0, 8, 100, base=2.0).bfloat16()
    wide_hp[3, 70] = float("nan")
    _, _, amax = quantize_rows_placed(wide_hp, scale, OFFSETS, 16, gather_index)
    groups = row_groups(OFFSETS, 44)
    assert amax.shape == (5, 2)
    for group in range(5):
        in_group = finite_magnitude(wide_hp[gather_index][groups == group])
        for block, columns in enumerate((slice(0, 64), slice(64, 100))):
            expected = in_group[:, columns].max() if in_group.shape[0] else torch.tensor(0.0)
            assert amax[group, block] == expected, (group, block)
    assert amax.max() == finite_magnitude(wide_hp[gather_index]).max()
    finite_hp = x_hp.nan_to_num()  # opcheck compares outputs with assert_close, to which NaN is unequal
    for index in (None, gather_index):
        torch.library.opcheck(torch.ops.fp8graph.quantize_rows_placed,
                              (finite_hp if index is not None else finite_hp[gather_index], scale, OFFSETS, 16, index),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_bad_operands_of_the_per_tensor_op_are_refused_with_what_it_takes():
    x_hp = torch.randn(8, 16)
    with pytest.raises(ValueError, match="quantize_rows_placed casts a 2-D high-precision tensor"):
        quantize_rows_placed(x_hp.to(torch.float8_e4m3fn), torch.tensor(1.0), OFFSETS, 16)
    with pytest.raises(ValueError, match="quantize_rows_placed's scale is one float32 value on cpu"):
        quantize_rows_placed(x_hp, torch.ones(2), OFFSETS, 16)
    with pytest.raises(ValueError, match="quantize_rows_placed's scale is one float32 value on meta"):
        quantize_rows_placed(x_hp.to("meta"), torch.tensor(1.0), OFFSETS.to("meta"), 16)
    # A transposed (dense, not contiguous) source: the rows come back row-major, as the fake says.
    torch.library.opcheck(torch.ops.fp8graph.quantize_rows_placed, (torch.randn(16, 44).t(), torch.tensor(2.0),
                                                                    OFFSETS, 16, None),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match="quantize_rows_placed's gather_index is a 1-D int64 tensor"):
        quantize_rows_placed(x_hp, torch.tensor(1.0), OFFSETS, 16, torch.zeros(4, dtype=torch.int32))


def test_the_weighted_op_casts_each_gathered_row_times_its_weight_and_returns_each_rows_dot_with_the_other():
    """The combine's backward: ``g[token_of_row] * w`` cast per tensor (from fp32: the product of two BF16 values is
    exact there), laid out as the per-tensor op lays out its rows, the amaxes of the weighted rows, and each
    gathered row's dot product with ``other`` (the GEMM's output: the routing weights' gradient) before the
    weight. Without ``other`` the same casts and no dots."""
    torch.manual_seed(0)
    grad_hp = torch.randn(30, 100, dtype=torch.bfloat16) * 10
    grad_hp[3, 70] = float("nan")
    token_of_row = torch.randint(0, 30, (44,))
    row_weights = torch.rand(44, dtype=torch.bfloat16)
    row_weights[0] = 0.0
    other_hp = torch.randn(44, 100, dtype=torch.bfloat16)
    scale = torch.tensor(3.0)
    rows_fp8, x_t_fp8, amax, dots = quantize_weighted_rows_placed(grad_hp, row_weights, other_hp, scale, OFFSETS, 16,
                                                                  token_of_row)
    gathered = grad_hp[token_of_row].float()
    weighted = gathered * row_weights.float()[:, None]
    expected_fp8 = quantize(weighted, scale, torch.float8_e4m3fn)
    sources, _ = padded_group_sources(OFFSETS, 44, 16)
    assert torch.equal(rows_fp8.view(torch.uint8), expected_fp8.view(torch.uint8))
    assert torch.equal(x_t_fp8.view(torch.uint8), transpose_fp8(expected_fp8, sources).view(torch.uint8))
    assert amax.shape == (5, 2) and amax.max() == finite_magnitude(weighted).max()
    assert torch.equal(dots, (gathered * other_hp.float()).sum(1))  # NaN where the gathered row holds one
    assert dots.isnan().sum() == (token_of_row == 3).sum()
    no_dots = quantize_weighted_rows_placed(grad_hp, row_weights, None, scale, OFFSETS, 16, token_of_row)
    assert no_dots[3].shape == (0,) and torch.equal(no_dots[1].view(torch.uint8), x_t_fp8.view(torch.uint8))
    # Without the layout (no grad_weight): the same rows, amaxes and dots, nothing laid out.
    rows_alone = quantize_weighted_rows_placed(grad_hp, row_weights, other_hp, scale, OFFSETS, 16, token_of_row,
                                               layout=False)
    assert rows_alone[1].shape == (100, 0) and torch.equal(rows_alone[0].view(torch.uint8), rows_fp8.view(torch.uint8))
    assert torch.equal(rows_alone[2], amax)
    torch.testing.assert_close(rows_alone[3], dots, rtol=0, atol=0, equal_nan=True)
    finite_hp = grad_hp.nan_to_num()
    for other, layout in ((other_hp, True), (None, True), (other_hp, False)):
        torch.library.opcheck(torch.ops.fp8graph.quantize_weighted_rows_placed,
                              (finite_hp, row_weights, other, scale, OFFSETS, 16, token_of_row, layout),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_bad_operands_of_the_weighted_op_are_refused_with_what_it_takes():
    x_hp, index = torch.randn(8, 16), torch.zeros(44, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"one floating-point weight a row \(44\) on cpu"):
        quantize_weighted_rows_placed(x_hp, torch.ones(8), None, torch.tensor(1.0), OFFSETS, 16, index)
    with pytest.raises(ValueError, match=r"one floating-point weight a row \(44\) on cpu"):
        quantize_weighted_rows_placed(x_hp, torch.ones(44, dtype=torch.int64), None, torch.tensor(1.0), OFFSETS, 16,
                                      index)
    with pytest.raises(ValueError, match=r"other rows are \(44, 16\) on cpu"):
        quantize_weighted_rows_placed(x_hp, torch.ones(44), torch.ones(44, 15), torch.tensor(1.0), OFFSETS, 16, index)
    with pytest.raises(ValueError, match="quantize_weighted_rows_placed's scale is one float32 value"):
        quantize_weighted_rows_placed(x_hp, torch.ones(44), None, torch.ones(2), OFFSETS, 16, index)


def test_the_rowwise_weighted_op_casts_each_weighted_row_with_its_scale_and_lays_out_its_group_column_cast():
    """Row-wise's combine backward: ``g[token_of_row] * w`` in fp32, cast twice, each row with its given scale
    (grad_input's operand) and per group and column (grad_weight's, laid out as ``quantize_group_columns_placed``
    lays out a cast; its scales of the weighted rows, not of ``g``'s), and each gathered row's dot product with
    ``other`` before the weight. Without ``other`` the same casts and no dots."""
    torch.manual_seed(0)
    grad_hp = torch.randn(30, 100, dtype=torch.bfloat16) * 10
    grad_hp[3, 70] = float("nan")
    token_of_row = torch.randint(0, 30, (44,))
    row_weights = torch.rand(44, dtype=torch.bfloat16) * 4
    row_weights[0] = 0.0
    other_hp = torch.randn(44, 100, dtype=torch.bfloat16)
    row_scale = torch.rand(44) * 10
    rows_fp8, x_t_fp8, scale, dots = quantize_weighted_rows_rowwise(grad_hp, row_weights, other_hp, row_scale,
                                                                    OFFSETS, 16, True, token_of_row)
    gathered = grad_hp[token_of_row].float()
    weighted = gathered * row_weights.float()[:, None]
    assert torch.equal(rows_fp8.view(torch.uint8),
                       quantize(weighted, row_scale[:, None], torch.float8_e4m3fn).view(torch.uint8))
    weighted_fp8, expected_scale = quantize_group_columns(weighted, OFFSETS, torch.float8_e4m3fn, True)
    assert torch.equal(scale, expected_scale) and scale.shape == (4, 100)
    # The scales are the weighted rows': not those of the rows before the weights.
    assert not torch.equal(scale, quantize_group_columns(gathered, OFFSETS, torch.float8_e4m3fn, True)[1])
    sources, _ = padded_group_sources(OFFSETS, 44, 16)
    assert torch.equal(x_t_fp8.view(torch.uint8), transpose_fp8(weighted_fp8, sources).view(torch.uint8))
    assert torch.equal(dots, (gathered * other_hp.float()).sum(1))
    no_dots = quantize_weighted_rows_rowwise(grad_hp, row_weights, None, row_scale, OFFSETS, 16, True, token_of_row)
    assert no_dots[3].shape == (0,) and torch.equal(no_dots[1].view(torch.uint8), x_t_fp8.view(torch.uint8))
    # Without the layout (no grad_weight): the same rows and dots; no layout, no scales for it.
    rows_alone = quantize_weighted_rows_rowwise(grad_hp, row_weights, other_hp, row_scale, OFFSETS, 16, True,
                                                token_of_row, layout=False)
    assert rows_alone[1].shape == (100, 0) and rows_alone[2].shape == (4, 0)
    assert torch.equal(rows_alone[0].view(torch.uint8), rows_fp8.view(torch.uint8))
    assert torch.equal(rows_alone[3], dots)
    finite_hp = grad_hp.nan_to_num()
    for other, layout in ((other_hp, True), (None, True), (other_hp, False)):
        torch.library.opcheck(torch.ops.fp8graph.quantize_weighted_rows_rowwise,
                              (finite_hp, row_weights, other, row_scale, OFFSETS, 16, False, token_of_row, layout),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_bad_operands_of_the_rowwise_weighted_op_are_refused_with_what_it_takes():
    x_hp, index = torch.randn(8, 16), torch.zeros(44, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"quantize_weighted_rows_rowwise takes one floating-point weight a row"):
        quantize_weighted_rows_rowwise(x_hp, torch.ones(8), None, torch.ones(44), OFFSETS, 16, False, index)
    with pytest.raises(ValueError, match=r"quantize_weighted_rows_rowwise's other rows are \(44, 16\) on cpu"):
        quantize_weighted_rows_rowwise(x_hp, torch.ones(44), torch.ones(44, 15), torch.ones(44), OFFSETS, 16, False,
                                       index)
    with pytest.raises(ValueError, match=r"row_scale is one float32 scale a row \(44\) on cpu"):
        quantize_weighted_rows_rowwise(x_hp, torch.ones(44), None, torch.ones(44, dtype=torch.float64), OFFSETS, 16,
                                       False, index)
    with pytest.raises(ValueError, match=r"row_scale is one float32 scale a row \(44\) on cpu"):
        quantize_weighted_rows_rowwise(x_hp, torch.ones(44), None, torch.ones(43), OFFSETS, 16, False, index)
    with pytest.raises(ValueError, match="quantize_weighted_rows_rowwise casts a 2-D high-precision tensor"):
        quantize_weighted_rows_rowwise(x_hp[0], torch.ones(44), None, torch.ones(44), OFFSETS, 16, False, index)
