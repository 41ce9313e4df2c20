"""The FP8 linear for recipes with one scale per row, tile or block (row-wise, block, MXFP8).

Each GEMM quantizes both operands along its own reduction dimension::

    forward   output      = input (M, K)       . weight (N, K)         tiles along K
    backward  grad_input  = grad_output (M, N) . weight_t (K, N)       tiles along N
              grad_weight = grad_output_t (N, M) . input_t (K, M)      tiles along M

A tile's scale covers elements of one GEMM's reduction dimension only, so an
operand quantized for one GEMM cannot serve another transposed (its scales
would run across the other GEMM's reduction). Each operand is therefore
quantized both ways from high precision: ``input`` and ``weight`` in the
forward, ``grad_output`` and ``grad_output_t`` in the backward, and
``input_t`` and ``weight_t`` where the recipe's ``save_transposes`` says:

    save_transposes=False (default)   in the backward, from the weight (kept anyway) and from the input,
                                      which AOTAutograd's partitioner saves or makes again from what the
                                      backward keeps anyway: a step keeps no FP8 copy for its backward
    save_transposes=True              in the forward, saved in FP8: the backward reads no weight

On CUDA the 1x128 and 128x128 tilings run fp8graph's kernel, which writes
both layouts from one read where both are cast together; the others run
Inductor's code, fused with the operand's producer
(``fp8graph.kernels.quantize_tiles`` says which and why). An input the kernel
casts again in the backward is made again there where the forward made it
by fusible ops (an RMSNorm's output, SwiGLU's), from what the backward keeps
anyway (``fp8graph.targets.partitioning``): the kernel is an opaque op, and
the partitioner would otherwise save the input in high precision, twice the
bytes of the FP8 copy (docs/benchmarks.md, "Block scaling's kept input
copies"). A weight with
square tiles (block scaling's 128x128) has the same tiles transposed, so both
layouts share one quantization.

Sites that read one input (q, k and v; gate and up) are one call
(:func:`linears_tiled_target`, ``passes/group_sites.py``): the input is cast
once in each layout for all of them, forward and backward.

Under FSDP2 a weight may arrive all-gathered in FP8 already (``fp8graph.fsdp``),
and is not cast again: block scaling's tiles serve both GEMMs; MXFP8 gathers
both layouts. Row-wise gathers only the forward's, a scale ``s_n`` per row
along K; grad_input, which reduces over N, reads those bytes transposed with
each row's scale moved to grad_output's column::

    grad_input = sum_n grad_output[:, n] * weight[n, :]
               = sum_n (grad_output[:, n] / s_n) * (weight[n, :] * s_n)

so grad_output / s is quantized along N and the weight's FP8 bytes are the
other operand, unscaled. With power-of-2 scales (the default) both operands
round as the column-scaled copy would, but where an element falls below
E4M3's normal range.

Only the weight-gradient output and the bias stay in high precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import torch

from fp8graph.fsdp.gathered_weight import GatheredFP8Weight, is_gathered
from fp8graph.numerics.formats import Role
from fp8graph.targets.linear_tensorwise import autocast_dtype, autocast_off, record_health, target_name
from fp8graph.gemm.scaled_gemm import Lowering, tiled_scaled_gemm
from fp8graph.gemm.tiled_operands import TiledOperand, cached_weight_operands, kernel_casts, quantize_both_ways
from fp8graph.recipes.scaling import TiledRecipe
from fp8graph.targets.cache_hash import register_target
from fp8graph.numerics.tiles import Tiling, e8m0_to_scale, expand_scale
from fp8graph.targets.partitioning import keep_for_backward, read_in_backward, saved_not_recomputed

__all__ = ["linear_tiled_target", "linears_tiled_target", "record_tiled_health"]


def _gathered_operands(weight: GatheredFP8Weight, recipe: TiledRecipe, needs_grad_input: bool):
    """``(weight_q (N, K), weight_t_q (K, N) or None, row_scale)`` of a weight FSDP2 gathered in FP8
    (``fp8graph.fsdp.shard_casts``); ``row_scale`` (N,): row-wise's scales, which grad_input moves to
    grad_output (see the module's doc), else None."""
    weight.require_form_of(recipe)
    tiling = recipe.tiling(Role.WEIGHT)
    if weight.form == "tiles":
        if not tiling.is_square:
            raise AssertionError("only square weight tiles are all-gathered in tiles (fp8graph.fsdp.install)")
        weight_q = TiledOperand(weight.fp8_data, weight.scale, tiling)
        return weight_q, weight_q.transposed() if needs_grad_input else None, None
    if weight.form == "rows":
        weight_q = TiledOperand(weight.fp8_data, weight.scale.reshape(-1, 1), tiling)
        if not needs_grad_input:
            return weight_q, None, None
        unscaled = torch.ones((weight.shape[1], 1), dtype=torch.float32, device=weight.fp8_data.device)
        return weight_q, TiledOperand(weight.fp8_data.t(), unscaled, tiling), weight.scale
    # MXFP8: both layouts gathered, grad_input's blocked along N.
    weight_q = TiledOperand(weight.fp8_data, e8m0_to_scale(weight.scale), tiling)
    weight_t_q = (TiledOperand(weight.fp8_t_data.t(), e8m0_to_scale(weight.scale_t).t(), tiling)
                  if needs_grad_input else None)
    return weight_q, weight_t_q, None


def _weight_through_copy(weight_hp: torch.Tensor, recipe: TiledRecipe, mode: str, copies: tuple[torch.Tensor, ...]
                         ) -> tuple[TiledOperand, TiledOperand]:
    """``(weight_q (N, K), weight_t_q (K, N))`` through the weight's kept copies: a ``"fill"`` call casts the
    weight (``fp8graph.gemm.tiled_operands.cached_weight_operands``) and writes them, a ``"reuse"`` call reads
    them and never the weight.
    Copies kept in the weight's own (K, N) shape, for a module that leaves the orientation open, are read
    swapped: grad_input's pair is the forward's, or, for square tiles, the forward's pair transposed."""
    tiling = recipe.tiling(Role.WEIGHT)
    if tiling.is_square:
        copy_fp8, copy_scale = copies
        transposed = copy_fp8.shape != weight_hp.shape
        copy_fp8, copy_scale = (copy_fp8.t(), copy_scale.t()) if transposed else (copy_fp8, copy_scale)
        pairs = [(copy_fp8, copy_scale)]
    else:
        pairs = [copies[:2], copies[2:]]
        if copies[0].shape != weight_hp.shape:
            pairs.reverse()
    if mode == "fill":
        operands = cached_weight_operands(weight_hp, recipe)  # (fp8, scale) pairs in the pairs' order
        for (copy_fp8, copy_scale), fp8, scale in zip(pairs, operands[0::2], operands[1::2], strict=True):
            copy_fp8.copy_(fp8)
            copy_scale.copy_(scale)
    weight_q = TiledOperand(pairs[0][0], pairs[0][1].clone(), tiling)
    if tiling.is_square:
        return weight_q, weight_q.transposed()
    return weight_q, TiledOperand(pairs[1][0], pairs[1][1].clone(), tiling)


def _gemm(a: TiledOperand, b: TiledOperand, out_dtype, lowering, use_fast_accum=False) -> torch.Tensor:
    return tiled_scaled_gemm(a.fp8, a.scale, a.tiling, b.fp8, b.scale, b.tiling, out_dtype, lowering,
                             use_fast_accum)


@dataclasses.dataclass(frozen=True)
class _Member:
    """One site of a call: its module's stats buffer, and its weight's kept copies ``(mode, copies)``."""

    stats: torch.Tensor | None = None
    weight_copy: tuple | None = None


def _weight_operands(weight_hp, recipe: TiledRecipe, needs_grad_input: bool, weight_copy):
    """``(weight_q (N, K), weight_t_q (K, N) or None, row_scale)``: the weight as FSDP2 gathered it, through its
    kept copies, or cast here (the transposed layout only with ``recipe.save_transposes``: else the backward casts
    it from the weight, which is kept anyway)."""
    if is_gathered(weight_hp):  # FSDP2 gathered it cast (fp8graph.fsdp.shard_casts)
        return _gathered_operands(weight_hp, recipe, needs_grad_input)
    if weight_copy is not None:  # kept between calls (fp8graph.buffers.weight_cache)
        weight_q, weight_t_q = _weight_through_copy(weight_hp, recipe, *weight_copy)
        return weight_q, weight_t_q if needs_grad_input else None, None
    saves = recipe.save_transposes
    with _saved_if(saves):  # (N, K), and (K, N) where the forward writes grad_input's operand
        weight_q, weight_t_q = quantize_both_ways(weight_hp, recipe.tiling(Role.WEIGHT), True,
                                                  needs_grad_input and saves)
    return weight_q, weight_t_q, None


class _LinearsTiled(torch.autograd.Function):
    """``outputs_i = input @ weight_i^T + bias_i`` for the members of one call, sites that read one (M, K) input
    (``passes/group_sites.py``): the input is cast once for every member's GEMM, and in the backward once for
    every weight gradient. Each output is its GEMM's own (M, N_i) result, never a view, which user code may write
    into in place (see ``linear_tensorwise._LinearsFP8``)."""

    @staticmethod
    def forward(ctx, input_hp_2d, recipe: TiledRecipe, lowering: Lowering, grad_enabled: bool,
                members: tuple[_Member, ...], *weights_and_biases):
        count = len(members)
        weights_hp, biases_hp = weights_and_biases[:count], weights_and_biases[count:]
        device_type = input_hp_2d.device.type
        output_dtype = autocast_dtype(device_type) or input_hp_2d.dtype
        input_tiling = recipe.tiling(Role.INPUT)
        # The gradient GEMMs' operands, quantized along M (input_t) and N (weight_t), are made only where a
        # gradient needs them: none under torch.no_grad(), which needs_input_grad does not see (the caller passes
        # the grad mode).
        needs_grad_input = grad_enabled and ctx.needs_input_grad[0]
        needs_grad_weight = grad_enabled and any(ctx.needs_input_grad[5:5 + count])
        saves = recipe.save_transposes
        outputs, saved_weights = [], []
        with autocast_off(device_type):
            # (M, K), and (K, M') where the forward writes grad_weight's operand (recipe.save_transposes): else
            # the backward casts it again (see the module's doc).
            input_recast = needs_grad_weight and not saves
            with _saved_if(saves):
                input_q, input_t_q = quantize_both_ways(input_hp_2d, input_tiling, True,
                                                        needs_grad_weight and not input_recast)
            for member, weight_hp, bias_hp in zip(members, weights_hp, biases_hp):
                weight_q, weight_t_q, weight_row_scale = _weight_operands(weight_hp, recipe, needs_grad_input,
                                                                          member.weight_copy)
                if saves:  # tied to the forward GEMM's scales, so that the forward writes them (as MUST_SAVE keeps)
                    kept = [x_t_q.fp8 for x_t_q in (input_t_q, weight_t_q) if x_t_q is not None]
                    input_q = TiledOperand(input_q.fp8, keep_for_backward(input_q.scale, *kept), input_q.tiling)
                # Fast accumulation for the forward GEMM, as for per-tensor scaling.
                output = _gemm(input_q, weight_q, output_dtype, lowering, use_fast_accum=True)
                if bias_hp is not None:
                    output = output + bias_hp.to(output_dtype)
                if member.stats is not None:
                    if is_gathered(weight_hp):
                        raise AssertionError("stats=True gathers weights in high precision (fp8graph.fsdp.install)")
                    record_tiled_health(member.stats, Role.INPUT, input_hp_2d, input_q, recipe)
                    record_tiled_health(member.stats, Role.WEIGHT, weight_hp, weight_q, recipe)
                outputs.append(output)
                # What the forward did not cast for the backward, the backward casts from the weight, a
                # parameter kept anyway.
                weight_source = weight_hp if needs_grad_input and weight_t_q is None else None
                saved_weights += [*_saved(weight_t_q), weight_row_scale, weight_source]
        # The input as AOTAutograd's partitioner chooses: saved, or made again from what the backward keeps anyway.
        input_source = input_hp_2d if input_recast else None
        ctx.save_for_backward(*_saved(input_t_q), input_source, *saved_weights)
        ctx.recipe, ctx.lowering, ctx.members = recipe, lowering, members
        ctx.input_dtype = input_hp_2d.dtype
        ctx.weight_dtypes = [w.dtype for w in weights_hp]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases_hp]
        return tuple(outputs)  # (M, N_i) each

    @staticmethod
    def backward(ctx, *grad_outputs_hp_2d):  # (M, N_i) each
        input_t_fp8, input_t_scale, input_source, *saved_weights = ctx.saved_tensors
        recipe: TiledRecipe = ctx.recipe
        count = len(ctx.members)
        needs_grad_input = ctx.needs_input_grad[0]
        grad_input, grad_weights, grad_biases = None, [None] * count, [None] * count
        grad_tiling, weight_tiling = recipe.tiling(Role.GRAD_OUTPUT), recipe.tiling(Role.WEIGHT)
        input_t_q = None
        with autocast_off(grad_outputs_hp_2d[0].device.type):
            for i, (member, grad_output_hp_2d) in enumerate(zip(ctx.members, grad_outputs_hp_2d)):
                weight_t_fp8, weight_t_scale, weight_row_scale, weight_source = saved_weights[4 * i:4 * i + 4]
                needs_grad_weight = ctx.needs_input_grad[5 + i]
                if weight_row_scale is not None and needs_grad_input:
                    # A row-wise weight gathered in FP8: its row scales move to grad_output (see the module's doc).
                    grad_output_q, _ = quantize_both_ways(grad_output_hp_2d.float() / weight_row_scale, grad_tiling,
                                                          True, False)
                    _, grad_output_t_q = quantize_both_ways(grad_output_hp_2d, grad_tiling, False, needs_grad_weight)
                else:
                    # Along N for grad_input, along M (transposed) for grad_weight; one read where both are needed.
                    grad_output_q, grad_output_t_q = quantize_both_ways(
                        grad_output_hp_2d, grad_tiling, needs_grad_input or member.stats is not None,
                        needs_grad_weight)
                if member.stats is not None:
                    record_tiled_health(member.stats, Role.GRAD_OUTPUT, grad_output_hp_2d, grad_output_q, recipe)
                if needs_grad_input:
                    weight_t_q = (TiledOperand(weight_t_fp8, weight_t_scale, weight_tiling)  # (K, N_i)
                                  if weight_source is None
                                  else _cast_in_backward(weight_source, weight_tiling, grad_output_hp_2d))
                    term = _gemm(grad_output_q, weight_t_q, ctx.input_dtype, ctx.lowering)  # (M, K)
                    grad_input = term if grad_input is None else grad_input + term
                if needs_grad_weight:
                    if input_t_q is None:  # (K, M'): cast and laid out once for every member's weight gradient
                        input_t_q = (TiledOperand(input_t_fp8, input_t_scale, recipe.tiling(Role.INPUT))
                                     if input_source is None
                                     else _cast_in_backward(input_source, recipe.tiling(Role.INPUT),
                                                            grad_output_hp_2d, laid_out_by_reader=True)).laid_out()
                    if grad_output_t_q.fp8.shape[1] != input_t_q.fp8.shape[1]:
                        raise AssertionError("grad_output and input padded to different token counts")
                    grad_weights[i] = _gemm(grad_output_t_q, input_t_q, ctx.weight_dtypes[i], ctx.lowering)
                if ctx.needs_input_grad[5 + count + i] and ctx.bias_dtypes[i] is not None:
                    grad_biases[i] = grad_output_hp_2d.sum(0, dtype=torch.float32).to(ctx.bias_dtypes[i])
        return grad_input, None, None, None, None, *grad_weights, *grad_biases


def _saved_if(saves: bool):
    """With ``recipe.save_transposes``, the casts the backward reads are saved from the forward, never cast again
    there (the partitioner would otherwise cast a weight's again from the parameter, which it keeps anyway; marked
    ``MUST_SAVE`` and tied to the forward GEMM: ``fp8graph.targets.partitioning``)."""
    return saved_not_recomputed() if saves else contextlib.nullcontext()


def _cast_in_backward(x_hp: torch.Tensor, tiling: Tiling, grad: torch.Tensor, use_kernel: bool | None = None,
                      laid_out_by_reader: bool = False) -> TiledOperand:
    """``x_hp`` (R, C) cast along R and laid out (C, R'), in the backward that computes ``grad``: the bytes the
    forward's ``quantize_both_ways`` would have written (square tiles group the same elements either way round:
    their cast of ``x_hp`` transposed is the forward's tiles transposed, written in the layout the GEMM reads).

    Left to itself AOTAutograd's partitioner may cast in the forward and save the copy. Tied to ``grad``
    (``fp8graph.targets.partitioning.read_in_backward``), the tiles' scales are read in the backward, so the cast
    and its layout run in the backward's kernels, from ``x_hp`` saved or made again there from what the backward
    keeps anyway (the amaxes too, or a few bytes a tile saved from the forward, as the partitioner chooses).
    fp8graph's kernel computes its scales itself: it reads ``x_hp`` tied so; a weight is kept anyway, an
    activation made by fusible ops is made again for it (``fp8graph.targets.partitioning``). Inductor's code
    fuses with what makes ``x_hp`` again. ``laid_out_by_reader``: as ``quantize_both_ways`` takes it."""
    if use_kernel is None:
        use_kernel = kernel_casts(x_hp, tiling)
    if use_kernel:
        _, x_t_q = quantize_both_ways(read_in_backward(x_hp, grad), tiling, False, True, use_kernel=True)
    else:
        _, x_t_q = quantize_both_ways(x_hp, tiling, False, True, use_kernel=False,
                                      scales_read=lambda scale: read_in_backward(scale, grad),
                                      laid_out_by_reader=laid_out_by_reader)
    return x_t_q


def _saved(x_q: TiledOperand | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if x_q is None else (x_q.fp8, x_q.scale)


def record_tiled_health(stats: torch.Tensor, role: Role, x_hp: torch.Tensor, x_q: TiledOperand,
                        recipe: TiledRecipe) -> None:
    """Row ``role`` of the module's stats buffer for a tiled cast (padding left out): its
    health with each element's own tile scale; the scale recorded is the smallest."""
    columns = x_hp.shape[1]
    scale = expand_scale(x_q.scale, x_q.tiling, x_q.fp8.shape)[:, :columns]
    record_health(stats, role, x_hp, x_q.fp8[:, :columns], scale, recipe)


def _group_members(count: int, stats, copies_by_keyword: dict, weight_cache: str | None) -> tuple[_Member, ...]:
    """Each member's stats buffer and weight copies ``(mode, copies)`` from the call's lists (``None``: none)."""
    stats = [None] * count if stats is None else list(stats)
    lists = [copies for copies in copies_by_keyword.values() if copies is not None]
    if (weight_cache is None) != (not lists):
        raise ValueError("fp8graph: a tiled linear's FP8 weight copies and the cache's mode come together")
    copies = list(zip(*lists)) if lists else [None] * count
    return tuple(_Member(stats_buffer, None if member_copies is None else (weight_cache, tuple(member_copies)))
                 for stats_buffer, member_copies in zip(stats, copies, strict=True))


def _registered(target: Callable, kind: str, recipe: TiledRecipe, lowering: Lowering, weight_cache: str | None
                ) -> Callable:
    """``target`` named ``fp8graph_<kind>_<recipe>_<lowering>`` (and its copies' mode), its recipe and lowering
    attached, registered (``cache_hash.register_target``)."""
    label = recipe.name if weight_cache is None else f"{recipe.name}_{weight_cache}_cached_weight"
    target.__name__ = target_name(kind, label, lowering.value)
    target.recipe = recipe
    target.lowering = lowering
    target.weight_cache = weight_cache
    target.reads_gathered_weights = True  # FSDP2's FP8-gathered weights (fp8graph.fsdp.graph_check)
    return register_target(target, recipe, lowering, *([weight_cache] if weight_cache else []))


@functools.cache
def linears_tiled_target(recipe: TiledRecipe, lowering: Lowering,
                         weight_cache: str | None = None) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The graph target for a group of sites that read one input, with a row-wise, block or MX ``recipe``.

    Called as ``linears_tiled(input_hp, weights, biases, stats=None, cached_weights=None,
    cached_weight_scales=None, cached_weights_t=None, cached_weight_t_scales=None)`` with one entry per site in
    each list; returns the sites' outputs. With ``weight_cache`` (``"fill"`` or ``"reuse"``) the sites take
    their weights' kept copies (``cached_weight_operands``: square tiles have no transposed pair) and write or
    read them in place of casting the weights."""

    def linears_tiled(input_hp, weights_hp, biases_hp, stats=None, cached_weights=None, cached_weight_scales=None,
                      cached_weights_t=None, cached_weight_t_scales=None):
        members = _group_members(len(weights_hp), stats, {"cached_weights": cached_weights,
                                                          "cached_weight_scales": cached_weight_scales,
                                                          "cached_weights_t": cached_weights_t,
                                                          "cached_weight_t_scales": cached_weight_t_scales},
                                 weight_cache)
        input_hp_2d = input_hp.reshape(-1, input_hp.shape[-1])  # (M, K)
        outputs_2d = _LinearsTiled.apply(input_hp_2d, recipe, lowering, torch.is_grad_enabled(), members,
                                         *weights_hp, *biases_hp)
        return tuple(output.reshape(*input_hp.shape[:-1], output.shape[-1]) for output in outputs_2d)

    return _registered(linears_tiled, "linears", recipe, lowering, weight_cache)


@functools.cache
def linear_tiled_target(recipe: TiledRecipe, lowering: Lowering,
                        weight_cache: str | None = None) -> Callable[..., torch.Tensor]:
    """The graph target for a site with a row-wise, block or MX ``recipe``, named for it: one member of
    :func:`linears_tiled_target`. With ``weight_cache`` (``"fill"`` or ``"reuse"``) it takes the weight's kept
    copies as ``cached_weight``, ``cached_weight_scale`` and, but for square tiles, ``cached_weight_t`` and
    ``cached_weight_t_scale`` (``cached_weight_operands``), and writes or reads them in place of casting the
    weight."""
    group = linears_tiled_target(recipe, lowering, weight_cache)

    def linear_tiled(input_hp, weight_hp, bias_hp=None, stats=None, cached_weight=None, cached_weight_scale=None,
                     cached_weight_t=None, cached_weight_t_scale=None):
        def one(value):
            return None if value is None else [value]

        (output,) = group(input_hp, [weight_hp], [bias_hp], one(stats), one(cached_weight), one(cached_weight_scale),
                          one(cached_weight_t), one(cached_weight_t_scale))
        return output

    return _registered(linear_tiled, "linear", recipe, lowering, weight_cache)
