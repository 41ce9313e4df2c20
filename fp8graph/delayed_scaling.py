"""Delayed-scaling state updates as small pure functions of tensors.

One role's state is ``history`` (amax_history_len,), newest amax in slot 0,
and ``scale`` (0-dim). At each training-mode cast (see ``DelayedScaling``)::

    scale   = fp8_max / (algo(history) * 2**margin)    if that amax is finite and > 0
    history = roll(history, -1), then history[0] = 0  (the newest moves to the end)
    x_fp8   = cast(x * scale);  history[0] = amax(x)

The functions return new tensors; the FP8 linear copies them into the
module's buffers, so the compiled graph updates the state in place.
"""

from __future__ import annotations

import torch

from .formats import fp8_max
from .quantize import amax, quantize

__all__ = ["amax_from_history", "delayed_cast", "roll_history", "scale_from_history"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def amax_from_history(history: torch.Tensor, algo) -> torch.Tensor:
    """The amax the next scale is computed from: max of the history, its newest entry, or ``algo(history)``."""
    if algo == "max":
        return history.amax()
    if algo == "most_recent":
        return history[0]
    return torch.as_tensor(algo(history), dtype=torch.float32, device=history.device).reshape(())


def scale_from_history(history, scale, fp8_dtype, margin: int, algo) -> torch.Tensor:
    """The new scale; the previous one stays when the amax is 0, inf or NaN."""
    amax_value = amax_from_history(history, algo).to(torch.float32)
    usable = torch.isfinite(amax_value) & (amax_value > 0)
    candidate = (fp8_max(fp8_dtype) / (amax_value * (2.0 ** margin))).clamp(max=_FLOAT32_MAX)
    return torch.where(usable, candidate, scale)


def roll_history(history: torch.Tensor) -> torch.Tensor:
    """Drop the oldest amax: the newest moves to the end and slot 0 is cleared for this cast."""
    rolled = torch.roll(history, -1, 0)
    return torch.cat([torch.zeros_like(rolled[:1]), rolled[1:]])


def delayed_cast(x_hp, history, scale, fp8_dtype, margin: int, algo, update: bool, reduce_amax=None):
    """Cast ``x_hp`` with delayed scaling.

    Returns ``(x_fp8, scale_used, new_history)``. With ``update`` the scale is
    first recomputed from the history and the history rolled; without it
    (inference) the stored scale is used and the history returned unchanged.
    ``reduce_amax`` (e.g. a max all-reduce across data-parallel ranks) is
    applied to the new amax before it is recorded.
    """
    if not update:
        return quantize(x_hp, scale, fp8_dtype), scale, history
    new_scale = scale_from_history(history, scale, fp8_dtype, margin, algo)
    new_history = roll_history(history)
    x_fp8 = quantize(x_hp, new_scale, fp8_dtype)
    # The amax rides along with the cast: Inductor computes both in one read of x.
    new_amax = amax(x_hp.detach())
    if reduce_amax is not None:
        new_amax = reduce_amax(new_amax)
    new_history = torch.cat([new_amax.reshape(1), new_history[1:]])
    return x_fp8, new_scale, new_history
