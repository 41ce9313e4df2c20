"""FP8 quantization numerics as small pure functions.

The rewrite and the tests' reference both use these, so what is tested is
what runs. They are written in plain torch ops so that Inductor can fuse the
amax reduction, the scale and the cast into the kernels around them.

Conventions: ``scale`` multiplies a high-precision tensor into FP8 range
(``x_fp8 = cast(x_hp * scale)``); dequantization divides by it.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from fp8graph.numerics.formats import fp8_max

__all__ = ["amax", "amax_to_scale", "current_scale", "dequantize", "finite_magnitude", "largest_amax", "quantize",
           "quantize_current", "row_amaxes", "untracked"]

_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny
_FLOAT32_EXPONENT_MASK = 0x7F800000


def untracked(x_hp: torch.Tensor) -> torch.Tensor:
    """``x_hp`` detached where autograd would track what is computed from it, else itself: an amax needs no
    gradient, and AOTAutograd's partitioner takes a ``detach`` for an op a cast cannot fuse through, so a
    needless one keeps it from casting in the backward what only the backward reads
    (``fp8graph.targets.linear_tiled``)."""
    return x_hp.detach() if x_hp.requires_grad and torch.is_grad_enabled() else x_hp


def finite_magnitude(x_hp: torch.Tensor) -> torch.Tensor:
    """``|x_hp|`` in fp32 with NaN and inf as 0: what every amax is taken over.

    A non-finite value must not change the scaling of the finite ones: an
    amax of inf or NaN would cast every other value of the tensor (or tile)
    at a fallback scale, as if one bad request in a batch spoiled the others.
    The non-finite values themselves still cast to non-finite FP8
    (:func:`quantize`), as fp32 arithmetic would carry them.

    In fp32 because a BF16 amax is two values under Inductor's Triton code: the kernel that reduces it holds it
    in fp32 (a BF16 value an fp32 sum made, never rounded) and stores it rounded, and another kernel reads the
    stored one. Row-wise scaling then cast a column of grad_output with one power-of-2 scale and dequantized it
    with the other where the fp32 amax lay just above 1.75 * 2**m and rounded onto it: a row of grad_weight came
    out doubled (the tiny Llama's gradients 3-4 dB from the emulation on an H100 and an H200, 2026-11-25 and -27;
    reproduced on the CPU through Inductor's Triton code under the interpreter). The max of BF16 values is exact
    in fp32, so eager results are unchanged.
    """
    magnitude = x_hp.to(torch.float32).abs()
    finite = magnitude < float("inf")  # false for NaN and inf
    # The 0 as the mask itself (false is 0), not a constant: Inductor's freezing folds a frozen weight's
    # whole quantization only through computations of tensors, never of constructors (see amax_to_scale).
    return torch.where(finite, magnitude, finite.to(magnitude.dtype))


def amax(x_hp: torch.Tensor) -> torch.Tensor:
    """Largest finite magnitude in ``x_hp`` as a 0-dim fp32 tensor (0 if there is none).

    Written as a per-row partial amax, then a max over the rows: exact either
    way (a max does not round), but on the GPU Inductor splits one large global
    reduction into stages tiled unlike the cast, in kernels of their own, while
    per-row partials share the cast's loop: on the H100 a delayed cast and its
    amax became one pass (the times: ``docs/recipes.md``, from
    ``bench/results/2026-11-23-h100/quantize-structure-probe.txt``). (pytorch
    issue 143464; torchao's ``float8/inductor_utils.py`` makes the same
    rewrite.)
    """
    return largest_amax(row_amaxes(x_hp))


def largest_amax(amaxes: torch.Tensor) -> torch.Tensor:
    """The largest of partial amaxes (a row's, a group's) as a 0-dim fp32 tensor; 0 where there are none (a tensor
    of no rows, e.g. an expert rank that got no tokens: nothing to fit, so the fallback scale)."""
    if guard_or_false(amaxes.numel() == 0):
        return amaxes.new_zeros((), dtype=torch.float32)
    return amaxes.amax().to(torch.float32)


def row_amaxes(x_hp: torch.Tensor) -> torch.Tensor:
    """The first stage of :func:`amax`: each row's largest finite magnitude (1-D, fp32), the magnitudes
    themselves for a 1-D tensor. Their max is the amax."""
    magnitude = finite_magnitude(x_hp)
    if magnitude.dim() >= 2:
        magnitude = magnitude.amax(dim=-1)
    return magnitude.reshape(-1)


def amax_to_scale(
    amax_fp32: torch.Tensor, fp8_dtype: torch.dtype, power_2_scales: bool = False, margin: int = 0,
    fallback: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale that maps ``amax * 2**margin`` onto the FP8 dtype's largest value.

    An amax of 0, inf or NaN gives ``fallback`` (current scaling: 1; delayed
    scaling: the previous scale): there is nothing to fit, or the tensor is
    already broken and its non-finite values must pass through rather than
    shrink every finite value to zero. A tiny amax whose scale would overflow
    fp32 gets ``FLT_MAX``. Elementwise: ``amax_fp32`` may hold several amaxes.
    """
    amax_fp32 = amax_fp32.to(torch.float32)
    usable = torch.isfinite(amax_fp32) & (amax_fp32 > 0)
    if fallback is None:
        # The fallback 1.0 is derived from a tensor, not a constant: Inductor's
        # freezing folds only computations of constants and tensors, never of
        # constructors, and this lets it fold a frozen weight's whole quantization.
        fallback = (~usable).to(torch.float32)
    fitted = fp8_max(fp8_dtype) / amax_fp32
    if margin:
        # The margin applied to the scale, not the amax: amax * 2**margin overflows to inf for a large finite
        # amax, and fp8_max / inf = 0 would cast the tensor to zeros and dequantize it to NaN. A power of two
        # scales exactly, so every other scale is the same; the smallest normal fp32 is the floor.
        fitted = (fitted * 2.0 ** -margin).clamp(min=_FLOAT32_TINY)
    scale = torch.where(usable, fitted.clamp(max=_FLOAT32_MAX), fallback)
    if power_2_scales:
        # Drop the mantissa bits: the largest power of two <= scale. Bit
        # operations are exact where log2/floor/exp2 can round up. Scales are
        # >= 448 / FLT_MAX, far above the subnormal range, so no bit is lost.
        exponent_bits = scale.view(torch.int32) & _FLOAT32_EXPONENT_MASK
        scale = exponent_bits.view(torch.float32)
    return scale


def quantize(x_hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Cast ``x_hp * scale`` to FP8, rounding to nearest even after saturating.

    Finite values beyond the format's range saturate to +-max, those whose
    product with the scale overflows fp32 too (a delayed scale from a history
    of tiny amaxes). Non-finite values stay non-finite, as plain arithmetic
    would keep them: inf stays inf in E5M2 and becomes NaN in E4M3, which has
    no inf (the bare CPU cast would saturate it to 448 instead).
    """
    max_value = fp8_max(fp8_dtype)
    x_fp32 = x_hp.to(torch.float32)
    x_scaled = x_fp32 * scale
    x_saturated = x_scaled.clamp(-max_value, max_value)  # NaN passes through clamp
    # Non-finite by the input, not the product: a finite value times a finite scale that overflows saturates.
    input_inf = torch.isinf(x_fp32)
    if fp8_dtype == torch.float8_e4m3fn:
        # NaN as (inf - inf), not a constant (see amax_to_scale); abs() clears its sign bit.
        x_saturated = torch.where(input_inf, (x_scaled - x_scaled).abs(), x_saturated)
    else:
        x_saturated = torch.where(input_inf, x_scaled, x_saturated)
    return x_saturated.to(fp8_dtype)


def dequantize(
    x_fp8: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``x_fp8 / scale`` in ``out_dtype``."""
    return (x_fp8.to(torch.float32) / scale).to(out_dtype)


def current_scale(x_hp: torch.Tensor, fp8_dtype: torch.dtype, power_2_scales: bool = False) -> torch.Tensor:
    """Current (per-tensor) scaling's scale: from this tensor's own amax."""
    return amax_to_scale(amax(x_hp), fp8_dtype, power_2_scales)


def quantize_current(
    x_hp: torch.Tensor, fp8_dtype: torch.dtype, power_2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Current (per-tensor) scaling: scale from this tensor's own amax, then cast.

    Returns ``(x_fp8, scale)``.
    """
    scale = current_scale(x_hp, fp8_dtype, power_2_scales)
    return quantize(x_hp, scale, fp8_dtype), scale
