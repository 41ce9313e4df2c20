"""How well an FP8 cast kept a tensor: the five numbers fp8graph.stats records per tensor.

    amax       largest magnitude of the high-precision tensor
    scale      the scale the cast used (x_fp8 = cast(x_hp * scale)); with one scale per
               row or tile, the smallest (the tile holding the amax)
    underflow  fraction of the non-zero values that became zero
    overflow   fraction of the finite values the cast saturated: beyond max + half the top
               step (464 for E4M3, 61440 for E5M2); values closer to max round to it anyway
    sqnr_db    10 log10(sum x^2 / sum (x - dequantize(x_fp8))^2); inf when exact

Plain torch ops, so they run inside the compiled graph next to the cast.
"""

from __future__ import annotations

import dataclasses

import torch

from .formats import saturation_threshold

__all__ = ["HEALTH_METRICS", "StatsRow", "quantization_health"]

HEALTH_METRICS = ("amax", "scale", "underflow", "overflow", "sqnr_db")


@dataclasses.dataclass(frozen=True)
class StatsRow:
    """The health of one tensor role of one site at one step as ``fp8graph.stats`` records it."""

    step: int
    path: str
    role: str
    amax: float
    scale: float
    underflow: float
    overflow: float
    sqnr_db: float


def quantization_health(
    x_hp: torch.Tensor, x_fp8: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """The :data:`HEALTH_METRICS` of one cast, as a float32 tensor of 5 values.

    ``scale`` is 0-dim (per-tensor) or the per-element scale of a tiled cast.
    """
    x = x_hp.detach().to(torch.float32)
    x_q = x_fp8.to(torch.float32)
    scale = scale.detach().to(torch.float32)
    nonzero = x != 0
    underflow = (nonzero & (x_q == 0)).sum() / nonzero.sum().clamp(min=1)
    x_scaled = x * scale
    saturated = torch.isfinite(x_scaled) & (x_scaled.abs() > saturation_threshold(fp8_dtype))
    overflow = saturated.sum() / max(x.numel(), 1)
    noise_power = (x - x_q / scale).pow(2).sum()
    signal_power = x.pow(2).sum()
    sqnr_db = torch.where(noise_power > 0, 10 * torch.log10(signal_power / noise_power),
                          torch.full_like(noise_power, float("inf")))
    return torch.stack([x.abs().amax(), scale.amin(), underflow.float(), overflow.float(), sqnr_db])
