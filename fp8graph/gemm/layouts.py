"""The operand layouts cuBLAS's FP8 GEMMs take: A row-major, B column-major (the "TN" layout), in the last two
dimensions, so that a batch of matrices (the experts' (E, K, N)) is laid out as each of its matrices."""

from __future__ import annotations

import torch

__all__ = ["column_major", "row_major"]


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous, else a row-major copy."""
    return t if t.is_contiguous() else t.contiguous()


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its second-last dimension is contiguous, else a copy laid out so."""
    t_t = _swap_last_two(t)
    return t if t_t.is_contiguous() else _swap_last_two(t_t.contiguous())


def _swap_last_two(t: torch.Tensor) -> torch.Tensor:
    """``t.transpose(-2, -1)`` as a permute: AOTAutograd's partitioner counts a permute, not a transpose, as a view
    a cast can fuse through, and so may cast in the backward what only the backward reads
    (``fp8graph.targets.linear_tiled``)."""
    return t.permute(*range(t.dim() - 2), t.dim() - 1, t.dim() - 2)
