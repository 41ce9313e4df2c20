"""Bytes a training step keeps alive for its backward, measured on any device.

    saved = sum of the distinct storages autograd saves during the forward, parameters excluded

Peak GPU memory (``torch.cuda.max_memory_allocated``) is the figure users
feel, and only CUDA has it. What the forward saves for the backward is its
largest part that a recipe changes (FP8 copies in place of BF16 activations,
scales, what the partitioner recomputes), and it can be counted on CPU too:
every compiled graph hands its saved tensors to autograd, where
``saved_tensors_hooks`` see them.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["saved_for_backward_bytes"]


def saved_for_backward_bytes(forward: Callable[[], torch.Tensor], parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter storages saved while ``forward()`` runs; then runs its backward.

    Storages are counted once however many saved views share them; the
    parameters (kept anyway) and anything sharing their storage are left out.
    """
    parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
    saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    output.backward()
    return sum(saved.values())
