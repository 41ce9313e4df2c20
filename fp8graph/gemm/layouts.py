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
    t_t = t.transpose(-2, -1)
    return t if t_t.is_contiguous() else t_t.contiguous().transpose(-2, -1)
