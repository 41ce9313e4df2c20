"""``fp8graph::swiglu_forward_placed``: SwiGLU between two expert GEMMs, cast as the down projection's input and laid
out for its grad_weight by the kernel that computes it.

The Triton kernel is checked against the op's reference by Triton's interpreter (a fresh process,
``TRITON_INTERPRET=1``), compiled for sm_90 and sm_100 in ``tests/kernels/test_kernels_compile.py``, and run on a
GPU in ``tests/test_gpu.py``.
"""

import pytest
import torch

from fp8graph.kernels.quantize_tiles import triton_available
from fp8graph.kernels.swiglu_forward import amax_blocks, swiglu_forward_placed
from fp8graph.kernels.group_columns import layout_reference
from fp8graph.numerics.groups import padded_group_bound, row_groups
from fp8graph.numerics.quantize import finite_magnitude, quantize
from helpers import cases_checked_under_triton_interpreter

OFFSETS = torch.tensor([5, 5, 30, 40], dtype=torch.int32)  # an empty group; rows 40.. in no group


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.triton_interpreter
def test_the_triton_kernel_equals_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_swiglu_forward.py") == 45


def test_the_op_is_swiglu_cast_as_rows_and_placed_with_each_groups_block_amaxes():
    """Against ``silu(gate) * up`` by torch's own silu in fp32 (another spelling of the same function): within one
    E4M3 step, nearly all equal; the layout the rows' padded transpose, byte for byte."""
    torch.manual_seed(0)
    gate_up_hp = torch.randn(44, 200, dtype=torch.bfloat16) * 3
    gate_up_hp[:, 100:] *= torch.logspace(0, 6, 100, base=2.0).bfloat16()
    gate_up_hp[3, 170] = float("nan")
    scale = torch.tensor(0.5)
    rows_fp8, placed, amax = swiglu_forward_placed(gate_up_hp, scale, OFFSETS, 16)
    gate, up = gate_up_hp.float().chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    expected_fp8 = quantize(h, scale, torch.float8_e4m3fn)
    finite = ~h.isnan()
    got, expected = rows_fp8.float()[finite], expected_fp8.float()[finite]
    assert ((got - expected).abs() <= expected.abs() / 8 + 2.0 ** -9).all()
    assert (got != expected).float().mean() < 0.01
    assert rows_fp8.float()[~finite].isnan().all() and (~finite).sum() == 1
    assert rows_fp8.shape == (44, 100)
    assert placed.shape == (100, padded_group_bound(44, 4, 16)) and placed.is_contiguous()
    assert torch.equal(placed.view(torch.uint8), layout_reference(rows_fp8, OFFSETS, 16).view(torch.uint8))
    # Each group's (and the rows in no group's) amax of each block of 64 columns (100: a block and a part), NaN
    # left out: their max is h's amax.
    groups = row_groups(OFFSETS, 44)
    assert amax.shape == (5, amax_blocks(100)) == (5, 2)
    for group in range(5):
        in_group = finite_magnitude(h[groups == group])
        for block, columns in enumerate((slice(0, 64), slice(64, 100))):
            expected = in_group[:, columns].max() if in_group.shape[0] else torch.tensor(0.0)
            torch.testing.assert_close(amax[group, block], expected, rtol=1e-6, atol=0)
    # opcheck compares outputs with assert_close, to which NaN is unequal
    torch.library.opcheck(torch.ops.fp8graph.swiglu_forward_placed, (gate_up_hp.nan_to_num(), scale, OFFSETS, 16),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_bad_operands_are_refused_with_what_the_op_takes():
    gate_up_hp = torch.randn(8, 32)
    with pytest.raises(ValueError, match=r"gate_up_hp is a 2-D high-precision tensor of an even width \(S, 2 I\)"):
        swiglu_forward_placed(gate_up_hp[:, :31], torch.tensor(1.0), OFFSETS, 16)
    with pytest.raises(ValueError, match=r"gate_up_hp is a 2-D high-precision tensor"):
        swiglu_forward_placed(gate_up_hp.to(torch.float8_e4m3fn), torch.tensor(1.0), OFFSETS, 16)
    with pytest.raises(ValueError, match="offsets are a non-empty 1-D integer tensor"):
        swiglu_forward_placed(gate_up_hp, torch.tensor(1.0), OFFSETS.float(), 16)
    with pytest.raises(ValueError, match="swiglu_forward_placed's scale is one float32 value on cpu"):
        swiglu_forward_placed(gate_up_hp, torch.ones(2), OFFSETS, 16)
