"""Lowering choice and the operand preparation of the cuBLAS path, checked on CPU."""

import pytest
import torch

from fp8graph.lowering import Lowering, choose_lowering, pad_reduction_dim, scaled_gemm
from fp8graph.quantize import quantize_current


def test_auto_lowering_emulates_on_cpu():
    assert choose_lowering(torch.device("cpu")) is Lowering.EMULATED
    assert choose_lowering(torch.device("cpu"), "emulated") is Lowering.EMULATED


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
