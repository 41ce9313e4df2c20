"""How well an FP8 cast kept a tensor: the five numbers fp8graph.inspection.stats records per tensor.

    amax       largest magnitude of the high-precision tensor
    scale      the scale the cast used (x_fp8 = cast(x_hp * scale)); with one scale per
               row or tile, the smallest (the tile holding the amax)
    underflow  fraction of the non-zero values that became zero
    overflow   fraction of the finite values the cast saturated: beyond max + half the top
               step (464 for E4M3, 61440 for E5M2); values closer to max round to it anyway
    sqnr_db    10 log10(sum x^2 / sum (x - dequantize(x_fp8))^2); inf when exact, NaN when x
               holds a non-finite value (the cast cannot keep what is not a number)

Plain torch ops, so they run inside the compiled graph next to the cast.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from fp8graph.numerics.formats import saturation_threshold
from fp8graph.numerics.quantize import amax, finite_magnitude

__all__ = ["HEALTH_METRICS", "StatsRow", "quantization_health", "sqnr_db"]

HEALTH_METRICS = ("amax", "scale", "underflow", "overflow", "sqnr_db")


@dataclasses.dataclass(frozen=True)
class StatsRow:
    """The health of one tensor role of one site at one step as ``fp8graph.inspection.stats`` records it."""

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
    if guard_or_false(x.numel() == 0):  # an empty batch: nothing was cast, so nothing lost
        none = x.new_zeros(())
        return torch.stack([none, scale if scale.dim() == 0 else none + 1, none, none, none + float("inf")])
    nonzero = x != 0
    underflow = (nonzero & (x_q == 0)).sum() / nonzero.sum().clamp(min=1)
    x_scaled = x * scale
    saturated = torch.isfinite(x_scaled) & (x_scaled.abs() > saturation_threshold(fp8_dtype))
    overflow = saturated.sum() / torch.isfinite(x).sum().clamp(min=1)
    # The SQNR is invariant to one factor over the whole tensor: measured on x / amax, whose powers fit
    # fp32 however large x is (1e30 casts well, and its squares overflow fp32).
    finite_amax = amax(x)
    norm = torch.where(finite_amax > 0, finite_amax, torch.ones_like(finite_amax))
    sqnr = sqnr_db(x / norm, x_q / scale / norm)
    # The scale of the element holding the amax: an all-zero row or tile (a token whose loss is ignored) has the
    # fallback scale 1, below every other, so the smallest scale would say nothing of the cast.
    at_amax = finite_magnitude(x).reshape(-1).argmax().reshape(1)  # a tensor index: no host sync in the graph
    scale_at_amax = scale.expand(x.shape).reshape(-1).gather(0, at_amax).reshape(())
    return torch.stack([x.abs().amax(), scale_at_amax, underflow.float(), overflow.float(), sqnr])


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB, as a 0-dim tensor in
    their dtype: ``10 log10(sum reference^2 / sum (reference - actual)^2)``, ``inf`` when they are equal,
    NaN when either holds NaN or inf (no measure of fidelity; never "exact").
    Plain torch ops: the stats compute it inside the graph, the tests on fp64 copies."""
    noise_power = (reference - actual).pow(2).sum()
    signal_power = reference.pow(2).sum()
    exact = torch.where(noise_power == 0, float("inf"), noise_power - noise_power)  # NaN - NaN: still NaN
    return torch.where(noise_power > 0, 10 * torch.log10(signal_power / noise_power), exact)
