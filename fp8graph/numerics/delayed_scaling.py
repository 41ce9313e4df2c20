"""Delayed-scaling state updates as small pure functions of tensors.

One role's state is ``history`` (amax_history_len,), newest amax in slot 0,
and ``scale`` (0-dim). At each training-mode cast (see ``DelayedScaling``)::

    scale   = fp8_max / (algo(history) * 2**margin)    if that amax is finite and > 0
    history = roll(history, -1), then history[0] = 0  (the newest moves to the end)
    x_fp8   = cast(x * scale);  history[0] = amax(x)

Every function takes the history's rows stacked (``(..., amax_history_len)``)
as well, so that the roles a forward updates together (input and weight) are
one small computation rather than one per role. The functions return new
tensors. The FP8 linear computes the scales with them inside the graph; the
state itself moves in place, one call at a time, through
``fp8graph::record_delayed_`` (``fp8graph.kernels.delayed_record``), whose
reference is :func:`roll_history` and :func:`record_amax`.
"""

from __future__ import annotations

import torch

from fp8graph.numerics.quantize import amax, amax_to_scale, quantize

__all__ = ["amax_from_history", "delayed_cast", "record_amax", "roll_history", "scale_from_history"]


def amax_from_history(history: torch.Tensor, algo) -> torch.Tensor:
    """The amax the next scale is computed from, per row of ``history`` (..., len): max of the row, its
    newest entry, or ``algo(row)`` (a callable sees one role's history, newest first)."""
    if algo == "max":
        return history.amax(-1)
    if algo == "most_recent":
        return history[..., 0]
    rows = history.reshape(-1, history.shape[-1])
    amaxes = [torch.as_tensor(algo(row), dtype=torch.float32, device=history.device).reshape(()) for row in rows]
    return torch.stack(amaxes).reshape(history.shape[:-1])


def scale_from_history(history, scale, fp8_dtype, margin: int, algo) -> torch.Tensor:
    """The new scale of each row; a row's previous scale stays when its amax is 0, inf or NaN."""
    return amax_to_scale(amax_from_history(history, algo), fp8_dtype, margin=margin, fallback=scale)


def roll_history(history: torch.Tensor) -> torch.Tensor:
    """Drop the oldest amax of each row: the newest moves to the end and slot 0 is cleared for this cast."""
    rolled = torch.roll(history, -1, -1)
    return torch.cat([torch.zeros_like(rolled[..., :1]), rolled[..., 1:]], -1)


def record_amax(rolled_history: torch.Tensor, new_amax: torch.Tensor) -> torch.Tensor:
    """``rolled_history`` with each row's slot 0 set to that row's entry of ``new_amax`` (shape ``...``)."""
    return torch.cat([new_amax.to(rolled_history.dtype).unsqueeze(-1), rolled_history[..., 1:]], -1)


def delayed_cast(x_hp, history, scale, fp8_dtype, margin: int, algo, update: bool, reduce_amax=None):
    """Cast ``x_hp`` with delayed scaling (one role).

    Returns ``(x_fp8, scale_used, new_history)``. With ``update`` the scale is
    first recomputed from the history and the history rolled; without it
    (inference) the stored scale is used and the history returned unchanged.
    ``reduce_amax`` (e.g. a max all-reduce across data-parallel ranks) is
    applied to the new amax before it is recorded.
    """
    if not update:
        return quantize(x_hp, scale, fp8_dtype), scale, history
    new_scale = scale_from_history(history, scale, fp8_dtype, margin, algo)
    x_fp8 = quantize(x_hp, new_scale, fp8_dtype)
    # The amax rides along with the cast: Inductor computes both in one read of x.
    new_amax = amax(x_hp.detach())
    if reduce_amax is not None:
        new_amax = reduce_amax(new_amax)
    return x_fp8, new_scale, record_amax(roll_history(history), new_amax)
