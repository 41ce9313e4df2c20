"""``rows[inverse]`` where ``inverse`` is the inverse of a sort's permutation: the same gather forward, and
a gather backward.

A mixture-of-experts layer sorts its tokens by expert, runs the expert GEMMs on the sorted rows, then
restores the tokens' order: ``inverse[permutation] = arange(S); out = rows[inverse]``. Autograd's backward
of that indexing is an ``index_put`` with accumulation into zeros (an index may repeat, in general), which
Inductor writes as a kernel of its own, storing the sorted gradient in BF16 before the expert GEMM's
grad_output cast reads it. A permutation repeats no index, so the backward is the gather
``grad[permutation]``, which Inductor computes inside the cast's own kernels (``passes.unpermute``).
"""

from __future__ import annotations

import torch

from fp8graph.targets.cache_hash import register_target

__all__ = ["unpermute_rows"]


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, permutation, inverse):
        ctx.save_for_backward(permutation)
        return rows[inverse]

    @staticmethod
    def backward(ctx, grad_output):
        (permutation,) = ctx.saved_tensors
        # grad_rows[i] = grad_output[j] for the j with inverse[j] = i, which is permutation[i].
        return grad_output[permutation], None, None


def fp8graph_unpermute_rows(rows: torch.Tensor, permutation: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows[inverse]``, with ``inverse`` the inverse of ``permutation`` (see the module's doc)."""
    return _Unpermute.apply(rows, permutation, inverse)


unpermute_rows = register_target(fp8graph_unpermute_rows)
