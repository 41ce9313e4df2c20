"""The bytes FSDP2 all-gathers, counted at the collective.

:func:`count_all_gathers` gives every FSDP2 unit of a model a custom all-gather (FSDP2's
``set_custom_all_gather``) that runs the default collective and adds up what it gathers: the bytes each
rank receives, its own shard included. ``train-distributed`` reports them; the tests compare FP8 and
high-precision gathers with them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

__all__ = ["AllGatherBytes", "count_all_gathers"]

# torch 2.13 renamed the collective FSDP2 gathers with; 2.11 has the old name only.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class AllGatherBytes(AllGather):
    """FSDP2's all-gather, counting: ``gathered_bytes`` (received, per rank) and ``calls`` since ``reset``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.gathered_bytes, self.calls = 0, 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        self.gathered_bytes += output_tensor.numel() * output_tensor.element_size()
        self.calls += 1
        return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def count_all_gathers(model: torch.nn.Module) -> AllGatherBytes:
    """Count every all-gather of ``model``'s FSDP2 units from now on (one counter for all of them)."""
    from torch.distributed.fsdp import FSDPModule

    counter = AllGatherBytes()
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not units:
        raise ValueError(f"{type(model).__name__} has no FSDP2 unit: fully_shard it first")
    for unit in units:
        unit.set_custom_all_gather(counter)
    return counter
