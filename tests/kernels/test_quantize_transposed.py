"""``fp8graph::quantize_transposed``: an expert weight cast with the forward's scales, in grad_input's layout.

The Triton kernel is checked byte for byte by Triton's interpreter here (a fresh process,
``TRITON_INTERPRET=1``), compiled for sm_90 and sm_100 in ``tests/kernels/test_kernels_compile.py``, and run on a
GPU in ``tests/test_gpu.py``.
"""

import pytest
import torch

from fp8graph.kernels.quantize_tiles import triton_available
from fp8graph.kernels.quantize_transposed import quantize_transposed
from fp8graph.numerics.quantize import quantize
from helpers import cases_checked_under_triton_interpreter


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_the_triton_kernel_equals_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_quantize_transposed.py") == 63


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
