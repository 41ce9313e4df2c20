"""The FP8 linear's three GEMMs against an fp32 reference (no compiler involved).

    output      = input @ weight^T + bias
    grad_input  = grad_output @ weight
    grad_weight = grad_output^T @ input
"""

import pytest
import torch

from fp8graph import Float8CurrentScaling, Format
from fp8graph.numerics.formats import Role
from fp8graph.targets.linear_tensorwise import linear_fp8_target
from fp8graph.gemm.scaled_gemm import Lowering
from helpers import sqnr_db
from fp8graph.numerics.quantize import dequantize, quantize_current

HYBRID = Float8CurrentScaling()


def _run(linear, input_hp, weight_hp, bias_hp, grad_output):
    input_hp = input_hp.detach().requires_grad_()
    weight_hp = weight_hp.detach().requires_grad_()
    bias_hp = None if bias_hp is None else bias_hp.detach().requires_grad_()
    output = linear(input_hp, weight_hp, bias_hp)
    output.backward(grad_output)
    return output.detach(), input_hp.grad, weight_hp.grad, None if bias_hp is None else bias_hp.grad


def _gaussian_case(M=512, K=512, N=256):
    return torch.randn(M, K), torch.randn(N, K), torch.randn(N), torch.randn(M, N)


def test_hybrid_gaussian_sqnr_against_fp32():
    # Measured: output 28.5 dB, grad_input and grad_weight 24.6 dB.
    case = _gaussian_case()
    reference = _run(torch.nn.functional.linear, *case)
    fp8 = _run(linear_fp8_target(HYBRID, Lowering.EMULATED), *case)
    assert sqnr_db(reference[0], fp8[0]) >= 27
    assert sqnr_db(reference[1], fp8[1]) >= 23
    assert sqnr_db(reference[2], fp8[2]) >= 23
    # The bias gradient is a sum of the high-precision grad_output: exact up to fp32 order.
    torch.testing.assert_close(fp8[3], reference[3], rtol=1e-5, atol=1e-5)


def test_an_empty_batch_gives_empty_outputs_and_zero_weight_gradients():
    """M = 0 (an empty micro-batch): the input's and grad_output's amax is 0, their scale the fallback 1."""
    output, grad_input, grad_weight, grad_bias = _run(linear_fp8_target(HYBRID, Lowering.EMULATED),
                                                      *_gaussian_case(M=0, K=64, N=32))
    assert output.shape == (0, 32) and grad_input.shape == (0, 64)
    assert torch.equal(grad_weight, torch.zeros(32, 64)) and torch.equal(grad_bias, torch.zeros(32))


def test_e4m3_gradients_beat_e5m2_on_gaussian_data():
    case = _gaussian_case()
    reference = _run(torch.nn.functional.linear, *case)
    hybrid = _run(linear_fp8_target(HYBRID, Lowering.EMULATED), *case)
    e4m3 = _run(linear_fp8_target(Float8CurrentScaling(Format.E4M3), Lowering.EMULATED), *case)
    # One more mantissa bit in grad_output: about 6 dB more on grad_input.
    assert sqnr_db(reference[1], e4m3[1]) > sqnr_db(reference[1], hybrid[1]) + 3


def test_emulation_equals_dequantized_operands_multiplied():
    input_hp, weight_hp, bias_hp, grad_output = _gaussian_case(64, 128, 32)
    input_fp8, input_scale = quantize_current(input_hp, HYBRID.fp8_dtype(Role.INPUT))
    weight_fp8, weight_scale = quantize_current(weight_hp, HYBRID.fp8_dtype(Role.WEIGHT))
    grad_fp8, grad_scale = quantize_current(grad_output, HYBRID.fp8_dtype(Role.GRAD_OUTPUT))
    input_dq, weight_dq = dequantize(input_fp8, input_scale), dequantize(weight_fp8, weight_scale)
    grad_dq = dequantize(grad_fp8, grad_scale)

    output, grad_input, grad_weight, _ = _run(
        linear_fp8_target(HYBRID, Lowering.EMULATED), input_hp, weight_hp, bias_hp, grad_output)
    torch.testing.assert_close(output, input_dq @ weight_dq.t() + bias_hp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_input, grad_dq @ weight_dq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_weight, grad_dq.t() @ input_dq, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_non_contiguous_inputs():
    linear = linear_fp8_target(HYBRID, Lowering.EMULATED)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    input_btk = torch.randn(3, 5, 32)
    non_contiguous = torch.randn(5, 3, 32).transpose(0, 1)  # (3, 5, 32), strides of (5, 3, 32)
    assert not non_contiguous.is_contiguous()
    grad = torch.randn(3, 5, 48)
    strided = _run(linear, non_contiguous, weight, bias, grad)
    contiguous = _run(linear, non_contiguous.contiguous(), weight, bias, grad)
    for a, b in zip(strided, contiguous):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    out, grad_input, _, _ = _run(linear, input_btk, weight, None, grad)
    assert out.shape == (3, 5, 48) and grad_input.shape == (3, 5, 32)


def test_bfloat16_operands_keep_their_dtype():
    input_hp, weight_hp, bias_hp, grad_output = (t.bfloat16() for t in _gaussian_case(64, 64, 32))
    out, grad_input, grad_weight, grad_bias = _run(
        linear_fp8_target(HYBRID, Lowering.EMULATED), input_hp, weight_hp, bias_hp, grad_output)
    assert out.dtype == grad_input.dtype == grad_weight.dtype == grad_bias.dtype == torch.bfloat16


def test_autocast_output_dtype_like_f_linear_and_fp32_master_grads():
    input_hp, weight_hp, bias_hp, _ = _gaussian_case(64, 64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.functional.linear(input_hp, weight_hp, bias_hp)
        out, grad_input, grad_weight, _ = _run(
            linear_fp8_target(HYBRID, Lowering.EMULATED), input_hp, weight_hp, bias_hp,
            torch.randn(64, 32, dtype=torch.bfloat16))
    assert out.dtype == expected.dtype == torch.bfloat16
    assert grad_input.dtype == grad_weight.dtype == torch.float32
    assert sqnr_db(expected.float(), out.float()) >= 25


def test_frozen_weight_gets_no_gradient():
    input_hp, weight_hp, _, grad_output = _gaussian_case(32, 32, 32)
    input_hp.requires_grad_()
    out = linear_fp8_target(HYBRID, Lowering.EMULATED)(input_hp, weight_hp)
    out.backward(grad_output)
    assert input_hp.grad is not None and weight_hp.grad is None
