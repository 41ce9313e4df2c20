"""Delayed scaling inside ``torch.utils.checkpoint`` regions.

Under torch.compile a checkpoint region's forward ops are tagged for
recomputation, and the partitioner replays them in the backward graph from
the region's inputs. The delayed-scaling buffers are such inputs, and the
compiled forward writes their new values back into them before the backward
runs: a replayed cast would read the *updated* history and scale and quantize
with a scale the first forward never used.

So inside a region the forward casts read the state through
``fp8graph::state_snapshot``, a copy that the region's checkpoint policy
marks ``MUST_SAVE``: the backward reuses the copy taken before the update,
and the replayed cast is bit for bit the first one. The update,
``fp8graph::record_delayed_``, is marked ``MUST_SAVE`` too, so the backward
never replays it: replaying the forward records nothing. Everything else in
the region keeps the default
``PREFER_RECOMPUTE``.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fp8graph.kernels.delayed_record import record_delayed_

__all__ = ["CONTEXT_FN_KEY", "checkpoint_context_fn", "state_snapshot"]

# Where Dynamo keeps a region's context_fn (torch/_higher_order_ops/wrap.py reads it there).
CONTEXT_FN_KEY = "_checkpoint_context_fn"


@torch.library.custom_op("fp8graph::state_snapshot", mutates_args=())
def state_snapshot(state: torch.Tensor) -> torch.Tensor:
    """A copy of a delayed-scaling buffer, as it is before this step's update."""
    return state.clone()


@state_snapshot.register_fake
def _(state: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(state)


def _save_state_snapshots(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op is torch.ops.fp8graph.state_snapshot.default or op is record_delayed_._opoverload:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# The region policy fp8graph gives checkpoint bodies that hold delayed-scaling sites.
checkpoint_context_fn = functools.partial(create_selective_checkpoint_contexts, _save_state_snapshots)
