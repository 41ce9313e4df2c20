"""Which FP8 copies AOTAutograd's partitioner keeps from the forward for the backward.

The backward's GEMMs read a transposed FP8 copy of each input and weight
(``fp8graph.linear_fp8``). Both layouts cost least written together in the
forward, from one read of the high-precision tensor. Left to itself, the
min-cut partitioner instead moves any op that only the backward uses into the
backward, and recomputes it there from what it saves anyway: each weight's
transposed copy from the parameter (a third read of every weight a step), an
activation's from the high-precision tensor or from its producer's inputs.

Two marks keep a copy in the forward:

- :func:`keep_for_backward` ties the copy to a value the forward needs (the
  dequantization factor its GEMM reads), so the copy is a forward node. The
  op costs nothing under Inductor (its lowering returns the value itself);
  elsewhere it is a scalar's copy.
- :func:`saved_not_recomputed` marks the copy ``MUST_SAVE``
  (``node.meta["recompute"]``, which tracing copies from
  ``torch.fx.traceback.current_meta``), so the partitioner saves it rather than
  recomputing it from its inputs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx.traceback as fx_traceback
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["keep_for_backward", "saved_not_recomputed"]


@torch.library.custom_op("fp8graph::keep_for_backward", mutates_args=())
def _keep_for_backward(value: torch.Tensor, kept: list[torch.Tensor]) -> torch.Tensor:
    """``value``; ``kept`` are tensors the backward reads that the forward must compute."""
    return value.clone()


@_keep_for_backward.register_fake
def _(value, kept):
    return torch.empty_like(value)


def _register_inductor_lowering() -> None:
    from torch._inductor.lowering import register_lowering

    # An identity: no kernel, no copy. The op only exists for the partitioner.
    register_lowering(torch.ops.fp8graph.keep_for_backward.default, type_promotion_kind=None)(
        lambda value, kept: value)


_register_inductor_lowering()


def keep_for_backward(value: torch.Tensor, *kept: torch.Tensor | None) -> torch.Tensor:
    """``value``, made to depend on the tensors ``kept`` that are not ``None`` (see the module's doc)."""
    kept = [tensor for tensor in kept if tensor is not None]
    return torch.ops.fp8graph.keep_for_backward(value, kept) if kept else value


_UNSET = object()


@contextlib.contextmanager
def saved_not_recomputed():
    """Ops traced in this context are saved for the backward, never recomputed there; outside tracing,
    nothing. Enter it around the op that makes the copy alone, so that its inputs stay free to fuse."""
    if not fx_traceback.has_preserved_node_meta():
        yield
        return
    meta = fx_traceback.current_meta
    before = meta.get("recompute", _UNSET)
    meta["recompute"] = CheckpointPolicy.MUST_SAVE
    try:
        yield
    finally:
        if before is _UNSET:
            del meta["recompute"]
        else:
            meta["recompute"] = before
