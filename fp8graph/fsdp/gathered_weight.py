"""The unsharded weight FSDP2 builds from an FP8 all-gather: FP8 bytes and their scale, as one tensor.

FSDP2 hands a layer's graph the tensor its ``fsdp_post_all_gather`` returns as the module's parameter
(``fp8graph.fsdp.shard_casts``). This is that tensor: a wrapper subclass whose shape and dtype are the
weight's own (so the module, Dynamo and autograd see the parameter they expect, and its gradient is an
ordinary high-precision tensor) and whose contents are

    fp8_data   (N, K) float8, the gathered shards, a view of FSDP2's all-gather output
    scale      what multiplied the weight into FP8, by its ``form``:
               "tensor"  () fp32, per-tensor scaling's (the same on every rank, not gathered)
               "tiles"   (N / 128, K / 128) fp32, block scaling's 128x128 tiles, gathered with the bytes
               "rows"    (N,) fp32, row-wise's: one a row, gathered with the bytes
               "mx"      (N, K / 32) E8M0 bytes (uint8), MXFP8's blocks of 32 along K
    amax       () fp32, the whole weight's largest finite magnitude (delayed scaling records it); None but
               for the "tensor" form
    fp8_t_data, scale_t
               "mx" only: the same weight quantized in blocks of 32 along N, for grad_input's GEMM, which
               reduces over N: (N, K) float8 (each element where the weight has it) and (N / 32, K) E8M0
               bytes. None otherwise: square tiles serve both GEMMs, and row-wise's grad_input reads the
               forward's bytes with the row scales folded into grad_output (``fp8graph.targets.linear_tiled``)

The FP8 targets read these where they would cast the weight (``fp8graph.targets.linear_tensorwise``,
``fp8graph.targets.linear_tiled``); AOTAutograd flattens them into graph inputs. Nothing else
may compute with it: outside fake tensors (tracing) any other op raises, since an FP8 weight silently
read as a high-precision one would change what the model computes. The backend checks that every user
of a gathered weight in a graph is an FP8 site that reads it (``fp8graph.fsdp.graph_check``).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map_only

from fp8graph.numerics.tiles import e8m0_to_scale
from fp8graph.recipes.scaling import Granularity, Recipe

__all__ = ["FORMS", "GatheredFP8Weight", "gathered_form", "is_gathered"]

_FORM_OF = {Granularity.TENSOR: "tensor", Granularity.BLOCK: "tiles", Granularity.ROW: "rows", Granularity.MX: "mx"}
FORMS = tuple(_FORM_OF.values())


def gathered_form(recipe: Recipe) -> str:
    """How a weight gathered in FP8 under ``recipe`` is scaled: its ``form``."""
    return _FORM_OF[recipe.granularity]


_INNER = ("fp8_data", "scale", "amax", "fp8_t_data", "scale_t")  # the inner tensors, those present flattened

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
    def __new__(cls, fp8_data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, form: str,
                amax: torch.Tensor | None = None, fp8_t_data: torch.Tensor | None = None,
                scale_t: torch.Tensor | None = None, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, fp8_data.size(), strides=fp8_data.stride(), dtype=dtype,
                                                   device=fp8_data.device, requires_grad=requires_grad)

    def __init__(self, fp8_data, scale, dtype, *, form, amax=None, fp8_t_data=None, scale_t=None,
                 requires_grad: bool = False):
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, not {form!r}")
        second_layout = (fp8_t_data is not None, scale_t is not None)
        if (amax is not None) != (form == "tensor") or second_layout != ((form == "mx"),) * 2:
            raise ValueError(f"a {form!r} gathered weight: amax is per tensor only, fp8_t_data and scale_t mx only, "
                             "both")
        self.fp8_data, self.scale, self.form = fp8_data, scale, form
        self.amax, self.fp8_t_data, self.scale_t = amax, fp8_t_data, scale_t

    def __repr__(self) -> str:
        return (f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, form={self.form}, "
                f"fp8={self.fp8_data.dtype}, scale={tuple(self.scale.shape)})")

    def _inner(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _INNER if getattr(self, name) is not None}

    def __tensor_flatten__(self):
        return list(self._inner()), (self.dtype, self.form)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        dtype, form = context
        return GatheredFP8Weight(inner["fp8_data"], inner["scale"], dtype, form=form, amax=inner.get("amax"),
                                 fp8_t_data=inner.get("fp8_t_data"), scale_t=inner.get("scale_t"))

    def replaced(self, fp8_data: torch.Tensor) -> "GatheredFP8Weight":
        """The same weight over other FP8 bytes (a view of these, of the same shape: the scales and MXFP8's second
        layout stay as they are), every other inner tensor kept."""
        if fp8_data.shape != self.shape:
            raise RuntimeError(f"a view of shape {tuple(fp8_data.shape)} of a weight all-gathered in FP8 "
                               f"{tuple(self.shape)}: its scales would no longer match its bytes")
        inner = self._inner()
        inner["fp8_data"] = fp8_data
        return GatheredFP8Weight.__tensor_unflatten__(inner, (self.dtype, self.form), None, None)

    def require_form_of(self, recipe: Recipe) -> None:
        """Raise unless this weight was gathered in the form ``recipe``'s sites read: ``fp8graph.fsdp.install``
        decides the gather from the same policy as the sites, so another form is a bug, never a user's input."""
        if self.form != gathered_form(recipe):
            raise AssertionError(f"a weight gathered in the {self.form!r} form read by a {recipe.name} site: "
                                 "fp8graph.fsdp.install decides the gather from the same policy")

    def element_scale(self) -> torch.Tensor:
        """What multiplied each element of ``fp8_data`` into FP8, broadcastable to its (N, K), fp32."""
        scale = self.scale
        if self.form == "rows":
            return scale.reshape(-1, 1)
        if self.form == "mx":  # blocks along K
            return e8m0_to_scale(scale).repeat_interleave(self.shape[1] // scale.shape[1], 1)
        if self.form == "tiles":  # one scale per tile: each repeated over its tile's elements
            rows, cols = self.shape[0] // scale.shape[0], self.shape[1] // scale.shape[1]
            return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return scale

    def dequantized(self) -> torch.Tensor:
        """The weight the FP8 bytes stand for, in its dtype."""
        return (self.fp8_data.to(torch.float32) / self.element_scale()).to(self.dtype)

    def _stand_in(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:
            weight, *rest = args
            return weight.replaced(func(weight.fp8_data, *rest, **kwargs))
        if func in _LIKE:
            args, kwargs = tree_map_only(GatheredFP8Weight, GatheredFP8Weight._stand_in, (args, kwargs))
            return func(*args, **kwargs)
        weights = [a for a in args if isinstance(a, GatheredFP8Weight)]
        if weights and all(is_fake(w.fp8_data) for w in weights):
            # Tracing (Dynamo's example values, AOTAutograd): shapes and dtypes only; the backend refuses a graph
            # in which this computation survives (fp8graph.fsdp.graph_check).
            args, kwargs = tree_map_only(GatheredFP8Weight, GatheredFP8Weight.dequantized, (args, kwargs))
            return func(*args, **kwargs)
        shapes = ", ".join(str(tuple(w.shape)) for w in weights)
        raise RuntimeError(
            f"{func}: a weight of shape {shapes} was all-gathered in FP8 by fp8graph (FSDP2) and is read only by "
            "the FP8 sites inside the compiled graphs of the model fp8graph.compile returned, but code outside them "
            "read it: the model called uncompiled, or a module whose forward Dynamo ran eagerly (the compiled "
            "model's first call warns of each function it ran so). Or compile with fp8_all_gather=False.")


def is_gathered(tensor) -> bool:
    return isinstance(tensor, GatheredFP8Weight)
