"""``fp8graph::gathered_gemv``: each token row times its own expert's FP8 weight (MoE decode).

The Triton kernel is checked against the plain-torch reference by Triton's interpreter here (a fresh
process, ``TRITON_INTERPRET=1``), compiled for sm_90 and sm_100 in ``tests/kernels/test_kernels_compile.py``,
and run on a GPU in ``tests/test_gpu.py``.
"""

import pytest
import torch

from fp8graph.kernels.gathered_gemv import gathered_gemv, reference_gathered_gemv
from fp8graph.kernels.quantize_tiles import triton_available
from helpers import cases_checked_under_triton_interpreter

_FP8 = torch.float8_e4m3fn


def _operands(rows=6, experts=3, columns=48, depth=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return ((torch.randn(rows, depth, generator=generator) * 20).to(_FP8), torch.rand(rows, generator=generator),
            (torch.randn(experts, columns, depth, generator=generator) * 20).to(_FP8),
            torch.rand(experts, columns, generator=generator), torch.randint(0, experts, (rows,), generator=generator))


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.triton_interpreter
def test_the_triton_kernel_matches_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_gathered_gemv.py") == 16


def test_the_op_multiplies_each_row_by_its_experts_weight():
    x_fp8, x_inverse, weight_fp8, weight_inverse, ids = _operands()
    output = gathered_gemv(x_fp8, x_inverse, weight_fp8, weight_inverse, ids, torch.float32)
    for row, expert in enumerate(ids.tolist()):  # row by row, in fp64
        expected = (weight_fp8[expert].double() @ x_fp8[row].double()) * x_inverse[row] * weight_inverse[expert]
        torch.testing.assert_close(output[row].double(), expected, rtol=1e-6, atol=1e-6)
    assert gathered_gemv(x_fp8, x_inverse, weight_fp8, weight_inverse, ids, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(output, reference_gathered_gemv(x_fp8, x_inverse, weight_fp8, weight_inverse, ids,
                                                       torch.float32))
    # (opcheck's schema test compares outputs by arithmetic, which FP8 dtypes lack on CPU.)
    torch.library.opcheck(torch.ops.fp8graph.gathered_gemv, (x_fp8, x_inverse, weight_fp8, weight_inverse, ids,
                                                             torch.bfloat16),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_the_op_refuses_operands_it_cannot_multiply():
    x_fp8, x_inverse, weight_fp8, weight_inverse, ids = _operands()
    with pytest.raises(ValueError, match="E4M3 operands"):
        gathered_gemv(x_fp8.to(torch.float8_e5m2), x_inverse, weight_fp8, weight_inverse, ids, torch.float32)
    with pytest.raises(ValueError, match=r"x \(S, K\) by weights \(E, N, K\)"):
        gathered_gemv(x_fp8[:, :16], x_inverse, weight_fp8, weight_inverse, ids, torch.float32)
    with pytest.raises(ValueError, match="one integer expert id per row"):
        gathered_gemv(x_fp8, x_inverse, weight_fp8, weight_inverse, ids[:2], torch.float32)
    with pytest.raises(ValueError, match=r"scales are \(S,\) and \(E, N\)"):
        gathered_gemv(x_fp8, x_inverse, weight_fp8, weight_inverse[:, :1], ids, torch.float32)
