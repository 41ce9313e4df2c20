"""``fp8graph::quantize_transposed``: an expert weight cast with the forward's scales, in grad_input's layout;
``fp8graph::quantize_both_layouts``: the forward's cast in both GEMMs' layouts, with its tiles' amaxes.

The Triton kernel is checked byte for byte by Triton's interpreter here (a fresh process,
``TRITON_INTERPRET=1``), compiled for sm_90 and sm_100 in ``tests/kernels/test_kernels_compile.py``, and run on a
GPU in ``tests/test_gpu.py``.
"""

import pytest
import torch

from fp8graph.kernels.quantize_tiles import triton_available
from fp8graph.kernels.quantize_transposed import (quantize_both_layouts, quantize_both_layouts_into_,
                                                  quantize_transposed)
from fp8graph.numerics.quantize import finite_magnitude, quantize
from helpers import cases_checked_under_triton_interpreter


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.triton_interpreter
def test_the_triton_kernel_equals_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_quantize_transposed.py") == 147


def test_each_matrix_is_cast_with_its_own_scale_and_stored_transposed():
    weights = torch.randn(3, 24, 40, dtype=torch.bfloat16) * 100
    scale = torch.tensor([[0.5], [4.0], [448.0]])  # (E, 1), as an expert GEMM keeps them; the last saturates
    got = quantize_transposed(weights, scale)
    assert got.shape == (3, 40, 24) and got.dtype == torch.float8_e4m3fn and got.is_contiguous()
    for expert in range(3):
        expected = quantize(weights[expert], scale[expert], torch.float8_e4m3fn).t()
        assert torch.equal(got[expert].view(torch.uint8), expected.contiguous().view(torch.uint8)), expert
    # A weight stored (E, K, N) and read as (E, N, K): its stored layout is the transposed cast's.
    stored = torch.randn(3, 40, 24, dtype=torch.bfloat16)
    assert torch.equal(quantize_transposed(stored.transpose(-2, -1), scale).view(torch.uint8),
                       quantize(stored, scale[:, :, None], torch.float8_e4m3fn).view(torch.uint8))
    # One matrix, one scale; never an alias, even where the transpose of a single row is contiguous already.
    row = torch.randn(1, 16)
    assert quantize_transposed(row, torch.tensor(2.0)).shape == (16, 1)
    for arguments in [(weights, scale), (weights[0].float(), torch.tensor(3.0))]:
        # (opcheck's schema test compares outputs by arithmetic, which FP8 dtypes lack on CPU.)
        torch.library.opcheck(torch.ops.fp8graph.quantize_transposed, arguments,
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_what_it_cannot_cast_is_refused_by_name():
    weights = torch.randn(3, 8, 16)
    with pytest.raises(ValueError, match=r"quantize_transposed's scale is 3 float32 value\(s\) on cpu, one a "
                                         r"matrix, got torch.float32 of shape \(2,\)"):
        quantize_transposed(weights, torch.ones(2))
    with pytest.raises(ValueError, match="scale is 3 float32 .* got torch.float16"):
        quantize_transposed(weights, torch.ones(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="casts a 2-D high-precision tensor .* got torch.float8_e4m3fn"):
        quantize_transposed(weights.to(torch.float8_e4m3fn), torch.ones(3))
    with pytest.raises(ValueError, match=r"got torch.float32 of shape \(2, 3, 8, 16\)"):
        quantize_transposed(weights.expand(2, 3, 8, 16), torch.ones(3))


def test_both_layouts_are_the_cast_and_its_transpose_and_the_tiles_amaxes_are_the_matrix_amax():
    weights = torch.randn(3, 70, 130, dtype=torch.bfloat16) * 100
    weights[0, 5, 5], weights[1, 69, 129], weights[2, 0, 0] = float("nan"), float("inf"), -float("inf")
    scale = torch.tensor([[0.5], [4.0], [448.0]])  # the last saturates
    weight_fp8, weight_t_fp8, amax = quantize_both_layouts(weights, scale, True)
    expected = quantize(weights, scale[:, :, None], torch.float8_e4m3fn)
    assert weight_fp8.is_contiguous() and weight_t_fp8.shape == (3, 130, 70) and weight_t_fp8.is_contiguous()
    assert torch.equal(weight_fp8.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(weight_t_fp8.view(torch.uint8), expected.transpose(-2, -1).contiguous().view(torch.uint8))
    assert amax.shape == (3, 2 * 3) and amax.dtype == torch.float32  # 64 x 64 tiles: 2 along R, 3 along C
    assert torch.equal(amax.amax(dim=1), finite_magnitude(weights).amax(dim=(1, 2)))  # NaN and inf as 0
    assert torch.equal(amax[0, 0], finite_magnitude(weights[0, :64, :64]).amax())
    assert torch.equal(amax[0, 5], finite_magnitude(weights[0, 64:, 128:]).amax())
    # Without the amaxes, an empty partial a matrix; one matrix, one scale; a transposed view read as it lies.
    assert quantize_both_layouts(weights, scale, False)[2].shape == (3, 0)
    stored = torch.randn(40, 24, dtype=torch.bfloat16)
    got = quantize_both_layouts(stored.t(), torch.tensor(2.0), True)
    assert got[0].shape == (24, 40) and got[0].is_contiguous() and got[2].shape == (1,)
    assert torch.equal(got[1].view(torch.uint8), quantize(stored, torch.tensor(2.0), torch.float8_e4m3fn).view(
        torch.uint8))
    finite = torch.randn(3, 70, 130, dtype=torch.bfloat16)  # (opcheck compares outputs, NaN unequal to itself)
    for arguments in [(finite, scale, True), (finite[0].float(), torch.tensor(3.0), False)]:
        torch.library.opcheck(torch.ops.fp8graph.quantize_both_layouts, arguments,
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_what_both_layouts_cannot_cast_is_refused_by_name():
    with pytest.raises(ValueError, match=r"quantize_both_layouts's scale is 3 float32 value\(s\)"):
        quantize_both_layouts(torch.randn(3, 8, 16), torch.ones(2), True)
    with pytest.raises(ValueError, match="quantize_both_layouts casts a 2-D high-precision tensor"):
        quantize_both_layouts(torch.randn(8), torch.ones(1), False)


def test_both_layouts_into_kept_buffers_write_what_the_op_returns():
    weights = torch.randn(3, 70, 130, dtype=torch.bfloat16) * 100
    scale = torch.tensor([[0.5], [4.0], [448.0]])
    expected = quantize_both_layouts(weights, scale, True)
    copy, copy_t = (torch.zeros(shape, dtype=torch.float8_e4m3fn) for shape in ((3, 70, 130), (3, 130, 70)))
    amax = quantize_both_layouts_into_(weights, scale, True, copy, copy_t)
    assert torch.equal(amax, expected[2])
    assert torch.equal(copy.view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(copy_t.view(torch.uint8), expected[1].view(torch.uint8))
    # (opcheck's schema test compares outputs by arithmetic, which FP8 dtypes lack on CPU.)
    torch.library.opcheck(torch.ops.fp8graph.quantize_both_layouts_into_, (weights, scale, False, copy, copy_t),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match=r"writes x_t_fp8 as a contiguous torch.float8_e4m3fn tensor of shape "
                                         r"\(3, 130, 70\) on cpu, got torch.float8_e4m3fn of shape \(3, 70, 130\)"):
        quantize_both_layouts_into_(weights, scale, True, copy, copy)
    with pytest.raises(ValueError, match="writes x_fp8 .* not contiguous"):
        quantize_both_layouts_into_(weights, scale, True, copy_t.transpose(-2, -1), copy_t)
