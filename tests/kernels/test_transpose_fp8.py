"""``fp8graph::transpose_fp8``: the transposed layout of a delayed cast, read from its FP8 bytes.

The Triton kernel is checked byte for byte by Triton's interpreter here (a
fresh process, ``TRITON_INTERPRET=1``), compiled for sm_90 and sm_100 in
``tests/kernels/test_kernels_compile.py``, and run on a GPU in ``tests/test_gpu.py``.
"""

import pytest
import torch

from fp8graph.kernels.quantize_tiles import triton_available
from fp8graph.kernels.transpose_fp8 import transpose_fp8, transpose_fp8_into_
from helpers import cases_checked_under_triton_interpreter

@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.triton_interpreter
def test_the_triton_transpose_equals_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_transpose_fp8.py") == 39


def test_the_op_copies_on_cpu_and_traces_with_its_fake():
    x_fp8 = torch.randn(48, 80).to(torch.float8_e5m2)
    x_t_fp8 = transpose_fp8(x_fp8)
    assert x_t_fp8.is_contiguous() and x_t_fp8.dtype == torch.float8_e5m2
    assert torch.equal(x_t_fp8.view(torch.uint8), x_fp8.t().contiguous().view(torch.uint8))
    # Never an alias of its input, even where the transpose of a single row is already contiguous.
    one_row = torch.randn(1, 16).to(torch.float8_e4m3fn)
    assert transpose_fp8(one_row).data_ptr() != one_row.data_ptr()
    # (opcheck's schema test compares outputs by arithmetic, which FP8 dtypes lack on CPU.)
    torch.library.opcheck(torch.ops.fp8graph.transpose_fp8, (torch.randn(32, 48).to(torch.float8_e4m3fn),),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.fp8graph.transpose_fp8,
                          (torch.randn(32, 48).to(torch.float8_e4m3fn), torch.tensor([3, -1, 31, 0, -1])),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_a_batch_is_transposed_matrix_by_matrix_into_a_new_tensor_or_a_given_one():
    weights_fp8 = torch.randn(4, 24, 40).to(torch.float8_e4m3fn)
    expected = weights_fp8.transpose(-2, -1).contiguous().view(torch.uint8)
    assert torch.equal(transpose_fp8(weights_fp8).view(torch.uint8), expected)
    copy = torch.zeros(4, 40, 24, dtype=torch.float8_e4m3fn)
    assert transpose_fp8_into_(weights_fp8, copy) is None
    assert torch.equal(copy.view(torch.uint8), expected)
    # A transposed view is read as the view: its transpose is the stored tensor.
    stored = torch.randn(4, 40, 24).to(torch.float8_e4m3fn)
    transpose_fp8_into_(stored.transpose(-2, -1), copy)
    assert torch.equal(copy.view(torch.uint8), stored.view(torch.uint8))
    torch.library.opcheck(torch.ops.fp8graph.transpose_fp8_into_, (weights_fp8, copy),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.fp8graph.transpose_fp8, (weights_fp8,),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match=r"float8_e4m3fn tensor of shape \(4, 40, 24\) on cpu, got .* \(4, 24, 40\)"):
        transpose_fp8_into_(weights_fp8, torch.zeros(4, 24, 40, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="not contiguous"):
        transpose_fp8_into_(weights_fp8, torch.zeros(4, 24, 40, dtype=torch.float8_e4m3fn).transpose(-2, -1))
    with pytest.raises(ValueError, match="float8_e4m3fn tensor of shape .* got torch.float8_e5m2"):
        transpose_fp8_into_(weights_fp8, torch.zeros(4, 40, 24, dtype=torch.float8_e5m2))
    with pytest.raises(ValueError, match="gathers source_rows of a 2-D tensor only"):
        transpose_fp8(weights_fp8, torch.tensor([0, 1]))


def test_gathered_rows_are_laid_out_as_columns_with_zeros_for_the_pads():
    x_fp8 = torch.randn(6, 40).to(torch.float8_e4m3fn)
    sources = torch.tensor([5, 0, -1, -1, 2, 2, -1])
    got = transpose_fp8(x_fp8, sources)
    assert got.shape == (40, 7) and got.is_contiguous() and got.dtype == torch.float8_e4m3fn
    bytes_ = got.view(torch.uint8)
    for column, source in enumerate(sources.tolist()):
        expected = x_fp8.view(torch.uint8)[source] if source >= 0 else torch.zeros(40, dtype=torch.uint8)
        assert torch.equal(bytes_[:, column], expected), column
    # No rows to gather from: every column a pad.
    empty = transpose_fp8(x_fp8[:0], torch.tensor([-1, -1]))
    assert empty.shape == (40, 2) and torch.all(empty.view(torch.uint8) == 0)


def test_the_launcher_refuses_what_it_cannot_transpose():
    from fp8graph.kernels.transpose_fp8 import plan_transpose_fp8

    if not triton_available():
        pytest.skip("Triton is not installed")
    with pytest.raises(ValueError, match="2-D tensor of 1-byte elements"):
        plan_transpose_fp8(torch.empty(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D tensor of 1-byte elements"):
        plan_transpose_fp8(torch.empty(2, 2, 4, 4, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="source_rows is a 1-D int64 tensor"):
        plan_transpose_fp8(torch.empty(4, 4, dtype=torch.float8_e4m3fn), torch.zeros(4, dtype=torch.int32))
