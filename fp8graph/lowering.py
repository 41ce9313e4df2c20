"""How a scaled FP8 GEMM is executed: cuBLAS ``_scaled_mm`` or exact emulation.

``torch._scaled_mm`` runs FP8 tensor-core GEMMs on CUDA devices of compute
capability 8.9 and later (Ada, Hopper, Blackwell). Everywhere else the GEMM is
emulated: both FP8 operands are widened to fp32 and multiplied. A product of
two FP8 values is exact in fp32, so the emulation equals the FP8 GEMM up to
the order of the fp32 accumulation. (``_scaled_mm`` exists on CPU too, but is
about 1000x slower than an fp32 matmul: 3.6 s against 1.3 ms at 512x256x512.)

The choice is made once per compile, from the device of the graph's inputs,
and recorded in the report; tests can force it.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["LOWERING_CHOICES", "Lowering", "choose_lowering", "pad_reduction_dim", "scaled_gemm"]

_MIN_FP8_CAPABILITY = (8, 9)


class Lowering(str, enum.Enum):
    SCALED_MM = "scaled_mm"
    EMULATED = "emulated"


LOWERING_CHOICES = ("auto", Lowering.SCALED_MM.value, Lowering.EMULATED.value)


def device_supports_scaled_mm(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= _MIN_FP8_CAPABILITY
    )


def choose_lowering(device: torch.device, requested: str = "auto") -> Lowering:
    """Pick the GEMM lowering for a compile on ``device``.

    ``requested`` is ``"auto"`` (scaled_mm where the device has FP8 GEMMs,
    else emulation), ``"scaled_mm"`` or ``"emulated"``. Asking for scaled_mm
    on a device without FP8 GEMMs raises rather than silently emulating.
    """
    if requested == "auto":
        return Lowering.SCALED_MM if device_supports_scaled_mm(device) else Lowering.EMULATED
    if requested not in LOWERING_CHOICES:
        raise ValueError(f"lowering must be one of {LOWERING_CHOICES}, got {requested!r}")
    lowering = Lowering(requested)
    if lowering is Lowering.SCALED_MM and not device_supports_scaled_mm(device):
        raise ValueError(
            f"lowering='scaled_mm' needs a CUDA device of compute capability >= 8.9; "
            f"the graph runs on {device}"
        )
    return lowering


_CUBLAS_FP8_DIM_MULTIPLE = 16


def pad_reduction_dim(a_fp8: torch.Tensor, b_fp8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the shared K of ``a`` (M, K) and ``b`` (K, N) to a multiple of 16.

    cuBLAS FP8 GEMMs need K and N to be multiples of 16. Site eligibility
    checks the layer's K and N, but the weight-gradient GEMM reduces over the
    token dimension M, which is free. Zeros add nothing to the products, so
    the padded GEMM is exact. The pad goes through a uint8 view (zero bits are
    +0.0 in both FP8 formats) because padding is not defined for FP8 dtypes.
    A symbolic K (dynamic shapes) is always padded, by a possibly zero amount,
    rather than guarded on.
    """
    k = a_fp8.shape[1]
    if isinstance(k, int) and k % _CUBLAS_FP8_DIM_MULTIPLE == 0:
        return a_fp8, b_fp8
    pad = (-k) % _CUBLAS_FP8_DIM_MULTIPLE
    a_padded = torch.nn.functional.pad(a_fp8.view(torch.uint8), (0, pad)).view(a_fp8.dtype)
    b_padded = torch.nn.functional.pad(b_fp8.view(torch.uint8), (0, 0, 0, pad)).view(b_fp8.dtype)
    return a_padded, b_padded


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.t().is_contiguous() else t.t().contiguous().t()


def scaled_gemm(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    lowering: Lowering,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a_fp8 / a_scale) @ (b_fp8 / b_scale)`` for a (M, K) and b (K, N).

    Scales are the quantization scales (``x_fp8 = x_hp * scale``); the
    dequantization factors ``1 / scale`` are applied to the fp32 result.
    """
    inverse_scale_a = a_scale.reciprocal()
    inverse_scale_b = b_scale.reciprocal()
    if lowering is Lowering.SCALED_MM:
        a_fp8, b_fp8 = pad_reduction_dim(a_fp8, b_fp8)
        # cuBLAS FP8 GEMMs take A row-major and B column-major (the "TN" layout).
        return torch._scaled_mm(
            _row_major(a_fp8),
            _column_major(b_fp8),
            scale_a=inverse_scale_a,
            scale_b=inverse_scale_b,
            out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
        )
    product_fp32 = torch.mm(a_fp8.to(torch.float32), b_fp8.to(torch.float32))
    return (product_fp32 * (inverse_scale_a * inverse_scale_b)).to(out_dtype)
