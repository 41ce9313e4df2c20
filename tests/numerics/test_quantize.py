"""Quantization numerics: scales, casts and their edge cases, against hand-computed values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import sqnr_db
from fp8graph.numerics.quantize import amax, amax_to_scale, dequantize, quantize, quantize_current

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLT_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("fp8_dtype,fp8_max", [(E4M3, 448.0), (E5M2, 57344.0)])
@pytest.mark.parametrize("amax_value", [1.0, 3.5, 1e-3, 1e6])
def test_scale_maps_amax_to_fp8_max(fp8_dtype, fp8_max, amax_value):
    scale = amax_to_scale(torch.tensor(amax_value), fp8_dtype)
    assert scale.dtype == torch.float32
    assert scale.item() == pytest.approx(fp8_max / amax_value, rel=1e-6)


@pytest.mark.parametrize("bad_amax", [0.0, float("inf"), float("nan")])
def test_scale_is_one_for_zero_inf_nan_amax(bad_amax):
    assert amax_to_scale(torch.tensor(bad_amax), E4M3).item() == 1.0


def test_scale_of_tiny_amax_is_clamped_to_float32_max():
    scale = amax_to_scale(torch.tensor(1e-40), E4M3)  # 448 / 1e-40 overflows fp32
    assert scale.item() == FLT_MAX


@pytest.mark.parametrize("margin", [1, 2, 16])
@pytest.mark.parametrize("amax_value", [2.0 ** -100, 1e-3, 1.0, 3.5, 1e6, 2.0 ** 100])
def test_a_margin_divides_the_scale_by_its_power_of_two_exactly(margin, amax_value):
    """In fp32's normal range 448 / (amax * 2**m) and (448 / amax) * 2**-m are the same number: a power of two
    scales without rounding."""
    amax_fp32 = torch.tensor(amax_value)
    expected = 448.0 / (amax_fp32 * 2.0 ** margin)
    assert amax_to_scale(amax_fp32, E4M3, margin=margin).item() == expected.item()


@pytest.mark.parametrize("margin,amax_value", [(1, 2e38), (2, 1e38), (16, 1e34)])
def test_a_margin_never_gives_a_large_finite_amax_a_zero_scale(margin, amax_value):
    """amax * 2**margin overflows fp32 there: 448 / inf would be a scale of 0, a cast of zeros, and NaN once
    dequantized. The scale stays positive, and the cast dequantizes to finite values within half an FP8 step
    (a subnormal one, 2**-9, under a large margin)."""
    amax_fp32 = torch.tensor(amax_value)
    scale = amax_to_scale(amax_fp32, E4M3, margin=margin)
    assert 0 < scale.item() <= 448 / amax_value
    x = torch.tensor([amax_value, -amax_value / 3, 0.0])
    error = (dequantize(quantize(x, scale, E4M3), scale).double() - x.double()).abs()
    half_step = torch.maximum(x.double().abs() * 2.0 ** -4, torch.tensor(2.0 ** -10 / scale.double()))
    assert (error <= half_step).all()


def test_the_amax_of_no_values_is_zero_so_an_empty_batch_casts_with_the_fallback_scale():
    x = torch.empty(0, 64)
    assert amax(x).item() == 0.0 and amax(x).dtype == torch.float32
    x_fp8, scale = quantize_current(x, E4M3)
    assert x_fp8.shape == (0, 64) and scale.item() == 1.0


@pytest.mark.parametrize("amax_value,expected", [
    (1.0, 256.0),      # 448 -> 256
    (448.0, 1.0),      # exactly 1
    (3.0, 128.0),      # 149.33 -> 128
    (0.875, 512.0),    # 512 exactly stays 512
    (1e6, 2.0 ** -12),  # 4.48e-4 -> 2^-12 = 2.44e-4
])
def test_power_2_scales_drop_the_mantissa(amax_value, expected):
    scale = amax_to_scale(torch.tensor(amax_value), E4M3, power_2_scales=True)
    assert scale.item() == expected


def test_cast_rounds_to_nearest_even():
    # E4M3 has 3 mantissa bits: between 1 and 2 the step is 0.125.
    x = torch.tensor([1.0625, 1.1875, 1.0624, -1.0625, 1.3125])
    q = quantize(x, torch.tensor(1.0), E4M3).float()
    assert q.tolist() == [1.0, 1.25, 1.0, -1.0, 1.25]


@pytest.mark.parametrize("fp8_dtype,fp8_max", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_finite_values_beyond_range_saturate(fp8_dtype, fp8_max):
    x = torch.tensor([1e9, -1e9, fp8_max * 1.01])
    assert quantize(x, torch.tensor(1.0), fp8_dtype).float().tolist() == [fp8_max, -fp8_max, fp8_max]


@pytest.mark.parametrize("fp8_dtype,fp8_max", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_a_finite_value_whose_product_with_the_scale_overflows_saturates(fp8_dtype, fp8_max):
    # A delayed scale from a history of tiny amaxes is fp32's largest: 2.0 times it overflows to inf.
    x = torch.tensor([2.0, -3.0, 0.0, 1e-45])
    scale = torch.tensor(FLT_MAX)
    assert torch.isinf(x[0] * scale)
    cast = quantize(x, scale, fp8_dtype).float()
    assert cast[:2].tolist() == [fp8_max, -fp8_max]
    assert not torch.isnan(cast).any()


def test_non_finite_values_stay_non_finite():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 2.0])
    e4m3 = quantize(x, torch.tensor(1.0), E4M3).float()
    assert torch.isnan(e4m3[:3]).all() and e4m3[3] == 2.0  # E4M3 has no inf
    e5m2 = quantize(x, torch.tensor(1.0), E5M2).float()
    assert e5m2[0] == float("inf") and e5m2[1] == -float("inf") and torch.isnan(e5m2[2])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_amax_is_over_the_finite_values_so_one_bad_value_keeps_the_others_scale(bad):
    assert amax(torch.tensor([1.0, bad, -3.0])).item() == 3.0
    assert amax(torch.tensor([bad, bad])).item() == 0.0  # nothing to fit: scale 1
    x = torch.randn(8, 64) * 1e-3
    x_bad = x.clone()
    x_bad[0, 0] = bad
    x[0, 0] = 0.0
    (x_fp8, scale), (x_bad_fp8, bad_scale) = quantize_current(x, E4M3), quantize_current(x_bad, E4M3)
    assert bad_scale == scale
    assert torch.equal(x_bad_fp8[1:].view(torch.uint8), x_fp8[1:].view(torch.uint8))
    assert math.isnan(x_bad_fp8[0, 0].float().item())  # the bad value itself stays non-finite


def test_current_scaling_uses_the_full_range():
    x = torch.randn(1000) * 7
    x_fp8, scale = quantize_current(x, E4M3)
    assert x_fp8.float().abs().max().item() == 448.0
    assert scale.item() == pytest.approx(448.0 / x.abs().max().item(), rel=1e-6)


@pytest.mark.parametrize("fp8_dtype,floor_db", [(E4M3, 30.5), (E5M2, 24.5)])
def test_gaussian_cast_sqnr(fp8_dtype, floor_db):
    # Measured: E4M3 31.5 dB, E5M2 25.6 dB on N(0, 1).
    x = torch.randn(1 << 16)
    x_fp8, scale = quantize_current(x, fp8_dtype)
    assert sqnr_db(x, dequantize(x_fp8, scale)) >= floor_db


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), min_size=1, max_size=64),
    st.booleans(),
)
def test_round_trip_error_is_within_half_an_fp8_step(values, power_2_scales):
    x = torch.tensor(values, dtype=torch.float32)
    x_fp8, scale = quantize_current(x, E4M3, power_2_scales)
    x_back = dequantize(x_fp8, scale)
    # Normal E4M3 values carry 3 mantissa bits: relative error <= 2^-4. Values
    # that land in the subnormal range (below 2^-6 after scaling) have an
    # absolute error <= half the subnormal step, 2^-10, before unscaling.
    bound = torch.maximum(x.abs() * 2.0 ** -4, torch.full_like(x, 2.0 ** -10) / scale)
    assert ((x_back - x).abs() <= bound * (1 + 1e-6)).all()
