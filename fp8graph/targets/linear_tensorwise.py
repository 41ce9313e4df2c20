"""The FP8 linear with per-tensor scales: linears that read one input, as three scaled GEMMs each.

A rewritten site calls ``linear_fp8(input_hp, weight_hp, bias_hp)`` with
``weight_hp`` of shape (N, K), exactly like ``F.linear``; sites that read the
same input with the same recipe (q, k and v; gate and up) are one call of
``linears_fp8(input_hp, [weight_hp, ...], [bias_hp, ...])`` (``fp8graph.passes.group_sites``)::

    forward   output_i      = input_fp8 @ weight_i_fp8_t         (M, N_i)  + bias_i in high precision
    backward  grad_input    = sum_i grad_output_i_fp8 @ weight_i_fp8        (M, K)
              grad_weight_i = grad_output_i_fp8_t @ input_fp8               (N_i, K)
              grad_bias_i   = grad_output_i.sum(0)                          high precision

The input is cast once for all of them, with one scale: with delayed
scaling the one the largest amax of their input histories gives (their
histories hold the same amaxes, so this is each one's own), and the amax is
recorded into each site's history.

The quantization is plain torch ops inside an ``autograd.Function``.
AOTAutograd traces through both ``forward`` and ``backward``, so Inductor sees
the amax, scale and cast as ordinary ops and fuses them with their neighbours;
only the GEMM is an opaque call.

Layouts. cuBLAS's FP8 GEMMs on Hopper read A row-major and B column-major
(the reduction dimension contiguous), so each operand is needed in both
layouts: the input by the forward GEMM and, transposed, by grad_weight's;
grad_output by grad_input's and, transposed, by grad_weight's; the weight by
the forward and, transposed, by grad_input's. Each FP8 tensor is written once
per layout it is read in (``lowering="scaled_mm"``):

- Current scaling: the cast is its own pointwise kernel after the amax
  reduction, and writes both layouts from one read of the high-precision
  tensor (or of its producer's inputs, recomputed).
- Delayed scaling: the row-major cast records its amax in the same pass and
  fuses into the tensor's producer; the transposed copy is
  ``fp8graph::transpose_fp8`` of the FP8 bytes (left to Inductor, it would be
  recomputed inside the amax's reduction kernel: see ``fp8graph.kernels.transpose_fp8``).

What is kept from forward to backward is the recipe's ``save_transposes``:

- ``False`` (default): the backward casts each weight's transposed copy from
  the weight, with the scale the forward used (the same bytes): a step reads
  each weight once more (2 bytes a parameter) and keeps nothing of it. Each
  input's transposed copy is left to AOTAutograd's partitioner under current
  scaling: it saves the copy, or casts it again in the backward from
  high-precision tensors the backward keeps anyway (a norm's input, the MLP's
  gate and up), inside the kernels that read them there. A step then keeps
  what torchao's does (``tests/targets/test_activation_memory.py``). Delayed
  scaling's backward casts each input again row-major, inside the kernels
  that read it there, and transposes the bytes (``fp8graph::transpose_fp8``):
  cast transposed there, Inductor would store the copy from inside those
  kernels' reductions.
- ``True``: both layouts are cast in the forward and the transposed copies
  are saved, so a step reads each weight for its amax (current scaling) and
  once for its casts, never again in the backward, holding 1 byte a weight
  element and an input element from forward to backward, as Transformer Engine
  holds them.

With ``cache_weights`` the row-major copy is kept across calls while the
weight does not change (inside ``fp8graph.weights_unchanged``); under delayed
scaling with the scale it was cast with, the calls reusing it recording no
amax for the weight, as Transformer Engine's cached weights. A call reading
a kept copy (or an FSDP2-gathered cast) transposes its bytes in the forward
and saves that, whatever the recipe says: there is no weight to cast again.

An FP8 tensor read by several GEMMs goes through ``fp8graph.gemm.scaled_gemm.one_buffer``
so that Inductor stores it once, and the transposed copies the forward saves are
written there and kept (``fp8graph.targets.partitioning``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import torch

from fp8graph.targets.cache_hash import register_target
from fp8graph.numerics.delayed_scaling import amax_from_history, scale_from_history
from fp8graph.buffers.amax_reduction import call_amax_reduction
from fp8graph.numerics.formats import ROLES, Role
from fp8graph.numerics.health import quantization_health
from fp8graph.kernels.delayed_record import finished_amax, record_delayed_
from fp8graph.kernels.transpose_fp8 import transpose_fp8
from fp8graph.gemm.scaled_gemm import Lowering, one_buffer, scaled_gemm_by_inverse, scalars_of
from fp8graph.targets.partitioning import keep_for_backward, read_in_backward, saved_not_recomputed
from fp8graph.numerics.quantize import amax, amax_to_scale, quantize, row_amaxes
from fp8graph.recipes.scaling import Recipe
from fp8graph.buffers.snapshots import state_snapshot
from fp8graph.buffers.delayed_state import FORWARD_ROLES
from fp8graph.fsdp.gathered_weight import GatheredFP8Weight, is_gathered

__all__ = ["autocast_dtype", "autocast_off", "linear_fp8_target", "linears_fp8_target", "record_health",
           "record_states", "target_name"]

_INPUT, _WEIGHT = (FORWARD_ROLES.index(role) for role in FORWARD_ROLES)  # rows of the forward state


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast gives matmuls on ``device_type``, or ``None`` outside autocast (and on devices without
    it: a model on the meta device, which ``fp8graph.explain`` traces without memory)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_off(device_type: str):
    """Autocast turned off on ``device_type`` (an FP8 GEMM's operands keep the dtypes it casts them to); nothing
    on a device without autocast (meta)."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


@dataclasses.dataclass(frozen=True)
class Member:
    """What one site of a call brings besides its weight and bias: its module's buffers.

    ``state``: ``(history, scale)`` of shape (2, len) and (2,), the forward's input and weight rows, and
    ``grad_state``: ``(grad_history, grad_scale)`` of shape (1, len) and (1,), the backward's grad_output
    row (delayed scaling; ``fp8graph.buffers.delayed_state`` says why they are apart);
    ``weight_cache``: the weight's kept FP8 copy (:class:`WeightCopy`);
    ``stats``: the module's (3, 5) health buffer.
    """

    state: tuple[torch.Tensor, torch.Tensor] | None = None
    grad_state: tuple[torch.Tensor, torch.Tensor] | None = None
    weight_cache: WeightCopy | None = None
    stats: torch.Tensor | None = None


class WeightCopy(NamedTuple):
    """A weight's FP8 copy kept between calls (``fp8graph.buffers.weight_cache``), as one site reads it: a
    ``"fill"`` call casts the weight and writes them, a ``"reuse"`` call reads them instead."""

    mode: str
    weight_fp8: torch.Tensor  # (N, K), or the parameter's own (K, N) shape (:meth:`as_nk`)
    scale: torch.Tensor  # (): the scale it was cast with

    def as_nk(self, weight_hp: torch.Tensor) -> torch.Tensor:
        """The copy as (N, K): one in the parameter's own (K, N) shape (its module left open which way round it
        multiplies the weight) is read and written through its transpose."""
        return self.weight_fp8 if self.weight_fp8.shape == weight_hp.shape else self.weight_fp8.t()


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """How a call casts: the recipe, the GEMM lowering, and whether delayed state moves."""

    recipe: Recipe
    lowering: Lowering
    update: bool = True  # False in graphs compiled without gradients: the stored scales are read
    snapshot: bool = False  # delayed sites inside a torch.utils.checkpoint region (fp8graph.buffers.snapshots)

    @property
    def delayed(self) -> bool:
        return self.recipe.stateful

    @property
    def native_layouts(self) -> bool:
        """Whether the GEMMs need each operand laid out for cuBLAS (the emulation reads any layout)."""
        return self.lowering is Lowering.SCALED_MM

    def gemm_operand(self, x_fp8: torch.Tensor) -> torch.Tensor:
        """``x_fp8`` as the GEMMs (and the transposed copy) read it: one buffer (``fp8graph.gemm.scaled_gemm.one_buffer``)."""
        return one_buffer(x_fp8) if self.native_layouts else x_fp8

    @property
    def saves_transposes(self) -> bool:
        """Whether the forward writes the transposed copies the backward's GEMMs read and saves them (the recipe's
        ``save_transposes``). Else the backward casts each weight's from the weight, and AOTAutograd's partitioner
        chooses for each input's between saving it and casting it again from what the backward saves anyway."""
        return self.native_layouts and self.recipe.save_transposes

    def kept(self, inverse_scale: torch.Tensor, x_t_fp8: torch.Tensor | None) -> torch.Tensor:
        """``inverse_scale`` as the forward GEMM reads it; where the transposed copies are saved (and delayed
        scaling's always, see the module's doc), tied to the copy the backward reads, so that the copy is written
        in the forward (``fp8graph.targets.partitioning``)."""
        tied = self.saves_transposes or (self.native_layouts and self.delayed)  # the emulation's copy is a view
        return keep_for_backward(inverse_scale, x_t_fp8) if tied else inverse_scale

    def recasts_weight(self, source: torch.Tensor | None) -> bool:
        """Whether the backward casts the weight's transposed copy from ``source`` (the weight), rather than the
        forward writing it and saving it: where the copies are not saved and the weight is at hand (not a kept
        or gathered cast)."""
        return self.native_layouts and not self.saves_transposes and source is not None

    def recasts_input(self) -> bool:
        """Whether delayed scaling's backward casts each input's copy again (the row-major cast, then
        ``fp8graph::transpose_fp8`` of its bytes), rather than the forward writing it and saving it: where the
        copies are not saved. Current scaling leaves the choice to the partitioner (:meth:`transposed`)."""
        return self.native_layouts and self.delayed and not self.saves_transposes

    def cast_again_transposed(self, x_hp: torch.Tensor, scale: torch.Tensor, role: Role,
                              grad: torch.Tensor) -> torch.Tensor:
        """In the backward that computes ``grad``: the (C, R) copy of an (R, C) operand's delayed cast, the bytes
        the forward wrote. The row-major cast is made again, with ``scale`` read when the backward runs
        (``read_in_backward``), so that the partitioner keeps it there, inside the kernels that read ``x_hp`` or
        what it is made from (a norm's backward, SwiGLU's), stored row by row, and its bytes are transposed apart
        (cast transposed there, Inductor would store the copy from inside those kernels' reductions)."""
        x_fp8 = quantize(x_hp, read_in_backward(scale, grad), self.recipe.fp8_dtype(role))
        return transpose_fp8(one_buffer(x_fp8))

    def transposed(self, x_fp8: torch.Tensor, x_hp: torch.Tensor | None, scale: torch.Tensor, role: Role):
        """The (C, R) FP8 copy of an (R, C) operand, written for the GEMM that reads it transposed.

        Current scaling casts it from ``x_hp`` in the pointwise kernel of the row-major cast (one read for
        both layouts); without ``x_hp`` (a kept or gathered weight), and under delayed scaling, it transposes
        the FP8 bytes (``fp8graph::transpose_fp8``: left to Inductor, a delayed cast's transposed store would
        sit inside the kernel that reduces the amax). Unless the recipe saves its transposes, a copy cast from
        ``x_hp`` is left to the partitioner, which may cast it again in the backward. The emulation reads any
        layout: a view.
        """
        if not self.native_layouts:
            return x_fp8.t()
        if x_hp is None or self.delayed:
            return transpose_fp8(x_fp8)
        if not self.saves_transposes:  # one buffer, whichever graph the partitioner casts it in: q, k and v read it
            return one_buffer(self.cast_transposed(x_hp, scale, role))
        with saved_not_recomputed():  # the copy alone: its inputs stay free to fuse
            return self.cast_transposed(x_hp, scale, role)

    def cast_transposed(self, x_hp: torch.Tensor, scale: torch.Tensor, role: Role) -> torch.Tensor:
        """The (C, R) FP8 cast of an (R, C) tensor, contiguous: a pointwise kernel that reads ``x_hp`` transposed."""
        return quantize(x_hp.t(), scale, self.recipe.fp8_dtype(role)).contiguous()


def _states(spec: CallSpec, members: Sequence[Member], forward: bool,
            after: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The members' forward (``forward``) or grad_output histories (m, rows, len) and scales (m, rows),
    stacked, as the casts read them. A backward passes its gradient as ``after``: the buffers are read
    when it runs, after the backwards of later calls recorded (``fp8graph.targets.partitioning``).

    Inside a checkpoint region the forward reads snapshots (the backward's replay must see the state
    the first forward saw); backward casts read the live buffers (an earlier backward of the same step
    may have recorded into them). One stacked read, so that a call's state is a few small kernels,
    not a few per member (reducing each history where it lies and stacking the amaxes instead made
    more kernels in the modelled decoder step).
    """
    histories, scales = zip(*(member.state if forward else member.grad_state for member in members))
    if after is not None:
        histories, scales = ([read_in_backward(buffer, after) for buffer in buffers] for buffers in (histories, scales))
    if spec.snapshot and forward:
        histories, scales = [state_snapshot(h) for h in histories], [state_snapshot(s) for s in scales]
    return torch.stack(histories), torch.stack(scales)


def record_states(states: Sequence[tuple[torch.Tensor, torch.Tensor]], row_amaxes_by_member: list[list[torch.Tensor]],
                  new_scales: torch.Tensor, reduce, kept_scales: Sequence[torch.Tensor] = ()) -> None:
    """Move every row of every member's ``(history, scale)`` one step, in place: each row's history records
    the amax of its ``row_amaxes_by_member[i][row]`` (per-row partial magnitudes, finished by the op) and
    its scale becomes ``new_scales[i, row]`` (the one the cast used). One ``fp8graph::record_delayed_``
    launch for the whole call. With ``reduce`` (an amax all-reduce across ranks) the amaxes are finished
    here and reduced in one collective first. ``kept_scales``: none, or per member the scale buffer of the
    weight's FP8 copy a filling call keeps, which the op also writes with the weight rows' scales (every row
    but the input's)."""
    partials = [partial for member_partials in row_amaxes_by_member for partial in member_partials]
    if reduce is not None:
        finished = reduce(torch.stack([finished_amax(partial) for partial in partials]))
        partials = list(finished.reshape(-1, 1).unbind())
    record_delayed_([history for history, _ in states], [scale for _, scale in states], partials, new_scales,
                    list(kept_scales))


def _cast_current(spec: CallSpec, x_hp: torch.Tensor, role: Role) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale, 1 / scale)``; the reciprocal fuses into the kernel that computes the scale."""
    fp8_dtype = spec.recipe.fp8_dtype(role)
    scale = amax_to_scale(amax(x_hp), fp8_dtype, spec.recipe.power_2_scales)
    return quantize(x_hp, scale, fp8_dtype), scale, scale.reciprocal()


def _cast_forward_delayed(spec: CallSpec, input_hp: torch.Tensor, weights_hp: Sequence[torch.Tensor],
                          members: Sequence[Member], reduce):
    """The forward casts of delayed-scaling members: the shared input, then each weight.

    All members' input and weight rows move one step together: new scales from the histories,
    histories rolled, this call's amaxes recorded in slot 0, written into the buffers in place.
    Returns ``(input_fp8, input_scale, input_inverse_scale, [(weight_fp8, weight_scale, weight_inverse_scale,
    weight_hp), ...])``. The inverse scales are views of one tensor: their reciprocals are one kernel.
    ``reduce``: the amaxes' reduction across data-parallel ranks, or None (``call_amax_reduction``).
    """
    recipe = spec.recipe
    fp8_dtype = recipe.fp8_dtype(Role.INPUT)
    if recipe.fp8_dtype(Role.WEIGHT) != fp8_dtype:
        raise AssertionError("every Format casts input and weight to one FP8 dtype")
    history, scale = _states(spec, members, forward=True)  # (m, 2, len), (m, 2): input and weight rows
    # The scales the histories give, in a call that moves the state as in one that only reads it (inference: as
    # Transformer Engine's scales, updated after the last training call). Read from the buffers that a training
    # forward then updates: the backward must reuse them, never recompute them from the updated buffers (the
    # partitioner would: fp8graph.targets.partitioning).
    with saved_not_recomputed():
        history_amax = amax_from_history(history, recipe.amax_compute_algo)  # (m, 2)
        # One input, one scale: from the largest amax the members' input histories give.
        history_amax = torch.stack([history_amax[:, _INPUT].amax().expand(len(members)),
                                    history_amax[:, _WEIGHT]], 1)
        new_scales = amax_to_scale(history_amax, fp8_dtype, margin=recipe.margin, fallback=scale)  # (m, 2)
        inverse_scales = new_scales.reciprocal()
    cast_before = [_cast_before(w, member) for w, member in zip(weights_hp, members)]
    if any(cast is not None for cast in cast_before):
        # FSDP2 gathered the weight cast with the scale its history gave (fp8graph.fsdp.shard_casts), or an earlier
        # call kept its cast (fp8graph.buffers.weight_cache): that cast's scale is used and recorded.
        with saved_not_recomputed():
            weight_scales = torch.stack([scale if cast is None else cast[1]
                                         for cast, scale in zip(cast_before, new_scales[:, _WEIGHT])])
            new_scales = torch.stack([new_scales[:, _INPUT], weight_scales], 1)
            inverse_scales = new_scales.reciprocal()
    input_scale, weight_scales = new_scales[0, _INPUT], new_scales[:, _WEIGHT]
    input_fp8 = quantize(input_hp, input_scale, fp8_dtype)
    inverse_scales = scalars_of(inverse_scales)  # (m, 2) row-major: member i's input, then its weight
    weights, weight_amaxes = [], []
    for i, (w, member, cast, weight_scale) in enumerate(zip(weights_hp, members, cast_before, weight_scales)):
        weight_inverse_scale = inverse_scales[2 * i + _WEIGHT]
        if cast is not None:  # cast before, its amax taken then
            weight_fp8, _, weight_amax = cast
            weights.append((weight_fp8, weight_scale, weight_inverse_scale, None))
        else:  # the per-row partial amaxes ride along with the cast: one read; the op finishes them
            weight_fp8, weight_amax = quantize(w, weight_scale, fp8_dtype), row_amaxes(w.detach())
            weights.append((weight_fp8, weight_scale, weight_inverse_scale, w))
            if member.weight_cache is not None:  # "fill": kept for the calls that reuse it
                member.weight_cache.as_nk(w).copy_(weight_fp8)
                if not spec.update:  # else the record keeps the scale
                    member.weight_cache.scale.copy_(weight_scale)
        weight_amaxes.append(weight_amax)
    if spec.update:
        # The input's amax is recorded by every member.
        input_row_amaxes = row_amaxes(input_hp.detach())
        filling = [m.weight_cache for m in members if m.weight_cache is not None and m.weight_cache.mode == "fill"]
        record_states([member.state for member in members],
                      [[input_row_amaxes, weight_amax] for weight_amax in weight_amaxes],
                      new_scales.contiguous(), reduce, [copy.scale for copy in filling])
    return input_fp8, input_scale, inverse_scales[_INPUT], weights


def _cast_before(weight_hp: torch.Tensor, member: Member):
    """``(weight_fp8, weight_scale, weight_amax)`` of a delayed-scaling weight cast before this call, else None:
    gathered cast by FSDP2 (its whole amax came with it; zero where the gather resent an earlier call's cast),
    or read from the copy a filling call kept. A reused cast records an amax of zero: nothing, as Transformer
    Engine's cached weight records nothing (the history rolls, the weight's slot stays empty)."""
    if is_gathered(weight_hp):
        return weight_hp.fp8_data, weight_hp.scale, weight_hp.amax.reshape(1)
    copy = member.weight_cache
    if copy is None or copy.mode != "reuse":
        return None
    return copy.as_nk(weight_hp), copy.scale, copy.scale.new_empty(0)  # no partial amax: zero recorded


def _cast_weight_current(spec: CallSpec, weight_hp: torch.Tensor, member: Member):
    """A member's weight with current scaling, through its FP8 copy when it has one (``fp8graph.buffers.weight_cache``).

    Returns ``(weight_fp8, weight_scale, weight_inverse_scale, source)``: ``source`` is what the transposed
    copy is cast from, the weight, or ``None`` for a reused copy (transposed from its bytes, the weight is
    not read).
    """
    if is_gathered(weight_hp):  # FSDP2 gathered it cast (fp8graph.fsdp.shard_casts)
        return _gathered_cast(weight_hp)
    if member.weight_cache is None:
        return (*_cast_current(spec, weight_hp, Role.WEIGHT), weight_hp)
    copy = member.weight_cache
    if copy.mode == "reuse":
        weight_scale = copy.scale.clone()
        return copy.as_nk(weight_hp), weight_scale, weight_scale.reciprocal(), None
    weight_fp8, weight_scale, weight_inverse_scale = _cast_current(spec, weight_hp, Role.WEIGHT)
    copy.as_nk(weight_hp).copy_(weight_fp8)
    copy.scale.copy_(weight_scale)
    return weight_fp8, weight_scale, weight_inverse_scale, weight_hp


def _gathered_cast(weight: GatheredFP8Weight):
    """``(weight_fp8, weight_scale, weight_inverse_scale, None)`` of a weight FSDP2 gathered in FP8: its bytes are
    the cast, and the transposed copy is made from them (no high-precision weight to cast it from)."""
    return weight.fp8_data, weight.scale, weight.scale.reciprocal(), None


def _cast_grad_outputs(spec: CallSpec, grad_outputs_hp: Sequence[torch.Tensor], members: Sequence[Member], reduce):
    """Each member's grad_output cast, ``[(grad_output_fp8, grad_output_scale, grad_output_inverse_scale), ...]``;
    with delayed scaling all members' grad_output rows move one step together (as
    :func:`_cast_forward_delayed`'s rows), their amaxes reduced by ``reduce`` (the forward's)."""
    recipe = spec.recipe
    if not spec.delayed:
        return [_cast_current(spec, grad, Role.GRAD_OUTPUT) for grad in grad_outputs_hp]
    fp8_dtype = recipe.fp8_dtype(Role.GRAD_OUTPUT)
    history, scale = _states(spec, members, forward=False, after=grad_outputs_hp[0])  # (m, 1, len), (m, 1)
    new_scales = scale_from_history(history[:, 0], scale[:, 0], fp8_dtype, recipe.margin,
                                    recipe.amax_compute_algo)  # (m,)
    casts = [(quantize(grad, grad_scale, fp8_dtype), grad_scale, inverse_scale)
             for grad, grad_scale, inverse_scale in zip(grad_outputs_hp, new_scales,
                                                        scalars_of(new_scales.reciprocal()))]
    if not spec.update:
        return casts
    record_states([member.grad_state for member in members], [[row_amaxes(grad.detach())] for grad in grad_outputs_hp],
                   new_scales[:, None].contiguous(), reduce)
    return casts


class _LinearsFP8(torch.autograd.Function):
    """``outputs_i = input @ weight_i^T + bias_i`` for the members of one call (see the module's doc), on the
    (M, K) input: each output is its GEMM's own (M, N_i) result, never a view. The caller reshapes outside,
    where autograd tracks the views as ordinary ones: user code may write into an output in place
    (Falcon's ``mlp_output += attention_output``), which autograd forbids on a view a custom Function returns."""

    @staticmethod
    def forward(ctx, input_hp_2d, spec: CallSpec, members: tuple[Member, ...], *weights_and_biases):
        count = len(members)
        weights_hp, biases_hp = weights_and_biases[:count], weights_and_biases[count:]
        recipe = spec.recipe
        for weight_hp in weights_hp:
            if is_gathered(weight_hp):
                weight_hp.require_form_of(recipe)
        device_type = input_hp_2d.device.type
        # Under autocast F.linear returns the autocast dtype; so does this.
        output_dtype = autocast_dtype(device_type) or input_hp_2d.dtype
        needs_grad_input = ctx.needs_input_grad[0]
        needs_grad_weight = [ctx.needs_input_grad[3 + i] for i in range(count)]
        ctx.amax_reduce = call_amax_reduction(spec)
        with autocast_off(device_type):
            if spec.delayed:
                input_fp8, input_scale, input_inverse_scale, weights = _cast_forward_delayed(
                    spec, input_hp_2d, weights_hp, members, ctx.amax_reduce)
            else:
                input_fp8, input_scale, input_inverse_scale = _cast_current(spec, input_hp_2d, Role.INPUT)
                weights = [_cast_weight_current(spec, w, m) for w, m in zip(weights_hp, members)]
            input_fp8 = spec.gemm_operand(input_fp8)
            # grad_weight reads the input column-major: its transposed copy, written now and kept
            # instead of the row-major one (fp8graph.targets.partitioning keeps it in the forward).
            input_recast = any(needs_grad_weight) and spec.recasts_input()  # else the forward writes it
            input_fp8_t = (spec.transposed(input_fp8, input_hp_2d, input_scale, Role.INPUT)
                           if any(needs_grad_weight) and not input_recast else None)
            input_inverse_scale_forward = spec.kept(input_inverse_scale, input_fp8_t)
            outputs, saved_weights = [], []
            for (weight_fp8, weight_scale, weight_inverse_scale, source), weight_hp, bias_hp in zip(
                    weights, weights_hp, biases_hp):
                weight_fp8 = spec.gemm_operand(weight_fp8)
                # grad_input reads weight_i column-major: its transposed copy, likewise, or cast from the weight
                # in the backward (the weight and its scale are saved instead).
                recast = needs_grad_input and spec.recasts_weight(source)
                weight_fp8_t = (spec.transposed(weight_fp8, source, weight_scale, Role.WEIGHT)
                                if needs_grad_input and not recast else None)
                # output_i = input @ weight_i_t  (M, N_i); fast accumulation is accurate
                # enough for the forward GEMM, as Transformer Engine does.
                output = scaled_gemm_by_inverse(input_fp8, input_inverse_scale_forward, weight_fp8.t(),
                                                spec.kept(weight_inverse_scale, weight_fp8_t), output_dtype,
                                                spec.lowering, use_fast_accum=True)
                if bias_hp is not None:
                    output = output + bias_hp.to(output_dtype)
                outputs.append(output)  # (M, N_i)
                saved_weights += [weight_fp8_t, weight_inverse_scale,
                                  *((source, weight_scale) if recast else (None, None))]
            for member, weight_hp, (weight_fp8, weight_scale, _, _) in zip(members, weights_hp, weights):
                if member.stats is not None:
                    if is_gathered(weight_hp):
                        raise AssertionError("stats=True gathers weights in high precision (fp8graph.fsdp.install)")
                    record_health(member.stats, Role.WEIGHT, weight_hp, weight_fp8, weight_scale, recipe)
            _record_shared_health([m.stats for m in members], Role.INPUT, input_hp_2d, input_fp8, input_scale,
                                  recipe)
        # The backward's GEMMs read the dequantization factors only: no reciprocal there.
        ctx.save_for_backward(input_fp8_t, input_inverse_scale, *saved_weights,
                              *((input_hp_2d, input_scale) if input_recast else (None, None)))
        ctx.spec, ctx.members = spec, members
        ctx.input_dtype = input_hp_2d.dtype
        ctx.weight_dtypes = [w.dtype for w in weights_hp]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases_hp]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs_hp_2d):  # (M, N_i)
        input_fp8_t, input_inverse_scale, *saved_weights, input_hp_2d, input_scale = ctx.saved_tensors
        spec: CallSpec = ctx.spec
        count = len(ctx.members)
        if input_hp_2d is not None and any(ctx.needs_input_grad[3:3 + count]):  # the input's copy, cast now
            input_fp8_t = spec.cast_again_transposed(input_hp_2d, input_scale, Role.INPUT, grad_outputs_hp_2d[0])
        needs_grad_input = ctx.needs_input_grad[0]
        grad_input, grad_weights, grad_biases = None, [None] * count, [None] * count
        with autocast_off(grad_outputs_hp_2d[0].device.type):
            casts = _cast_grad_outputs(spec, grad_outputs_hp_2d, ctx.members, ctx.amax_reduce)
            for i, (member, grad_output_hp_2d, (grad_output_fp8, grad_output_scale, grad_output_inverse_scale)) in \
                    enumerate(zip(ctx.members, grad_outputs_hp_2d, casts)):
                weight_fp8_t, weight_inverse_scale, weight_hp, weight_scale = saved_weights[4 * i:4 * i + 4]
                if needs_grad_input and weight_hp is not None:  # the weight's transposed copy, cast now
                    weight_fp8_t = spec.cast_transposed(weight_hp, weight_scale, Role.WEIGHT)
                grad_output_fp8 = spec.gemm_operand(grad_output_fp8)
                if member.stats is not None:
                    record_health(member.stats, Role.GRAD_OUTPUT, grad_output_hp_2d, grad_output_fp8,
                                  grad_output_scale, spec.recipe)
                if needs_grad_input:
                    # grad_input += grad_output_i @ weight_i  (M, K); split accumulation.
                    term = scaled_gemm_by_inverse(grad_output_fp8, grad_output_inverse_scale, weight_fp8_t.t(),
                                                  weight_inverse_scale, ctx.input_dtype, spec.lowering)
                    grad_input = term if grad_input is None else grad_input + term
                if ctx.needs_input_grad[3 + i]:
                    # grad_weight_i = grad_output_i_t @ input  (N_i, K)
                    grad_output_fp8_t = spec.transposed(grad_output_fp8, grad_output_hp_2d, grad_output_scale,
                                                        Role.GRAD_OUTPUT)
                    grad_weights[i] = scaled_gemm_by_inverse(grad_output_fp8_t, grad_output_inverse_scale,
                                                             input_fp8_t.t(), input_inverse_scale,
                                                             ctx.weight_dtypes[i], spec.lowering)
                if ctx.needs_input_grad[3 + count + i] and ctx.bias_dtypes[i] is not None:
                    grad_biases[i] = grad_output_hp_2d.sum(0, dtype=torch.float32).to(ctx.bias_dtypes[i])
        return grad_input, None, None, *grad_weights, *grad_biases


def record_health(stats: torch.Tensor, role: Role, x_hp, x_fp8, scale, recipe: Recipe) -> None:
    """Write the health of one cast into row ``role`` of the module's stats buffer, in place."""
    _record_shared_health([stats], role, x_hp, x_fp8, scale, recipe)


def _record_shared_health(stats_buffers, role: Role, x_hp, x_fp8, scale, recipe: Recipe) -> None:
    """One cast's health, computed once, into the stats of every member that keeps stats."""
    buffers = [stats for stats in stats_buffers if stats is not None]
    if buffers:
        health = quantization_health(x_hp, x_fp8, scale, recipe.fp8_dtype(role))
        for stats in buffers:
            stats[ROLES.index(role)].copy_(health)


def target_name(kind: str, recipe_name: str, lowering_name: str) -> str:
    """A graph target's name: ``fp8graph_<kind>_<recipe>_<lowering>`` as an identifier."""
    label = "".join(ch if ch.isalnum() else "_" for ch in f"{recipe_name}_{lowering_name}")
    while "__" in label:
        label = label.replace("__", "_")
    return f"fp8graph_{kind}_{label.strip('_')}"


def _label(recipe: Recipe, update: bool, in_checkpoint: bool, weight_cache: str | None) -> str:
    label = recipe.name if update else f"{recipe.name}_frozen"
    label = f"{label}_checkpointed" if in_checkpoint else label
    return f"{label}_{weight_cache}_cached_weight" if weight_cache else label


def _members(count, stats, histories, scales, grad_histories, grad_scales, cached_weights, cached_weight_scales,
             weight_cache):
    def entries(values):
        return [None] * count if values is None else list(values)

    return tuple(Member(state=None if history is None else (history, scale),
                        grad_state=None if grad_history is None else (grad_history, grad_scale),
                        weight_cache=None if cached is None else WeightCopy(weight_cache, cached, cached_scale),
                        stats=stats_buffer)
                 for stats_buffer, history, scale, grad_history, grad_scale, cached, cached_scale in zip(
                     entries(stats), entries(histories), entries(scales), entries(grad_histories),
                     entries(grad_scales), entries(cached_weights), entries(cached_weight_scales)))


@functools.cache
def linears_fp8_target(recipe: Recipe, lowering: Lowering, update: bool = True, in_checkpoint: bool = False,
                       weight_cache: str | None = None) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The graph target for a group of sites that read one input, with ``recipe`` lowered by ``lowering``.

    Called as ``linears_fp8(input_hp, weights, biases, stats=None, histories=None, scales=None,
    grad_histories=None, grad_scales=None, cached_weights=None, cached_weight_scales=None)`` with one entry per
    site in each list (``None``
    where a site has no such buffer); returns the sites' outputs. ``update=False`` (graphs compiled
    without gradients) only reads delayed-scaling state; ``in_checkpoint`` marks sites inside a
    ``torch.utils.checkpoint`` region; ``weight_cache`` (``"fill"`` or ``"reuse"``) makes the sites write
    or read their weights' FP8 copies (``fp8graph.buffers.weight_cache``).
    """

    def linears_fp8(input_hp, weights_hp, biases_hp, stats=None, histories=None, scales=None,
                    grad_histories=None, grad_scales=None, cached_weights=None, cached_weight_scales=None):
        members = _members(len(weights_hp), stats, histories, scales, grad_histories, grad_scales,
                           cached_weights, cached_weight_scales, weight_cache)
        has_state = any(member.state is not None for member in members)
        spec = CallSpec(recipe, lowering, update or not has_state, snapshot=in_checkpoint and has_state)
        input_hp_2d = input_hp.reshape(-1, input_hp.shape[-1])  # (M, K)
        outputs_2d = _LinearsFP8.apply(input_hp_2d, spec, members, *weights_hp, *biases_hp)  # (M, N_i) each
        return tuple(output.reshape(*input_hp.shape[:-1], output.shape[-1]) for output in outputs_2d)

    linears_fp8.__name__ = target_name("linears", _label(recipe, update, in_checkpoint, weight_cache),
                                       lowering.value)
    linears_fp8.recipe = recipe
    linears_fp8.lowering = lowering
    linears_fp8.reads_gathered_weights = True  # FSDP2's FP8-gathered weights (fp8graph.fsdp.graph_check)
    return register_target(linears_fp8, recipe, lowering, update, in_checkpoint, weight_cache)


@functools.cache
def linear_fp8_target(recipe: Recipe, lowering: Lowering, update: bool = True,
                      in_checkpoint: bool = False, weight_cache: str | None = None) -> Callable[..., torch.Tensor]:
    """The graph target for a site with ``recipe`` lowered by ``lowering``: one member of
    :func:`linears_fp8_target`, called like ``F.linear`` plus the site's buffers.

    FX graphs can only hold primitive constants as arguments, so the recipe
    and lowering are bound into a function with a readable name, which the
    rewritten graph's code then shows (``fp8graph_linear_current_HYBRID_emulated``).
    Delayed-scaling sites also take their ``history``, ``scale``, ``grad_history`` and ``grad_scale`` buffers.
    """
    group = linears_fp8_target(recipe, lowering, update, in_checkpoint, weight_cache)

    def linear_fp8(input_hp, weight_hp, bias_hp=None, stats=None, history=None, scale=None, grad_history=None,
                   grad_scale=None, cached_weight=None, cached_weight_scale=None):
        def one(value):
            return None if value is None else [value]

        (output,) = group(input_hp, [weight_hp], [bias_hp], one(stats), one(history), one(scale),
                          one(grad_history), one(grad_scale), one(cached_weight), one(cached_weight_scale))
        return output

    linear_fp8.__name__ = target_name("linear", _label(recipe, update, in_checkpoint, weight_cache), lowering.value)
    linear_fp8.recipe = recipe
    linear_fp8.lowering = lowering
    linear_fp8.reads_gathered_weights = True
    return register_target(linear_fp8, recipe, lowering, update, in_checkpoint, weight_cache)
