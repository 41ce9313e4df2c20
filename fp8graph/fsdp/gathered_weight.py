"""The unsharded weight FSDP2 builds from an FP8 all-gather: FP8 bytes and their scale, as one tensor.

FSDP2 hands a layer's graph the tensor its ``fsdp_post_all_gather`` returns as the module's parameter
(``fp8graph.fsdp.shard_casts``). This is that tensor: a wrapper subclass whose shape and dtype are the
weight's own (so the module, Dynamo and autograd see the parameter they expect, and its gradient is an
ordinary high-precision tensor) and whose contents are

    fp8_data   (N, K) float8, the gathered shards, a view of FSDP2's all-gather output
    scale      what multiplied the weight into FP8: () fp32 for per-tensor scaling (the same on every rank);
               (N / 128, K / 128) for block scaling's tiles, gathered with the bytes
    amax       () fp32, the whole weight's largest finite magnitude (delayed scaling records it); None for
               block scaling

The FP8 targets read ``fp8_data`` and ``scale`` where they would cast the weight
(``fp8graph.targets.linear_tensorwise``, ``fp8graph.targets.linear_tiled``); AOTAutograd flattens them into
graph inputs. Nothing else
may compute with it: outside fake tensors (tracing) any other op raises, since an FP8 weight silently
read as a high-precision one would change what the model computes. The backend checks that every user
of a gathered weight in a graph is an FP8 site that reads it (``fp8graph.fsdp.graph_check``).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map_only

__all__ = ["GatheredFP8Weight", "is_gathered"]

aten = torch.ops.aten

# FSDP2 makes the parameter with as_strided, nn.Parameter detaches it, tracing aliases it: each is the
# same view of the FP8 bytes.
_VIEWS = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default}
# Ops that read only the weight's shape, dtype and device (FSDP2 makes a zero gradient for a weight the step
# did not use): run on an empty stand-in.
_LIKE = {aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default,
         aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default}


class GatheredFP8Weight(torch.Tensor):
    """A weight all-gathered in FP8 (see the module's doc); ``dtype`` is the parameter's."""

    @staticmethod
    def __new__(cls, fp8_data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, dtype: torch.dtype,
                requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, fp8_data.size(), strides=fp8_data.stride(), dtype=dtype,
                                                   device=fp8_data.device, requires_grad=requires_grad)

    def __init__(self, fp8_data, scale, amax, dtype, requires_grad: bool = False):
        self.fp8_data, self.scale, self.amax = fp8_data, scale, amax

    def __repr__(self) -> str:
        return (f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, fp8={self.fp8_data.dtype}, "
                f"scale={self.scale})")

    def __tensor_flatten__(self):
        return ["fp8_data", "scale"] + ([] if self.amax is None else ["amax"]), self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return GatheredFP8Weight(inner["fp8_data"], inner["scale"], inner.get("amax"), dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight the FP8 bytes stand for, in its dtype."""
        scale = self.scale
        if scale.dim() == 2:  # one scale per tile: each repeated over its tile's elements
            rows, cols = self.shape[0] // scale.shape[0], self.shape[1] // scale.shape[1]
            scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return (self.fp8_data.to(torch.float32) / scale).to(self.dtype)

    def _stand_in(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:
            weight, *rest = args
            return GatheredFP8Weight(func(weight.fp8_data, *rest, **kwargs), weight.scale, weight.amax, weight.dtype)
        if func in _LIKE:
            args, kwargs = tree_map_only(GatheredFP8Weight, GatheredFP8Weight._stand_in, (args, kwargs))
            return func(*args, **kwargs)
        weights = [a for a in args if isinstance(a, GatheredFP8Weight)]
        if weights and all(is_fake(w.fp8_data) for w in weights):
            # Tracing (Dynamo's example values, AOTAutograd): shapes and dtypes only; the backend refuses a graph
            # in which this computation survives (fp8graph.fsdp.graph_check).
            args, kwargs = tree_map_only(GatheredFP8Weight, GatheredFP8Weight.dequantized, (args, kwargs))
            return func(*args, **kwargs)
        raise RuntimeError(
            f"{func}: this weight was all-gathered in FP8 by fp8graph (FSDP2) and is read only by the FP8 sites of "
            "the model fp8graph.compile returned. Call that model, or compile with fp8_all_gather=False.")


def is_gathered(tensor) -> bool:
    return isinstance(tensor, GatheredFP8Weight)
