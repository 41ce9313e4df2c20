"""Each rank casts its shard of a weight to FP8 before FSDP2 all-gathers it.

FSDP2 calls ``fsdp_pre_all_gather`` on a sharded parameter's local tensor, when that tensor defines it, and
gathers what it returns instead of the shard; ``fsdp_post_all_gather`` then builds the unsharded parameter
from the gathered tensors. :class:`ShardCast` is that pair for one weight, set as attributes of the plain
local tensor (``fp8graph.fsdp.install``), so the parameter, the optimizer state and checkpoints stay the
plain high-precision shards they were.

What each rank sends: its shard cast with the scale the whole weight's graph would use, as bytes (gloo
has no float8 dtype; FSDP2 packs mixed dtypes as bytes anyway). The scale:

- current scaling: from the whole weight's amax. Every weight's shard amax is max-reduced in one
  all-reduce, at the first gather of each call of the compiled model (:class:`WeightAmaxes`), so the
  scale, and each FP8 byte, equal what the graph computes from the weight gathered in high precision;
- delayed scaling: from the weight's amax history, as the graph computes it (the stored scale where the
  graph only reads the state: no gradients, or the module in eval mode). The whole weight's amax, which the
  graph records into the history, is the same reduced amax.

Block scaling's 128x128 weight tiles (:class:`BlockShardCast`) need no collective of their own: a shard
of whole tile rows holds whole tiles, each cast with its own scale exactly as the graph casts the gathered
weight, and the tiles' scales are gathered beside the bytes. The same tiles serve the backward's
transposed weight, so one gather serves both GEMMs.

A gather inside the backward (FSDP2 reshards after the forward and gathers again for the backward) sends
the bytes the forward's gather sent: the forward's graph may read saved views of them, and by then the
delayed history has moved. The shard is cast again only when it changed (its version counter).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from fp8graph.buffers.delayed_state import HISTORY_PREFIX, SCALE_PREFIX, FORWARD_ROLES
from fp8graph.fsdp.gathered_weight import GatheredFP8Weight
from fp8graph.numerics.delayed_scaling import amax_from_history
from fp8graph.numerics.formats import Role
from fp8graph.numerics.quantize import amax, amax_to_scale, quantize
from fp8graph.numerics.tiles import reference_quantize_tiles
from fp8graph.recipes.scaling import Float8BlockScaling, Recipe

__all__ = ["BlockShardCast", "ShardCast", "WeightAmaxes", "in_backward"]

_WEIGHT_ROW = FORWARD_ROLES.index(Role.WEIGHT)


def in_backward() -> bool:
    """Whether autograd is running a backward now (FSDP2's pre-backward gathers run inside it)."""
    return torch._C._current_graph_task_id() != -1


@dataclasses.dataclass
class _Cast:
    version: int
    shard_bytes: torch.Tensor  # uint8, the shard's FP8 bytes
    scale: torch.Tensor  # per-tensor: the weight's; block scaling: the shard's tiles'
    amax: torch.Tensor | None  # per-tensor: the whole weight's; block scaling: None


def _resends(last: _Cast | None, local: torch.Tensor) -> bool:
    """Whether a gather sends ``last`` again instead of casting the shard: inside the backward, while the shard
    has not changed since (see the module's doc)."""
    return in_backward() and last is not None and last.version == local._version


class ShardCast:
    """FSDP2's all-gather extension for one weight; see the module's doc.

    ``local`` is the sharded parameter's local tensor (padded rows included in its storage); ``module`` and
    ``name`` own the weight, ``path`` names it in errors; ``param_dtype`` is what FSDP2 would gather (its
    mixed-precision ``param_dtype``, else the weight's dtype): the graph casts the weight from that dtype.
    """

    def __init__(self, path: str, module: torch.nn.Module, name: str, recipe: Recipe, local: torch.Tensor,
                 param_dtype: torch.dtype, amaxes: "WeightAmaxes") -> None:
        self.path, self.module, self.name, self.recipe = path, module, name, recipe
        self.local, self.param_dtype, self.amaxes = local, param_dtype, amaxes
        self.fp8_dtype = recipe.fp8_dtype(Role.WEIGHT)
        self._last: _Cast | None = None

    def weight_hp(self) -> torch.Tensor:
        """The shard as the graph would see it gathered: in ``param_dtype``."""
        return self.local.detach().to(self.param_dtype)

    def _scale(self, amax_fp32: torch.Tensor) -> torch.Tensor:
        recipe = self.recipe
        if not recipe.stateful:
            return amax_to_scale(amax_fp32, self.fp8_dtype, recipe.power_2_scales)
        history = getattr(self.module, HISTORY_PREFIX + self.name)[_WEIGHT_ROW]
        stored = getattr(self.module, SCALE_PREFIX + self.name)[_WEIGHT_ROW]
        # FSDP2 gathers under no_grad: whether the call trains was seen before it (WeightAmaxes.begin_call).
        if not (self.amaxes.grad_enabled and self.module.training):  # the graph only reads the state, as here
            return stored.clone()
        return amax_to_scale(amax_from_history(history, recipe.amax_compute_algo), self.fp8_dtype,
                             margin=recipe.margin, fallback=stored)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if not _resends(self._last, self.local):
            amax_fp32 = self.amaxes.amax_of(self)
            scale = self._scale(amax_fp32)
            shard_fp8 = quantize(self.weight_hp(), scale, self.fp8_dtype)
            self._last = _Cast(self.local._version, shard_fp8.view(torch.uint8), scale, amax_fp32)
        return (self._last.shard_bytes,), (self._last.scale, self._last.amax)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered_bytes,) = outputs
        scale, amax_fp32 = metadata
        if out is not None:  # FSDP2 gathered into the storage the parameter already views
            out.scale, out.amax = scale, amax_fp32
            return None
        weight = GatheredFP8Weight(gathered_bytes.view(self.fp8_dtype), scale, amax_fp32, param_dtype)
        return weight, (gathered_bytes,)


class BlockShardCast:
    """FSDP2's all-gather extension for a weight with block scaling's 128x128 tiles; see the module's doc.

    ``local`` is the shard, whole tile rows (``fp8graph.fsdp.install`` refuses any other split); it is cast
    tile by tile as the FP8 linear casts the whole weight (``fp8graph.targets.linear_tiled``), and FSDP2
    gathers two tensors: the FP8 bytes (N, K) and the tiles' scales (N / 128, K / 128).
    """

    def __init__(self, path: str, recipe: Float8BlockScaling, local: torch.Tensor, param_dtype: torch.dtype) -> None:
        self.path, self.recipe, self.local, self.param_dtype = path, recipe, local, param_dtype
        self.tiling = recipe.tiling(Role.WEIGHT)
        self.fp8_dtype = recipe.fp8_dtype(Role.WEIGHT)
        self._last: _Cast | None = None

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if not _resends(self._last, self.local):
            shard_fp8, tile_scales = reference_quantize_tiles(self.local.detach().to(self.param_dtype), self.tiling,
                                                              self.fp8_dtype)
            self._last = _Cast(self.local._version, shard_fp8.view(torch.uint8), tile_scales, None)
        return (self._last.shard_bytes, self._last.scale), ()

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        gathered_bytes, tile_scales = outputs
        if out is not None:  # FSDP2 gathered into the storages the parameter's bytes and scales already view
            return None
        weight = GatheredFP8Weight(gathered_bytes.view(self.fp8_dtype), tile_scales, None, param_dtype)
        return weight, (gathered_bytes, tile_scales)


class WeightAmaxes:
    """Every FP8-gathered weight's whole amax, max-reduced across its shard group in one all-reduce per call.

    ``begin_call`` runs before each call of the compiled model; the first gather of the call reduces every
    weight's shard amax at once. A weight whose shard changed since (the version counter) is refused: its
    ranks would cast with a stale scale. ``grad_enabled`` is the call's grad mode (FSDP2 gathers under
    ``no_grad``; delayed scaling moves its state only in calls that train).
    """

    def __init__(self) -> None:
        self._groups: dict[object, list[ShardCast]] = {}
        self._amaxes: dict[ShardCast, tuple[int, torch.Tensor]] = {}  # cast -> (version, amax)
        self._stale = True
        self.grad_enabled = True

    def add(self, cast: ShardCast, group) -> None:
        self._groups.setdefault(group, []).append(cast)

    def begin_call(self) -> None:
        self._stale = True
        self.grad_enabled = torch.is_grad_enabled()

    def amax_of(self, cast: ShardCast) -> torch.Tensor:
        if self._stale:
            self._reduce()
        version, amax_fp32 = self._amaxes[cast]
        if version != cast.local._version:
            raise RuntimeError(
                f"{cast.path}: the weight changed after its amax was reduced at the start of this call of the "
                "compiled model; its FP8 all-gather would use a stale scale. Change weights between calls only")
        return amax_fp32

    def _reduce(self) -> None:
        for group, casts in self._groups.items():
            shard_amaxes = torch.stack([amax(cast.weight_hp()) for cast in casts])
            if group is not None:
                dist.all_reduce(shard_amaxes, op=dist.ReduceOp.MAX, group=group)
            for cast, weight_amax in zip(casts, shard_amaxes.unbind()):
                self._amaxes[cast] = (cast.local._version, weight_amax)
        self._stale = False

