"""Amax agreement across data-parallel ranks.

Delayed scaling with ``reduce_amax`` max-reduces every amax it records over
the default process group, inside the graph, so every rank holds the same
histories and scales without broadcasting buffers. The reduction is a
functional collective (``torch.distributed._functional_collectives``),
which Dynamo and AOTAutograd trace like any op: under Inductor it is
scheduled with the rest of the graph, and identical reductions (q, k and v
projections share one input) are deduplicated.

No other recipe adds a collective:
- under FSDP2 the weight is all-gathered in high precision before the
  graph multiplies it, so every rank computes the same weight scale;
- inputs and gradients are local to a rank, as their scales are in single
  process training with a smaller batch.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["amax_reduction"]


def _initialized_world() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _max_across_ranks(amax_fp32: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(amax_fp32, "max", dist.group.WORLD)


def amax_reduction(requested: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The in-graph max-reduction of an amax, or ``None`` when not requested or not distributed.

    Decided when the graph is traced: a process group created after
    compiling takes effect at the next recompile.
    """
    return _max_across_ranks if requested and _initialized_world() else None
