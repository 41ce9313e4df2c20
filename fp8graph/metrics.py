"""Error metrics for comparing FP8 results with high-precision references."""

import torch

__all__ = ["sqnr_db"]


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB.

    ``10 * log10(sum(reference^2) / sum((reference - actual)^2))``, in fp64;
    ``inf`` when the two are equal.
    """
    reference = reference.detach().to(torch.float64)
    noise = reference - actual.detach().to(torch.float64)
    noise_power = noise.pow(2).sum()
    if noise_power == 0:
        return float("inf")
    return float(10 * torch.log10(reference.pow(2).sum() / noise_power))
