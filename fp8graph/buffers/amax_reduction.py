"""Amax agreement across data-parallel ranks.

Delayed scaling with ``reduce_amax`` max-reduces every amax it records over
the data-parallel group, inside the graph, so every rank holds the same
histories and scales without broadcasting buffers. The reduction is a
functional collective (``torch.distributed._functional_collectives``),
which Dynamo and AOTAutograd trace like any op: under Inductor it is
scheduled with the rest of the graph, and identical reductions (q, k and v
projections share one input) are deduplicated.

The group is the one the model's data-parallel wrapper reduces its
gradients over, found when the graph is traced (:func:`data_parallel_groups`):
a reduction over every rank would make ranks that run other graphs
(pipeline stages, a tensor-parallel mesh's other dimension) wait on a
collective they never call.

No other recipe adds a collective:
- under FSDP2 the weight is all-gathered in high precision before the
  graph multiplies it, so every rank computes the same weight scale;
- inputs and gradients are local to a rank, as their scales are in single
  process training with a smaller batch.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch

__all__ = ["amax_reduction", "call_amax_reduction", "data_parallel_groups", "sharded_over"]

# The mesh ``fully_shard`` shards the model being traced over, if it is sharded (the backend sets it).
_fsdp_mesh: contextvars.ContextVar = contextvars.ContextVar("fp8graph_fsdp_mesh", default=None)


@contextlib.contextmanager
def sharded_over(mesh):
    """Trace graphs of a model FSDP2 shards over ``mesh`` (``None``: not sharded) inside this: their amax
    reductions use its groups."""
    token = _fsdp_mesh.set(mesh)
    try:
        yield
    finally:
        _fsdp_mesh.reset(token)


def data_parallel_groups() -> list:
    """The process groups whose max is the data-parallel max, in order: the group of the
    ``DistributedDataParallel`` whose forward runs now (Dynamo traces inside it); else each dimension of the
    mesh ``fully_shard`` shards the traced model over (replicate, then shard under HSDP); else every rank."""
    import torch.distributed as dist

    active_ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_get_active_ddp_module", lambda: None)()
    if active_ddp is not None:
        return [active_ddp.process_group]
    mesh = _fsdp_mesh.get()
    if mesh is not None:
        return [mesh.get_group(dim) for dim in range(mesh.ndim)]
    return [dist.group.WORLD]


def _initialized_world() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _max_across(groups: list) -> Callable[[torch.Tensor], torch.Tensor]:
    from torch.distributed import _functional_collectives as funcol

    def max_across_ranks(amax_fp32: torch.Tensor) -> torch.Tensor:
        for group in groups:
            amax_fp32 = funcol.all_reduce(amax_fp32, "max", group)
        return amax_fp32

    return max_across_ranks


def amax_reduction(requested: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The in-graph max-reduction of an amax over the data-parallel group, or ``None`` when not requested, not
    distributed, or the group is this rank alone.

    Decided when the graph is traced: a process group created after
    compiling takes effect at the next recompile.
    """
    if not (requested and _initialized_world()):
        return None
    import torch.distributed as dist

    groups = [group for group in data_parallel_groups() if dist.get_world_size(group) > 1]
    return _max_across(groups) if groups else None


def call_amax_reduction(spec):
    """The reduction of one FP8 call's delayed-scaling amaxes (None for a recipe without state), resolved by the
    call's forward, which runs inside the data-parallel wrapper's forward (and, traced or run by fp8graph's
    ``eager`` compiler, inside :func:`sharded_over` the FSDP2 mesh). The call's backward reuses it: run eagerly,
    a backward runs outside that forward, where the wrapper's group is no longer known. ``spec``: the call's
    ``CallSpec`` or ``GroupedSpec``."""
    return amax_reduction(spec.recipe.reduce_amax) if spec.delayed else None
