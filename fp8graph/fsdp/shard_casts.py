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
- delayed scaling: from the weight's amax history, as the graph computes it (whether or not the call moves
  the state). The whole weight's amax, which the graph records into the history, is the same reduced amax.

The tiled recipes (:class:`TiledShardCast`) need no collective of their own: each scale covers elements of
one rank's shard, and the scales are gathered beside the bytes.

- Block scaling: a shard of whole 128-row tile rows holds whole 128x128 tiles, each cast with its own scale
  exactly as the graph casts the gathered weight. The same tiles serve the backward's transposed weight, so
  one gather serves both GEMMs.
- Row-wise: a scale per row, along K, each row on one rank. grad_input's GEMM reduces over N, where
  row-wise casts the weight per column, over every rank's rows; instead it reads these bytes transposed,
  with the rows' scales folded into grad_output (``fp8graph.targets.linear_tiled``): one layout gathered.
- MXFP8: blocks of 32 along K for the forward, and (grad_input) blocks of 32 along N, local to a shard of
  whole 32-row blocks. Both layouts are cast and gathered (2 bytes an element, and E8M0 scales), since a
  block's scale cannot be folded into a GEMM's other operand.

A gather inside the backward (FSDP2 reshards after the forward and gathers again for the backward) sends
the bytes the forward's gather sent: the forward's graph may read saved views of them, and by then the
delayed history has moved. Under delayed scaling each forward with gradients casts with the scale its history
then gives, so two such forwards before one backward sent different casts, and a gather inside that backward
cannot tell whose backward it serves: it is refused, naming the weight (:meth:`ShardCast._for_backward`).
Inside ``fp8graph.weights_unchanged`` every recipe also sends them again at the next calls, the micro-batches of gradient accumulation: each weight's shard is cast once per declaration,
unless it changed in a way fp8graph sees (its version counter moved, or a ``torch.optim.Optimizer`` stepped:
a fused one writes the shard without moving the counter; ``fp8graph.buffers.kept_casts``). Outside one each
call casts its shards again. Delayed scaling's resent cast keeps the scale it was cast with and records no
amax for the weight, as a kept weight copy does (``fp8graph.buffers.weight_cache``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from fp8graph.buffers.delayed_state import GRAD_HISTORY_PREFIX, HISTORY_PREFIX, SCALE_PREFIX, FORWARD_ROLES
from fp8graph.buffers.kept_casts import CastStamp, ReuseScope
from fp8graph.fsdp.gathered_weight import GatheredFP8Weight, gathered_form
from fp8graph.numerics.delayed_scaling import amax_from_history
from fp8graph.numerics.formats import Role
from fp8graph.numerics.quantize import amax, amax_to_scale, quantize
from fp8graph.numerics.tiles import e8m0_bytes, reference_quantize_tiles
from fp8graph.recipes.scaling import Recipe, TiledRecipe

__all__ = ["GatherCalls", "TiledShardCast", "ShardCast", "WeightAmaxes", "fp8_gathered_bytes", "shard_row_multiple"]

_WEIGHT_ROW = FORWARD_ROLES.index(Role.WEIGHT)


def shard_row_multiple(recipe: Recipe) -> int:
    """Rows each rank's shard must hold a multiple of, for its casts to be the whole weight's: block scaling's
    square tiles; MXFP8's blocks along N (grad_input's copy is blocked along N); one for per-row and
    per-tensor scales."""
    form = gathered_form(recipe)
    if form == "tiles":
        return recipe.tiling(Role.WEIGHT).rows
    if form == "mx":
        return recipe.tiling(Role.WEIGHT).cols
    return 1


def fp8_gathered_bytes(rows: int, columns: int, recipe: Recipe) -> int:
    """Bytes of a (rows, columns) weight all-gathered in FP8 under ``recipe``: its FP8 bytes and the scales
    gathered with them (what :meth:`TiledShardCast._cast` sends; a per-tensor scale is not gathered)."""
    elements = rows * columns
    form = gathered_form(recipe)
    if form == "tiles":
        tile = recipe.tiling(Role.WEIGHT)
        return elements + 4 * (rows // tile.rows) * (columns // tile.cols)
    if form == "rows":
        return elements + 4 * rows
    if form == "mx":  # both layouts, an E8M0 byte a block in each
        return 2 * (elements + elements // recipe.tiling(Role.WEIGHT).cols)
    return elements


class GatherCalls:
    """The calls of one compiled model, counted (``AllGatherPlan.before_call``), and its :class:`ReuseScope`:
    what a shard's kept cast is checked against before it is sent again."""

    def __init__(self, scope: ReuseScope) -> None:
        self.scope = scope
        self.count = 0

    def begin(self) -> None:
        self.count += 1


@dataclasses.dataclass
class _Cast:
    call: int  # the call of the compiled model it was cast in
    stamp: CastStamp  # what it was cast under: the declaration, optimizer steps, the shard's version
    sent: tuple[torch.Tensor, ...]  # what the rank all-gathers: its shard's FP8 bytes (uint8), tiled scales
    scale: torch.Tensor | None = None  # per-tensor: the weight's (every rank has it; not gathered)
    amax: torch.Tensor | None = None  # per-tensor: the whole weight's


def _resent(last: _Cast | None, local: torch.Tensor, calls: GatherCalls) -> _Cast | None:
    """``last`` where a gather sends it again instead of casting the shard (see the module's doc): within the call
    that cast it (the backward's gather), or inside the declaration it was made in while it still serves."""
    if last is None or last.stamp.weights != (local._version,):
        return None
    if last.call == calls.count or last.stamp.still_serves(calls.scope, (local._version,)):
        return last
    return None


def _stamp(local: torch.Tensor, calls: GatherCalls) -> CastStamp:
    return CastStamp.now(calls.scope, (local._version,))


class ShardCast:
    """FSDP2's all-gather extension for one weight; see the module's doc.

    ``local`` is the sharded parameter's local tensor (padded rows included in its storage); ``module`` and
    ``name`` own the weight, ``path`` names it in errors; ``param_dtype`` is what FSDP2 would gather (its
    mixed-precision ``param_dtype``, else the weight's dtype): the graph casts the weight from that dtype.
    """

    def __init__(self, path: str, module: torch.nn.Module, name: str, recipe: Recipe, local: torch.Tensor,
                 param_dtype: torch.dtype, amaxes: "WeightAmaxes", calls: GatherCalls) -> None:
        self.path, self.module, self.name, self.recipe = path, module, name, recipe
        self.local, self.param_dtype, self.amaxes, self.calls = local, param_dtype, amaxes, calls
        self.fp8_dtype = recipe.fp8_dtype(Role.WEIGHT)
        self._last: _Cast | None = None
        # Delayed scaling: of the casts the forwards since the last backward sent with gradients enabled, the first
        # and the latest (two casts at most, however many forwards run without a backward); on the scales' device,
        # whether any of them has a scale other than the first's (compared without waiting for the device); and the
        # version of the weight's grad_output history then (each backward of a call writes it).
        self._awaiting_backward: list[_Cast] = []
        self._scales_differ: torch.Tensor | None = None
        self._grad_history_version = -1

    def weight_hp(self) -> torch.Tensor:
        """The shard as the graph would see it gathered: in ``param_dtype``."""
        return self.local.detach().to(self.param_dtype)

    def _scale(self, amax_fp32: torch.Tensor) -> torch.Tensor:
        recipe = self.recipe
        if not recipe.stateful:
            return amax_to_scale(amax_fp32, self.fp8_dtype, recipe.power_2_scales)
        history = getattr(self.module, HISTORY_PREFIX + self.name)[_WEIGHT_ROW]
        stored = getattr(self.module, SCALE_PREFIX + self.name)[_WEIGHT_ROW]
        # The scale the history gives, as the graph takes it in every call (fp8graph.targets.linear_tensorwise).
        return amax_to_scale(amax_from_history(history, recipe.amax_compute_algo), self.fp8_dtype,
                             margin=recipe.margin, fallback=stored)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        in_backward = torch._C._current_graph_task_id() != -1  # inside the autograd engine
        resent = self._for_backward() if in_backward and self.recipe.stateful else None
        if resent is None:
            resent = _resent(self._last, self.local, self.calls)
        if resent is None:
            amax_fp32 = self.amaxes.amax_of(self)
            scale = self._scale(amax_fp32)
            shard_fp8 = quantize(self.weight_hp(), scale, self.fp8_dtype)
            resent = self._last = _Cast(self.calls.count, _stamp(self.local, self.calls),
                                        (shard_fp8.view(torch.uint8),), scale, amax_fp32)
        if not in_backward and self.recipe.stateful and torch.is_grad_enabled():
            self._awaits_backward(resent)
        # A cast of an earlier call records no amax (delayed scaling: as a reused weight copy does).
        amax_fp32 = resent.amax if resent.call == self.calls.count else torch.zeros_like(resent.amax)
        return resent.sent, (resent.scale, amax_fp32)

    def _grad_history(self) -> torch.Tensor:
        return getattr(self.module, GRAD_HISTORY_PREFIX + self.name)

    def _awaits_backward(self, cast: _Cast) -> None:
        """Note that a forward with gradients sent ``cast``: its backward's gather must send it again. A backward
        since the last such forward (it wrote the grad_output history) ran the backwards that waited; a cast of
        other weights (the version moved) leaves the earlier ones nothing to resend."""
        version = self._grad_history()._version
        awaiting = self._awaiting_backward
        if version != self._grad_history_version or (awaiting and awaiting[0].stamp.weights != cast.stamp.weights):
            awaiting, self._scales_differ, self._grad_history_version = [], None, version
        if any(cast is waiting for waiting in awaiting):
            return
        if awaiting:
            differs = torch.ne(cast.scale, awaiting[0].scale).any()
            self._scales_differ = differs if self._scales_differ is None else self._scales_differ | differs
        self._awaiting_backward = awaiting[:1] + [cast]

    def _for_backward(self) -> _Cast | None:
        """The cast the forwards awaiting a backward sent, which the backward's gather sends again: each call's
        backward reads the bytes and the scale of its own forward. Two forwards that sent casts with different
        scales (delayed scaling's history moved between them) leave a gather that cannot tell which backward it
        serves: refused. None where no forward's cast still holds the weight as it is."""
        awaiting = self._awaiting_backward
        if not awaiting or awaiting[-1].stamp.weights != (self.local._version,):
            return None
        if self._scales_differ is not None and bool(self._scales_differ):  # reads the device only after two forwards
            raise RuntimeError(
                f"fp8graph: {self.path}: two forwards with gradients ran before a backward, and FSDP2 all-gathers "
                f"the weight again for the backward; with delayed scaling each forward cast it with another scale, "
                f"so the gather cannot send each backward its own forward's FP8 bytes. Run each call's backward "
                f"before the next forward, or compile with fp8_all_gather=False")
        return awaiting[-1]

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered_bytes,) = outputs
        scale, amax_fp32 = metadata
        if out is not None:  # FSDP2 gathered into the storage the parameter already views
            out.scale, out.amax = scale, amax_fp32
            return None
        weight = GatheredFP8Weight(gathered_bytes.view(self.fp8_dtype), scale, param_dtype, form="tensor",
                                   amax=amax_fp32)
        return weight, (gathered_bytes,)


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """MXFP8's fp32 power-of-2 scales as their E8M0 bytes (uint8: gloo has no E8M0 dtype)."""
    return e8m0_bytes(scale).view(torch.uint8)


class TiledShardCast:
    """FSDP2's all-gather extension for a weight with a tiled recipe (block, row-wise, MXFP8); see the module's doc.

    ``local`` is the shard, whole rows of its recipe's tiles (``fp8graph.fsdp.install`` refuses any other
    split); it is cast as the FP8 linear casts the whole weight (``fp8graph.targets.linear_tiled``), and FSDP2
    gathers each tensor :meth:`_cast` returns along its first dimension, ranks one after another.
    """

    def __init__(self, path: str, recipe: TiledRecipe, local: torch.Tensor, param_dtype: torch.dtype,
                 calls: GatherCalls) -> None:
        self.path, self.recipe, self.local, self.param_dtype, self.calls = path, recipe, local, param_dtype, calls
        self.form = gathered_form(recipe)
        self.tiling = recipe.tiling(Role.WEIGHT)
        self.fp8_dtype = recipe.fp8_dtype(Role.WEIGHT)
        self._last: _Cast | None = None

    def _cast(self, shard_hp: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors the shard (N_s, K) sends, FP8 bytes as uint8:

        tiles  bytes (N_s, K), tile scales (N_s / 128, K / 128) fp32
        rows   bytes (N_s, K), row scales (N_s,) fp32
        mx     bytes (N_s, K) and E8M0 scales (N_s, K / 32) in blocks along K; bytes (N_s, K) and E8M0 scales
               (N_s / 32, K) in blocks along N, each element where the weight has it
        """
        shard_fp8, scale = reference_quantize_tiles(shard_hp, self.tiling, self.fp8_dtype)
        if self.form == "tiles":
            return shard_fp8.view(torch.uint8), scale
        if self.form == "rows":
            return shard_fp8.view(torch.uint8), scale.reshape(-1)
        shard_t_fp8, scale_t = reference_quantize_tiles(shard_hp.t(), self.tiling, self.fp8_dtype)  # (K, N_s)
        return (shard_fp8.view(torch.uint8), _e8m0(scale),
                shard_t_fp8.t().contiguous().view(torch.uint8), _e8m0(scale_t).t().contiguous())

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if _resent(self._last, self.local, self.calls) is None:
            self._last = _Cast(self.calls.count, _stamp(self.local, self.calls),
                               self._cast(self.local.detach().to(self.param_dtype)))
        return self._last.sent, ()

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:  # FSDP2 gathered into the storages the parameter's tensors already view
            return None
        gathered_bytes, scale, *second_layout = outputs
        layouts = {}
        if second_layout:
            gathered_t_bytes, scale_t = second_layout
            layouts = dict(fp8_t_data=gathered_t_bytes.view(self.fp8_dtype), scale_t=scale_t)
        weight = GatheredFP8Weight(gathered_bytes.view(self.fp8_dtype), scale, param_dtype, form=self.form, **layouts)
        return weight, tuple(outputs)


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

