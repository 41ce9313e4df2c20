"""The FP8 expert GEMM: a mixture-of-experts' grouped GEMM as three scaled grouped GEMMs.

A rewritten expert site calls ``grouped_fp8(input_hp, weight_hp, offsets)`` with the tokens sorted
by expert ``input_hp`` (S, K), the experts' weights ``weight_hp`` (E, N, K) (HuggingFace's layout;
a (E, K, N) parameter is fed transposed) and the groups' ``offsets`` (E,), as
``torch._grouped_mm(input, weight.transpose(-2, -1), offs=offsets)`` computes it::

    forward   output        = input_fp8 . weight_e_fp8^T          (S, N)     rows of group e, reduced along K
    backward  grad_input    = grad_output_fp8 . weight_e_fp8      (S, K)     reduced along N
              grad_weight_e = grad_output_e_fp8^T . input_e_fp8   (E, N, K)  reduced along group e's tokens

Scales, per recipe (``fp8graph.numerics.groups`` draws the groups):

    recipe     input / grad_output rows    weight_e                       grad_weight's operands
    rowwise    per row                     per output row (N), and per    per group and column
                                           column (K) for grad_input
    current    per tensor                  per expert                     the same casts; the input's laid
                                                                          out for it in the forward
    delayed    per tensor, from its        per expert, from its history   as current
               history                     (a row per expert)
    mxfp8      blocks of 32 along K (N     blocks of 32 along K (N for    blocks of 32 tokens, each group
               for grad_input), E8M0       grad_input)                    zero-padded to a multiple of 32
                                                                          (``grouped_blocks``)

Every operand is E4M3, whatever the recipe's ``fp8_format``: ``torch._scaled_grouped_mm`` takes
E4M3 only (the decision records the recipe the site runs, ``fp8graph.recipes.scaling.expert_recipe``).
The quantization is plain torch ops inside an ``autograd.Function``, which AOTAutograd traces into both graphs, so
Inductor fuses amax, scale and cast with their neighbours; the GEMMs are
``fp8graph.gemm.grouped_gemm``'s. Only the output of the weight gradient stays in high precision.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from fp8graph.gemm.grouped_gemm import (group_columns_for_grad_weight, grouped_scaled_gemm, grouped_scaled_gemm_weights,
                                        placed_for_grad_weight)
from fp8graph.gemm.scaled_gemm import Lowering, one_buffer
from fp8graph.kernels.group_columns import (  # (registers fp8graph::quantize_rows_placed too)
    takes_expert_destinations, takes_expert_weight)
from fp8graph.kernels.quantize_transposed import (quantize_both_layouts, quantize_both_layouts_into_,
                                                  quantize_transposed)
from fp8graph.kernels.swiglu_backward import swiglu_backward_reference
from fp8graph.kernels.swiglu_forward import swiglu_forward_placed
from fp8graph.numerics.formats import Role
from fp8graph.numerics.groups import ExpertGemm, weight_copy_fits
from fp8graph.numerics.quantize import (amax_to_scale, current_scale, finite_magnitude, largest_amax, quantize,
                                        quantize_current, row_amaxes, untracked)
from fp8graph.recipes.scaling import EXPERT_GRANULARITIES, FP8_GEMM_DIM_MULTIPLE, NATIVE_GROUPED_GRANULARITIES, Recipe
from fp8graph.buffers.amax_reduction import call_amax_reduction
from fp8graph.numerics.delayed_scaling import scale_from_history
from fp8graph.targets.cache_hash import register_target
from fp8graph.targets.grouped_blocks import GroupedBlocks
from fp8graph.targets.linear_tensorwise import autocast_off, record_health, record_states, target_name
from fp8graph.targets.partitioning import keep_for_backward, read_in_backward, saved_not_recomputed

__all__ = ["ExpertWeightCopy", "GroupedSpec", "cast_experts", "cast_forward_delayed", "cast_rows", "fuses_neighbours",
           "grouped_fp8_target", "health_scales", "takes_swiglu_source"]

_FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class GroupedSpec:
    """How an expert call casts: the recipe and the GEMM lowering."""

    recipe: Recipe
    lowering: Lowering
    update: bool = True  # delayed scaling: False in graphs without gradients, which read the stored scales
    swiglu: bool = False  # the call returns silu(gate) * up of its output's halves (fuses_neighbours)
    combine_top_k: int = 0  # else the call returns its output's combine, top_k rows a token (fuses_neighbours)
    # What the expert MLP's two inputs save beyond the copies kept pays for this one's weight copy too
    # (fp8graph.numerics.groups.weight_copies_kept, decided by passes.expert_sites.pool_weight_copies).
    pooled_weight_copy: bool = False

    @property
    def delayed(self) -> bool:
        return self.recipe.stateful

    @property
    def per_row(self) -> bool:
        return self.recipe.tiled

    @property
    def power_2(self) -> bool:
        return self.recipe.power_2_scales


def _scale(amax_fp32: torch.Tensor, spec: GroupedSpec) -> torch.Tensor:
    return amax_to_scale(amax_fp32, _FP8, spec.power_2)


def cast_rows(x_hp: torch.Tensor, spec: GroupedSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x_hp`` (R, C) cast along C: ``(x_fp8, scale (R,) or 0-dim, inverse_scale (R,))``."""
    if spec.per_row:
        scale = _scale(row_amaxes(x_hp.detach()), spec)  # (R,)
        return quantize(x_hp, scale[:, None], _FP8), scale, scale.reciprocal()
    x_fp8, scale = quantize_current(x_hp, _FP8, spec.power_2)  # one scale for the tensor
    return x_fp8, scale, scale.reciprocal().expand(x_hp.shape[0])


def cast_experts(weight_hp: torch.Tensor, spec: GroupedSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight_hp`` (E, R, C) cast along C: ``(weight_fp8, scale (E, R) or (E, 1), inverse_scale (E, R))``."""
    experts, rows, columns = weight_hp.shape
    if spec.per_row:
        weight_fp8, scale, inverse = cast_rows(weight_hp.reshape(experts * rows, columns), spec)
        return weight_fp8.reshape(experts, rows, columns), scale.reshape(experts, rows), inverse.reshape(experts, rows)
    scale = _expert_scale(weight_hp, spec)
    return quantize(weight_hp, scale[:, :, None], _FP8), scale, scale.reciprocal().expand(experts, rows)


def _expert_scale(weight_hp: torch.Tensor, spec: GroupedSpec) -> torch.Tensor:
    """Current scaling's scale of each expert of ``weight_hp`` (E, R, C): (E, 1)."""
    return _scale(finite_magnitude(weight_hp.detach()).amax(dim=(1, 2)), spec)[:, None]


def _cast_experts_both_layouts(weight_hp: torch.Tensor, spec: GroupedSpec
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight_hp`` (E, N, K) cast per expert with current scaling in both GEMMs' layouts by one kernel
    (:func:`_transposed_for_grad_input`): ``(weight_fp8 (E, N, K), weight_t_fp8 (E, K, N), scale (E, 1),
    inverse_scale (E, N))``."""
    experts, rows, _ = weight_hp.shape
    scale = _expert_scale(weight_hp, spec)
    with saved_not_recomputed():  # grad_input's copy is saved, never cast again from the weight
        weight_fp8, weight_t_fp8, _ = quantize_both_layouts(weight_hp, scale, False)
    return weight_fp8, weight_t_fp8, scale, scale.reciprocal().expand(experts, rows)


class ExpertWeightCopy(NamedTuple):
    """An expert weight's FP8 copies kept between calls (``fp8graph.buffers.weight_cache.copy_layout``): a
    ``"fill"`` call casts the weight and writes them, a ``"reuse"`` call reads them and never the weight."""

    mode: str
    weight_fp8: torch.Tensor  # (E, N, K): the forward GEMM's layout
    scale: torch.Tensor  # (E, N) row-wise, (E, N, K / 32) MXFP8, else (E, 1)
    weight_t_fp8: torch.Tensor  # (E, K, N): grad_input's
    t_scale: torch.Tensor | None = None  # row-wise's (E, K), MXFP8's (E, K, N / 32): grad_input's cast, along N

    @staticmethod
    def of(weight_hp: torch.Tensor, mode: str, weight_fp8, scale, weight_t_fp8, t_scale=None):
        """The copies as the site reads them: a parameter stored (E, K, N), fed transposed, keeps its own shape
        first, which is grad_input's layout (and, row-wise or MXFP8, its scales are the cast along N's). A square
        one is told by its strides, the site reading it as a transposed view; a square weight stored column-major
        and read as stored is taken for one too, which swaps its buffers' roles at every call alike."""
        square = weight_hp.shape[-1] == weight_hp.shape[-2]
        transposed_view = weight_hp.stride(-2) == 1 and weight_hp.stride(-1) != 1
        if weight_fp8.shape != weight_hp.shape or (square and transposed_view):
            weight_fp8, weight_t_fp8 = weight_t_fp8, weight_fp8
            if t_scale is not None:
                scale, t_scale = t_scale, scale
        return ExpertWeightCopy(mode, weight_fp8, scale, weight_t_fp8, t_scale)


def cast_forward_delayed(input_hp, weight_hp, state, spec: GroupedSpec, gather_index=None,
                         weight_copy: ExpertWeightCopy | None = None, placed_offsets: torch.Tensor | None = None,
                         both_layouts: bool = False, swiglu_source: torch.Tensor | None = None, *, reduce):
    """The forward casts with delayed scaling: the input's scale from row 0 of the history, expert e's from row
    1 + e; every row moves one step (new scales, histories rolled, this call's amaxes recorded) in one
    ``fp8graph::record_delayed_``. Returns the two casts as :func:`cast_rows` and :func:`cast_experts` do, the
    input's layout for grad_weight or None, and the weight's cast in grad_input's layout (E, K, N) or None: with
    ``placed_offsets`` (the groups' ends) the gathered input is cast by :func:`_cast_rows_placed`, its cast the
    gathered rows (S, K), and the amaxes recorded are its; with ``swiglu_source`` too the input is SwiGLU of that
    tensor, computed and cast by :func:`_cast_swiglu_placed`; with ``both_layouts`` one kernel casts the weight
    into both GEMMs' layouts and takes its amaxes (:func:`_transposed_for_grad_input`).

    Through ``weight_copy``, a filling call also writes the weight's cast, its transpose and the scales into the
    copies; a reusing call casts only the input, takes the copy and the scales it was cast with, and records no
    amax for the experts (zero: as Transformer Engine's cached weights, whose history slot stays empty).
    ``reduce``: the amaxes' reduction across data-parallel ranks, or None (``call_amax_reduction``)."""
    history, scale = state[0], state[1]  # (1 + E, len), (1 + E,)
    recipe = spec.recipe
    reuse = weight_copy is not None and weight_copy.mode == "reuse"
    # The scales the history gives, whether or not the call moves it (inference: as Transformer Engine's).
    # Read from the buffers a training forward then updates: saved for the backward, never recomputed from them.
    with saved_not_recomputed():
        new_scales = scale_from_history(history, scale, _FP8, recipe.margin, recipe.amax_compute_algo)
    if reuse:
        with saved_not_recomputed():
            new_scales = torch.cat([new_scales[:1], weight_copy.scale.reshape(-1)])
    experts, rows, _ = weight_hp.shape
    # Views that keep the scales one buffer (as fp8graph.gemm.scaled_gemm.scalars_of): indexed, Inductor would
    # recompute them inside each reader, and the input's cast could then no longer join its amax's kernel.
    new_scales = new_scales.contiguous()
    input_scale, weight_scale = (torch.as_strided(new_scales, (), (), 0),
                                 torch.as_strided(new_scales, (experts, 1), (1, 1), 1))  # 0-dim, (E, 1)
    inverse = new_scales.reciprocal()
    input_placed = None
    if placed_offsets is not None and swiglu_source is not None:
        input_fp8, input_placed, input_amaxes = _cast_swiglu_placed(swiglu_source, input_scale, placed_offsets)
    elif placed_offsets is not None:
        input_fp8, input_placed, input_amaxes = _cast_rows_placed(input_hp, input_scale, placed_offsets, gather_index)
    else:
        input_fp8 = quantize(input_hp, input_scale, _FP8)
        # Of the gathered rows when the input is gathered: the kernel that gathers and casts them takes their
        # amaxes too.
        rows_hp = input_hp if gather_index is None else input_hp[gather_index]
        input_amaxes = row_amaxes(rows_hp.detach()) if spec.update else None
    weight_t_fp8 = None
    if reuse:
        # An empty partial a row: zero recorded, and no kernel to make zeros for each of E rows.
        weight_fp8, weight_amaxes = weight_copy.weight_fp8, weight_copy.scale.new_empty(experts, 0)
    elif both_layouts:  # a partial amax a 64 x 64 tile of each expert, from the read that casts
        with saved_not_recomputed():
            weight_fp8, weight_t_fp8, weight_amaxes = quantize_both_layouts(weight_hp, weight_scale, spec.update)
    elif weight_copy is not None:
        # Both layouts written straight into the copies by the kernel that casts (and takes the amaxes): left to
        # Inductor, the cast's kernel would store the transpose a row apart from inside the amax's reduction,
        # which the GPU runs far slower than its bytes say (docs/cost-model.md).
        weight_amaxes = quantize_both_layouts_into_(weight_hp, weight_scale, spec.update, weight_copy.weight_fp8,
                                                    weight_copy.weight_t_fp8)
        weight_fp8 = weight_copy.weight_fp8
        if not spec.update:  # else the record keeps the scales
            weight_copy.scale.copy_(weight_scale)
    else:
        # Per-row partial amaxes, computed with the cast in one read; the op finishes them.
        weight_fp8 = quantize(weight_hp, weight_scale[:, :, None], _FP8)
        weight_amaxes = finite_magnitude(weight_hp.detach()).amax(dim=2)  # (E, N)
    if spec.update:
        partials = [input_amaxes.reshape(-1), *weight_amaxes.unbind(0)]
        filling = weight_copy is not None and not reuse
        record_states([(history, scale)], [partials], new_scales[None].contiguous(),
                      reduce, [weight_copy.scale] if filling else ())
    return ((input_fp8, input_scale, inverse[0].expand(input_fp8.shape[0])),
            (weight_fp8, weight_scale, inverse[1:, None].expand(experts, rows)), input_placed, weight_t_fp8)


def _cast_rows_placed(input_hp: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                      gather_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A per-tensor cast of the gathered rows ``input_hp[gather_index]`` for both GEMMs that read it, by one
    kernel (``fp8graph::quantize_rows_placed``): ``(rows_fp8 (S, K), input_placed (K, S'), amax (E + 1, K / 64))``.
    Cast by Inductor, the kernel that gathers the rows writes the rows' cast and ``fp8graph::transpose_fp8`` reads
    it again to place it (``placed_for_grad_weight``): this reads the rows once for both."""
    return torch.ops.fp8graph.quantize_rows_placed(input_hp, scale, offsets, FP8_GEMM_DIM_MULTIPLE, gather_index)


def _cast_swiglu_placed(gate_up_hp: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This GEMM's input, ``silu(gate) * up`` of ``gate_up_hp``'s halves (the gate_up call's output, which only
    SwiGLU reads), cast per tensor for both GEMMs that read it by the kernel that computes it
    (``fp8graph::swiglu_forward_placed``): ``(rows_fp8 (S, I), input_placed (I, S'), amax (E + 1, I / 64))``. Cast
    by Inductor, the kernel that computes SwiGLU stores the rows' cast and ``fp8graph::transpose_fp8`` reads it
    again to place it (``placed_for_grad_weight``): this writes the layout from the same read."""
    return swiglu_forward_placed(gate_up_hp, scale, offsets, FP8_GEMM_DIM_MULTIPLE)


def takes_swiglu_source(recipe: Recipe, lowering: Lowering) -> bool:
    """Whether an expert site whose input is SwiGLU of another site's output (``fuses_neighbours``: the gate_up
    call returns that output too) takes that output, ``swiglu_source``, and casts its input from it by one kernel
    for both GEMMs that read it (:func:`_cast_swiglu_placed`): the per-tensor recipes on the native path, one scale
    for the rows and grad_weight's layout. Row-wise casts the layout a scale a group and column
    (``fp8graph::quantize_group_columns_placed``)."""
    return fuses_neighbours(recipe, lowering) and not recipe.tiled


def _placed_by_one_kernel(spec: GroupedSpec, source, needs_grad_weight: bool) -> bool:
    """Whether the input's one per-tensor cast is written for both GEMMs by one kernel that reads it from
    ``source``: a gather's index (:func:`_cast_rows_placed`) or the output whose SwiGLU the input is
    (:func:`_cast_swiglu_placed`); on the native path, where grad_weight's GEMM reads its own layout of it.
    Otherwise the rows' cast joins the kernel that produces them, and reading them again in high precision would
    cost more than laying out the FP8 bytes (``placed_for_grad_weight``)."""
    return (source is not None and needs_grad_weight and not spec.per_row
            and spec.lowering is Lowering.SCALED_MM)


def _grad_scale_delayed(state, spec: GroupedSpec, after: torch.Tensor) -> torch.Tensor:
    """grad_output's delayed scale (1,), from its own history, read when the backward that computes ``after``
    runs."""
    history, scale = (read_in_backward(buffer, after) for buffer in state[2:])  # (1, len), (1,)
    return scale_from_history(history, scale, _FP8, spec.recipe.margin, spec.recipe.amax_compute_algo)


def _record_grad_amaxes(state, spec: GroupedSpec, amaxes: torch.Tensor, new_scale: torch.Tensor, reduce) -> None:
    """Move grad_output's history one step: ``amaxes`` this call's partials, ``new_scale`` (1,) its scale, ``reduce``
    the forward's amax reduction (:meth:`_GroupedFP8.forward`)."""
    if spec.update:
        record_states([state[2:]], [[amaxes]], new_scale[None].contiguous(), reduce)


def _cast_grad_output_delayed(grad_output_hp, state, spec: GroupedSpec, reduce):
    """grad_output's cast with delayed scaling, from its own history, read when this backward runs."""
    new_scale = _grad_scale_delayed(state, spec, grad_output_hp)
    grad_output_fp8 = quantize(grad_output_hp, new_scale[0], _FP8)
    _record_grad_amaxes(state, spec, row_amaxes(grad_output_hp.detach()), new_scale, reduce)
    return grad_output_fp8, new_scale[0], new_scale.reciprocal().expand(grad_output_hp.shape[0])


def fuses_neighbours(recipe: Recipe, lowering: Lowering) -> bool:
    """Whether an expert site takes the ops next to it into its call, so that its backward computes its
    grad_output, casts it for both of its GEMMs and lays it out for grad_weight in one kernel: SwiGLU where it
    alone reads the output (``silu(gate) * up`` of its halves, ``passes.expert_sites.read_swiglu``:
    :func:`_cast_swiglu_backward`), the experts' combine where it alone reads it (each row times its routing weight,
    the tokens' order restored, each token's top_k rows summed, ``passes.expert_sites.read_combine``:
    :func:`_cast_combine_backward`). The per-tensor and row-wise recipes on the native path (fp8graph's kernels
    cast a scale a tensor, or a scale a row and a scale a group and column). Elsewhere autograd's ops stay in the
    graph as they were (MXFP8's blocks and the emulation read the gradient in high precision anyway)."""
    return recipe.granularity in NATIVE_GROUPED_GRANULARITIES and lowering is Lowering.SCALED_MM


def _swiglu(gate_up_hp: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up_hp``'s halves, in the ops of the graph it replaces: Inductor fuses them
    with the next GEMM's cast as it did there."""
    gate, up = gate_up_hp.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _combine(rows_hp: torch.Tensor, row_weights: torch.Tensor, permutation: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts' combine of ``rows_hp`` (S, N), sorted by expert: each row times its ``row_weights`` (S, 1), the
    tokens' order restored (``permutation`` sorted them), each token's ``top_k`` rows summed: (S / top_k, N). In the
    ops of the graph it replaces (Inductor may keep the product in fp32 where that graph rounded it to BF16, or the
    other way round); the inverse of the permutation is made as that graph made it."""
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.shape[0], device=permutation.device)
    return (rows_hp * row_weights)[inverse].view(-1, top_k, rows_hp.shape[1]).sum(dim=1)


def _cast_combine_backward(grad_hp: torch.Tensor, row_weights: torch.Tensor, rows_hp: torch.Tensor | None,
                           token_of_row: torch.Tensor, offsets: torch.Tensor, state, spec: GroupedSpec,
                           layout: bool = True, *, reduce):
    """Through :func:`_combine`, given its gradient ``grad_hp`` (T, N): this GEMM's grad_output
    ``grad_hp[token_of_row] * row_weights`` (S, N) cast for both of its GEMMs, ``(grad_output_fp8 (S, N), scale,
    inverse (S,), placed (N, S'), placed_inverse (E, N), grad_row_weights (S, 1) or None)``: the rows grad_input's
    GEMM reads, ``placed`` laid out for grad_weight's with its inverse scales, and the routing weights' gradient,
    each gathered row's dot product with the GEMM's output ``rows_hp`` (S, N), which the forward kept only where
    the routing weights need a gradient (else None, and no gradient). One kernel gathers, weighs, casts and writes
    both layouts (and the dots): per tensor ``fp8graph::quantize_weighted_rows_placed``, one scale for both;
    row-wise ``fp8graph::quantize_weighted_rows_rowwise``, the rows each with its own scale and the layout per
    group and column (the kernel's first read of the rows takes those amaxes). A weighted row's amax is its
    token's gradient amax times its routing weight, in fp32, without reading the weighted rows (exact: rounding is
    monotone, so the largest rounded product is the rounded largest; but where such a product overflows fp32, a
    weight above 1 on a gradient near fp32's largest value, that row counts as 0 here where the kernel keeps its
    finite products): row-wise's row scales, and current scaling's tensor amax their max; delayed scaling's scale
    comes from its grad history, which records the amaxes the kernel returns. The weighted gradient is never
    stored in high precision. Without ``layout`` (no grad_weight: the experts' weights frozen) ``placed`` is
    empty: the kernel stores the rows alone. ``reduce``: the forward's amax reduction, which delayed scaling's
    record uses."""
    weights = row_weights.reshape(-1)
    columns = grad_hp.shape[1]
    if spec.per_row or not spec.delayed:
        token_amax = finite_magnitude(grad_hp.detach()).amax(dim=1)  # (T,)
        row_amax = finite_magnitude(token_amax[token_of_row] * weights.detach().to(torch.float32))  # (S,)
    if spec.per_row:
        scale = _scale(row_amax, spec)
        grad_fp8, placed, placed_scale, dots = torch.ops.fp8graph.quantize_weighted_rows_rowwise(
            grad_hp, weights, rows_hp, scale, offsets, FP8_GEMM_DIM_MULTIPLE, spec.power_2, token_of_row, layout)
        inverse, placed_inverse = scale.reciprocal(), placed_scale.reciprocal()
    else:
        if spec.delayed:
            new_scale = _grad_scale_delayed(state, spec, grad_hp)
            scale = new_scale[0]
        else:
            scale = _scale(largest_amax(row_amax), spec)
        grad_fp8, placed, amaxes, dots = torch.ops.fp8graph.quantize_weighted_rows_placed(
            grad_hp, weights, rows_hp, scale, offsets, FP8_GEMM_DIM_MULTIPLE, token_of_row, layout)
        if spec.delayed:
            _record_grad_amaxes(state, spec, amaxes.reshape(-1), new_scale, reduce)
        inverse = scale.reciprocal().expand(grad_fp8.shape[0])
        placed_inverse = _each_group_column(inverse, offsets.shape[0], columns)
    grad_row_weights = dots.to(row_weights.dtype).reshape(row_weights.shape) if rows_hp is not None else None
    return grad_fp8, scale, inverse, placed, placed_inverse, grad_row_weights


def _cast_swiglu_backward(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor, offsets: torch.Tensor, state,
                          spec: GroupedSpec, layout: bool = True, *, reduce):
    """The gradient of ``gate_up_hp`` (S, 2I) through :func:`_swiglu`, given ``grad_h_hp`` (S, I), cast for both of
    this GEMM's backward GEMMs: ``(grad_output_fp8 (S, 2I), scale, inverse (S,), placed (2I, S'), placed_inverse
    (E, 2I))``, the rows grad_input's GEMM reads and ``placed`` laid out for grad_weight's (as
    ``placed_for_grad_weight`` lays out) with its inverse scales. One kernel computes the gradient in fp32, casts it
    and writes both layouts; a read of the same operands before it takes the amaxes the scales need. Per tensor
    (``fp8graph::swiglu_backward_placed``, one scale for both): current scaling's amax from
    ``fp8graph::swiglu_backward_amax``, delayed scaling's scale from its grad history, which records the amaxes the
    cast returns. Row-wise (``fp8graph::swiglu_backward_rowwise``, a scale a row for the rows and a scale a group
    and column for the layout): both amaxes from ``fp8graph::swiglu_backward_rowwise_amax``. The gradient is never
    stored in high precision. Without ``layout`` (no grad_weight: the experts' weights frozen) ``placed`` is
    empty: the cast stores the rows alone. ``reduce``: the forward's amax reduction, which delayed scaling's
    record uses."""
    experts = offsets.shape[0]
    if spec.per_row:
        row_amax, column_amax = torch.ops.fp8graph.swiglu_backward_rowwise_amax(gate_up_hp, grad_h_hp, offsets)
        row_scale, column_scale = _scale(row_amax, spec), _scale(column_amax, spec)  # (S,), (E + 1, 2I)
        grad_fp8, placed = torch.ops.fp8graph.swiglu_backward_rowwise(gate_up_hp, grad_h_hp, row_scale, column_scale,
                                                                      offsets, FP8_GEMM_DIM_MULTIPLE, layout)
        return grad_fp8, row_scale, row_scale.reciprocal(), placed, column_scale[:experts].reciprocal()
    if spec.delayed:
        new_scale = _grad_scale_delayed(state, spec, grad_h_hp)
        grad_fp8, placed, amaxes = torch.ops.fp8graph.swiglu_backward_placed(
            gate_up_hp, grad_h_hp, new_scale[0], offsets, FP8_GEMM_DIM_MULTIPLE, layout)
        _record_grad_amaxes(state, spec, amaxes.reshape(-1), new_scale, reduce)
        scale = new_scale[0]
    else:
        scale = _scale(torch.ops.fp8graph.swiglu_backward_amax(gate_up_hp, grad_h_hp, offsets).amax(), spec)
        grad_fp8, placed, _ = torch.ops.fp8graph.swiglu_backward_placed(gate_up_hp, grad_h_hp, scale, offsets,
                                                                         FP8_GEMM_DIM_MULTIPLE, layout)
    inverse = scale.reciprocal().expand(grad_fp8.shape[0])
    return grad_fp8, scale, inverse, placed, _each_group_column(inverse, experts, grad_fp8.shape[1])


def _cast_expert_columns(weight_hp: torch.Tensor, spec: GroupedSpec, after: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight_hp`` (E, N, K) cast along N, one scale per expert and column: ``(weight_t_fp8 (E, K, N),
    scale (E, K))``, written in the layout grad_input's GEMM reads (N contiguous). Stored (E, N, K), the weight is
    cast by ``fp8graph::quantize_expert_columns``, one kernel that reads it for the amaxes and again from L2 for the
    cast (3 bytes an element, where an amax reduction and a transposing cast read it twice from memory, 5;
    ``takes_expert_weight``). Stored (E, K, N) and fed transposed, the cast is along its rows, which Inductor fuses
    into one reduction. With ``after`` (a backward's gradient) the cast runs when that backward runs, so the
    partitioner leaves it there (``fp8graph.targets.linear_tiled._cast_in_backward``)."""
    if takes_expert_weight(weight_hp):
        if after is not None:
            weight_hp = read_in_backward(weight_hp, after)
        return torch.ops.fp8graph.quantize_expert_columns(untracked(weight_hp), spec.power_2)
    scale = _scale(finite_magnitude(untracked(weight_hp)).amax(dim=1), spec)  # (E, K)
    if after is not None:
        scale = read_in_backward(scale, after)
    weight_t_fp8 = quantize(weight_hp, scale[:, None, :], _FP8).transpose(-2, -1).contiguous()
    return weight_t_fp8, scale


def _cast_expert_columns_into(weight_hp: torch.Tensor, spec: GroupedSpec, copy_t_fp8: torch.Tensor,
                              copy_t_scale: torch.Tensor) -> None:
    """:func:`_cast_expert_columns` written into a kept copy (E, K, N) and its scales (E, K): by
    ``fp8graph::quantize_expert_columns_into_`` where that op takes the weight and the copy is laid out as it
    writes, so the cast is stored once; else cast, then copied."""
    if takes_expert_destinations(weight_hp, copy_t_fp8, copy_t_scale):
        torch.ops.fp8graph.quantize_expert_columns_into_(untracked(weight_hp), spec.power_2, copy_t_fp8,
                                                          copy_t_scale)
        return
    weight_t_fp8, scale_t = _cast_expert_columns(weight_hp, spec)
    copy_t_fp8.copy_(weight_t_fp8)
    copy_t_scale.copy_(scale_t)


def _recasts_weight(spec: GroupedSpec, routed_rows, weight_hp: torch.Tensor, needs_grad_weight: bool) -> bool:
    """Whether the backward casts a per-expert weight's copy for grad_input (E, K, N) from the weight, with the
    forward's scales (:func:`_cast_experts_transposed`), rather than the forward writing it and saving it
    (:func:`_transposed_for_grad_input`). Saved, the copy is one byte an expert weight element kept from forward
    to backward; cast again, the backward reads every expert weight once more (2 bytes an element, and 1
    written). The forward keeps it where the recipe saves its transposes, as for linears
    (``fp8graph.targets.linear_tensorwise``), and where the copy is no larger than what FP8 saves on the site's own
    input over BF16, so that the site keeps no more bytes for its backward than BF16's does
    (``fp8graph.numerics.groups.weight_copy_fits``: BF16 keeps the ``routed_rows`` S rows of K elements in 2
    bytes, FP8 grad_weight's layout of them, S + 16 E rows, in 1, and the copy its inverse scales; on average a
    little over N + 16 tokens an expert),
    or where what the expert MLP's two inputs save pays for this copy beside the others kept
    (``spec.pooled_weight_copy``: ``weight_copies_kept``).
    Where an expert sees fewer the copy would outweigh the activations (at 256 tokens an expert, Qwen3-30B-A3B's
    block at 1 x 4096 tokens, twice BF16's whole step's bytes), and where the experts' weights are frozen BF16
    keeps no input at all: there it is cast again. A symbolic S counts only where it is provably large enough
    (no guard: the graph is not specialized on it). The emulation reads any layout: the partitioner chooses."""
    if spec.lowering is not Lowering.SCALED_MM or spec.recipe.save_transposes:
        return False
    return not (needs_grad_weight and (spec.pooled_weight_copy or weight_copy_fits(
        ExpertGemm(routed_rows, *weight_hp.shape), FP8_GEMM_DIM_MULTIPLE)))  # (E, N, K)


def _cast_experts_transposed(weight_hp: torch.Tensor, scale: torch.Tensor, after: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """In the backward that computes ``after``: ``(weight_t_fp8 (E, K, N), inverse (E, K))``, the per-expert
    cast of ``weight_hp`` (E, N, K) with the forward's ``scale`` (E, 1) (the bytes the forward GEMM read), written
    in the layout grad_input's GEMM reads (N contiguous) by ``fp8graph::quantize_transposed``: one read of the
    weight, one write of the transposed bytes. The scale is read when that backward runs, so the partitioner
    leaves the cast there."""
    scale = read_in_backward(scale, after)
    weight_t_fp8 = quantize_transposed(weight_hp, scale)
    return weight_t_fp8, scale.reciprocal().expand(weight_hp.shape[0], weight_hp.shape[2])


def _transposed_for_grad_input(weight_fp8: torch.Tensor, weight_t_fp8: torch.Tensor | None,
                               weight_inverse: torch.Tensor, spec: GroupedSpec):
    """``(weight_t_fp8 (E, K, N), weight_inverse)``: the per-expert cast laid out for grad_input's GEMM (N
    contiguous) in the forward and saved, where :func:`_recasts_weight` says not to cast it again, and the inverse
    scale the forward GEMM reads, tied to it (``fp8graph.targets.partitioning``). On the native path the kernel
    that casts the weight wrote it, ``fp8graph::quantize_both_layouts`` (``weight_t_fp8``): one read of the weight
    for both layouts (and, delayed, its amaxes), where Inductor would store the second layout a row apart from
    inside the amax's reduction (``docs/cost-model.md``) or a second kernel read the FP8 bytes again to transpose
    them. The emulation reads any layout: a view of ``weight_fp8``."""
    if spec.lowering is not Lowering.SCALED_MM:
        return weight_fp8.transpose(-2, -1), weight_inverse
    return weight_t_fp8, keep_for_backward(weight_inverse, weight_t_fp8)


def _each_group_column(inverse_rows: torch.Tensor, groups: int, columns: int) -> torch.Tensor:
    """A per-tensor inverse scale held a row (S,), as each group's and column's (groups, columns), which grad_weight's
    GEMM reads. Without rows (an expert rank that got no tokens) every group is empty and grad_weight is zeros:
    ones stand in for the scale no row holds."""
    if guard_or_false(inverse_rows.shape[0] == 0):
        return inverse_rows.new_ones(groups, columns)
    return inverse_rows[:1].expand(groups, columns)


def _placed_in_the_forward(input_fp8: torch.Tensor, input_inverse: torch.Tensor, offsets: torch.Tensor,
                           spec: GroupedSpec, input_placed: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_placed, input_inverse)``: ``input_fp8`` (S, K), the forward's cast, which grad_weight reads too (a
    per-tensor scale; row-wise's cast per group and column is placed by the kernel that casts it), laid out for
    grad_weight's GEMM in the forward (``input_placed`` where the kernel that cast it wrote it, else
    ``placed_for_grad_weight``: one tiled transpose of the FP8 rows), and the inverse scale the forward GEMM
    reads, tied to it (``fp8graph.targets.partitioning``). Left to itself the partitioner saves the cast and lays
    it out in the backward: the same pass, and the cast kept alive until then. The emulation reads the cast as it
    is."""
    if input_placed is None:
        input_placed = placed_for_grad_weight(input_fp8, offsets, spec.lowering)  # (K, S') for scaled_mm
    if input_placed is input_fp8:  # read as it is: nothing to write in the forward
        return input_fp8, input_inverse
    return input_placed, keep_for_backward(input_inverse, input_placed)


def _cast_experts_through_copy(weight_hp: torch.Tensor, spec: GroupedSpec, copy: ExpertWeightCopy):
    """The weight's casts for the forward GEMM and grad_input's, through its FP8 copies
    (``fp8graph.buffers.weight_cache.copy_layout``): a ``"reuse"`` call reads the copies and their scales and
    never the weight; a ``"fill"`` call casts the weight and writes them. Per expert, one cast serves both
    GEMMs, laid out twice; row-wise casts along K for the forward and along N for grad_input. Returns
    ``(weight_fp8 (E, N, K), scale (E, N or 1), inverse (E, N), weight_t_fp8 (E, K, N), inverse_t (E, K))``,
    both copies contiguous, as the two GEMMs read them."""
    copy_fp8, copy_scale, copy_t_fp8, copy_t_scale = copy.weight_fp8, copy.scale, copy.weight_t_fp8, copy.t_scale
    experts, rows, columns = weight_hp.shape
    if copy.mode == "fill" and spec.per_row:
        weight_fp8, scale, _ = cast_experts(weight_hp, spec)
        copy_fp8.copy_(weight_fp8)
        copy_scale.copy_(scale)
        _cast_expert_columns_into(weight_hp, spec, copy_t_fp8, copy_t_scale)
    elif copy.mode == "fill":  # one read of the weight writes both layouts into the copies
        scale = _expert_scale(weight_hp, spec)
        quantize_both_layouts_into_(weight_hp, scale, False, copy_fp8, copy_t_fp8)
        copy_scale.copy_(scale)
    scale = copy_scale.clone()  # (E, N) or (E, 1)
    inverse = scale.reciprocal()
    inverse_t = (copy_t_scale.reciprocal() if spec.per_row else inverse.expand(experts, columns))  # (E, K)
    return copy_fp8, scale, inverse.expand(experts, rows), copy_t_fp8, inverse_t


class _GroupedFP8(torch.autograd.Function):
    """``output = grouped_mm(input, weight^T, offsets)`` (see the module's doc) on the sorted (S, K) input;
    the output is the GEMM's own (S, N) result, never a view."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp, offsets, spec: GroupedSpec, stats, grad_enabled: bool, state=None,
                gather_index=None, weight_copy=None, row_weights=None, permutation=None, swiglu_source=None):
        # With gather_index, input_hp is the (T, K) source and the GEMMs' rows are input_hp[gather_index] (S, K):
        # a row's cast does not depend on the other rows, so casting the T source rows and gathering FP8 bytes
        # gives the same FP8 rows (row-wise exactly; per tensor, the amax of the source, which is the rows'
        # when every source row is gathered, as top-k routing gathers each token k times).
        experts = weight_hp.shape[0]
        output_dtype = input_hp.dtype  # as torch._grouped_mm's
        needs_grad_input, needs_grad_weight = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        with autocast_off(input_hp.device.type):
            # The gathered rows cast, with grad_weight's layout (placed, below), by one kernel.
            cast_gathered = _placed_by_one_kernel(spec, gather_index, needs_grad_weight)
            # The input is SwiGLU of swiglu_source: computed and cast, with grad_weight's layout, by one kernel.
            cast_swiglu = _placed_by_one_kernel(spec, swiglu_source, needs_grad_weight)
            placed_offsets = offsets if cast_gathered or cast_swiglu else None
            input_placed = None
            # A per-expert cast's copy for grad_input: written in the forward and saved, or cast in the backward.
            per_expert_copy = needs_grad_input and not spec.per_row and weight_copy is None
            routed_rows = input_hp.shape[0] if gather_index is None else gather_index.shape[0]
            recast_weight = per_expert_copy and _recasts_weight(spec, routed_rows, weight_hp, needs_grad_weight)
            both_layouts = per_expert_copy and not recast_weight and spec.lowering is Lowering.SCALED_MM
            weight_t_fp8 = None
            ctx.amax_reduce = call_amax_reduction(spec)  # the backward's too
            if spec.delayed:
                (input_fp8, input_scale, input_inverse), (weight_fp8, weight_scale, weight_inverse), input_placed, \
                    weight_t_fp8 = cast_forward_delayed(input_hp, weight_hp, state, spec, gather_index, weight_copy,
                                                        placed_offsets, both_layouts,
                                                        swiglu_source if cast_swiglu else None, reduce=ctx.amax_reduce)
                if weight_copy is not None:  # grad_input's layout, kept with the forward's
                    weight_t_fp8 = weight_copy.weight_t_fp8
                    weight_t_inverse = weight_inverse[:, :1].expand(experts, weight_hp.shape[2])
            else:
                if cast_gathered:
                    input_scale = current_scale(input_hp, _FP8, spec.power_2)  # of the T source rows, as ever
                    input_fp8, input_placed, _ = _cast_rows_placed(input_hp, input_scale, offsets, gather_index)
                    input_inverse = input_scale.reciprocal().expand(input_fp8.shape[0])
                elif cast_swiglu:
                    # The amax by the ops SwiGLU was in the graph (Inductor fuses them into one reduction over
                    # swiglu_source), then the one kernel that computes SwiGLU again and casts it.
                    input_scale = current_scale(_swiglu(swiglu_source), _FP8, spec.power_2)
                    input_fp8, input_placed, _ = _cast_swiglu_placed(swiglu_source, input_scale, offsets)
                    input_inverse = input_scale.reciprocal().expand(input_fp8.shape[0])
                else:
                    input_fp8, input_scale, input_inverse = cast_rows(input_hp, spec)  # (S or T, K), along K
                if both_layouts:  # (E, N, K) and (E, K, N), along K
                    weight_fp8, weight_t_fp8, weight_scale, weight_inverse = _cast_experts_both_layouts(weight_hp,
                                                                                                       spec)
                elif weight_copy is None:
                    weight_fp8, weight_scale, weight_inverse = cast_experts(weight_hp, spec)  # (E, N, K), along K
                else:  # kept between calls, with grad_input's
                    weight_fp8, weight_scale, weight_inverse, weight_t_fp8, weight_t_inverse = \
                        _cast_experts_through_copy(weight_hp, spec, weight_copy)
            if per_expert_copy and not recast_weight:
                weight_t_fp8, weight_inverse = _transposed_for_grad_input(weight_fp8, weight_t_fp8, weight_inverse,
                                                                          spec)
            if stats is not None:
                # The cast as the forward GEMM reads it: where the gathered rows were cast, of those rows (each
                # token top_k times; the same scale, so the same fractions under- and overflowing), else of the
                # source rows. The gathered rows' BF16 values are read again for it: stats cost that read. Cast from
                # swiglu_source, the input's BF16 SwiGLU is read (and stored) for it, against the cast of SwiGLU in
                # fp32: stats cost that too.
                cast_hp = input_hp[gather_index] if cast_gathered else input_hp
                record_health(stats, Role.INPUT, cast_hp, input_fp8, health_scales(input_scale), spec.recipe)
                record_health(stats, Role.WEIGHT, weight_hp, weight_fp8, _per_expert_row(weight_scale), spec.recipe)
            if gather_index is not None and not cast_gathered:
                if spec.per_row:
                    # The source's cast realized first: its kernel reduces each row for the scale, and Inductor
                    # would store the scaled rows in fp32 and convert them in the gather, four bytes an element
                    # written and gathered where FP8 takes one. A per-tensor cast is pointwise: the gather casts.
                    input_fp8 = _one_buffer(input_fp8, spec)
                input_fp8, input_inverse = _gather_rows(input_fp8, gather_index), input_inverse[gather_index]
            input_fp8 = _one_buffer(input_fp8, spec)  # the forward GEMM's, and (per tensor) grad_weight's layout's
            saved_input = saved_weight = (None, None)
            if needs_grad_weight:
                # grad_weight reduces over each group's tokens: row-wise casts the input again, per group and
                # column; a per-tensor scale serves every GEMM, so the forward's cast is kept. Either way laid out
                # for grad_weight's GEMM in the forward, tied to the inverse scale the forward GEMM reads
                # (_placed_in_the_forward).
                if spec.per_row:  # of the gathered rows (S, K): one kernel casts and places them
                    input_placed, input_g_scale = group_columns_for_grad_weight(
                        input_hp, offsets, spec.lowering, spec.power_2, gather_index)
                    if spec.lowering is Lowering.SCALED_MM:
                        input_inverse = keep_for_backward(input_inverse, input_placed)
                    saved_input = (input_placed, input_g_scale.reciprocal())  # (E, K)
                else:
                    input_placed, input_inverse = _placed_in_the_forward(input_fp8, input_inverse, offsets, spec,
                                                                         input_placed)
                    saved_input = (input_placed, _each_group_column(input_inverse, experts, input_hp.shape[1]))
            weight_columns = None  # row-wise's cast along N for grad_input, where the forward writes it
            if needs_grad_input and weight_copy is None and spec.per_row and spec.recipe.save_transposes:
                # Saved and tied to the forward GEMM's scales, else the partitioner casts it again from the weight
                # in the backward (fp8graph.targets.partitioning).
                with saved_not_recomputed():
                    weight_columns = _cast_expert_columns(weight_hp, spec)  # (E, K, N), (E, K)
                weight_inverse = keep_for_backward(weight_inverse, weight_columns[0])
            # output = input . weight_e^T  (S, N); fast accumulation for the forward GEMM, as for linears.
            output = grouped_scaled_gemm(input_fp8, input_inverse, weight_fp8.transpose(-2, -1), weight_inverse,
                                         offsets, output_dtype, spec.lowering, use_fast_accum=True)
            if needs_grad_input:
                # grad_input reduces along N: row-wise casts each expert's columns; per expert, the cast is kept.
                if weight_copy is not None:
                    saved_weight = (weight_t_fp8, weight_t_inverse)  # (E, K, N), (E, K)
                elif weight_columns is not None:
                    saved_weight = (weight_columns[0], weight_columns[1].reciprocal())
                elif spec.per_row:  # cast along N in the backward, from the weight (kept anyway)
                    saved_weight = (weight_hp, None)
                elif recast_weight:  # cast in the backward, from the weight with the forward's scales
                    saved_weight = (weight_hp, weight_scale)
                else:
                    saved_weight = (weight_t_fp8, weight_inverse[:, :1].expand(experts, weight_hp.shape[2]))
        kept_output = None  # the GEMM's output, kept for SwiGLU's backward or the routing weights' gradient
        if spec.swiglu:
            # The GEMM's output is returned too, for the next expert site to compute and cast SwiGLU from it
            # (takes_swiglu_source): that site then never reads SwiGLU's value, and its ops here go unused.
            kept_output, output = output, _swiglu(output)
            ctx.mark_non_differentiable(kept_output)
        elif spec.combine_top_k:  # the output is read back only for the routing weights' gradient
            kept_output = output if ctx.needs_input_grad[9] else None
            output = _combine(output, row_weights, permutation, spec.combine_top_k)
        ctx.save_for_backward(offsets, *saved_input, *saved_weight, gather_index, kept_output, row_weights,
                              permutation)
        ctx.source_rows = input_hp.shape[0]
        ctx.recast_weight = recast_weight
        # The state's buffers are read and written in place by the backward, not saved (as the linears' are:
        # fp8graph.targets.partitioning).
        ctx.spec, ctx.stats, ctx.state = spec, stats, state
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight_hp.dtype
        return (output, kept_output) if spec.swiglu else output

    @staticmethod
    def backward(ctx, grad_output_hp, *_):  # (S, N); with SwiGLU, none for the GEMM's output, returned unread
        (offsets, input_g_placed, input_g_inverse, weight_t_fp8, weight_t_inverse, gather_index, kept_output,
         row_weights, permutation) = ctx.saved_tensors
        spec: GroupedSpec = ctx.spec
        needs_grad_input, needs_grad_weight = ctx.needs_input_grad[:2]
        grad_input = grad_weight = grad_row_weights = None
        experts = offsets.shape[0]
        with autocast_off(grad_output_hp.device.type):
            # grad_weight's layout and its inverse scales (E, N), where the kernel that casts for grad_input writes it
            grad_output_placed = grad_output_g_inverse = None
            if spec.swiglu:  # grad_output_hp is h's: the GEMM's grad_output is gate_up's, through SwiGLU
                (grad_output_fp8, grad_output_scale, grad_output_inverse, grad_output_placed,
                 grad_output_g_inverse) = _cast_swiglu_backward(kept_output, grad_output_hp, offsets, ctx.state, spec,
                                                                needs_grad_weight, reduce=ctx.amax_reduce)
                if ctx.stats is not None:  # the gradient in BF16 for its health record: stats cost its bytes
                    grad_output_hp = swiglu_backward_reference(kept_output, grad_output_hp).to(kept_output.dtype)
            elif spec.combine_top_k:  # grad_output_hp is the combine's (T, N): the GEMM's, through it
                token_of_row = permutation // spec.combine_top_k
                (grad_output_fp8, grad_output_scale, grad_output_inverse, grad_output_placed, grad_output_g_inverse,
                 grad_row_weights) = _cast_combine_backward(grad_output_hp, row_weights, kept_output, token_of_row,
                                                            offsets, ctx.state, spec, needs_grad_weight,
                                                            reduce=ctx.amax_reduce)
                if ctx.stats is not None:  # the gradient in BF16 for its health record: stats cost its bytes
                    grad_output_hp = grad_output_hp[token_of_row] * row_weights
            else:
                grad_output_fp8, grad_output_scale, grad_output_inverse = (  # along N
                    _cast_grad_output_delayed(grad_output_hp, ctx.state, spec, ctx.amax_reduce) if spec.delayed
                    else cast_rows(grad_output_hp, spec))
                grad_output_fp8 = _one_buffer(grad_output_fp8, spec)  # grad_input's GEMM's, and grad_weight's layout's
            if ctx.stats is not None:
                record_health(ctx.stats, Role.GRAD_OUTPUT, grad_output_hp, grad_output_fp8,
                              health_scales(grad_output_scale), spec.recipe)
            if needs_grad_input and weight_t_inverse is None:  # the slot holds the weight itself: cast along N now
                weight_hp = weight_t_fp8
                weight_t_fp8, weight_t_scale = _cast_expert_columns(weight_hp, spec, after=grad_output_hp)
                weight_t_inverse = weight_t_scale.reciprocal()
            elif needs_grad_input and ctx.recast_weight:  # the weight and its forward scales: cast per expert now
                weight_t_fp8, weight_t_inverse = _cast_experts_transposed(weight_t_fp8, weight_t_inverse,
                                                                          after=grad_output_hp)
            if needs_grad_input:
                # grad_input = grad_output . weight_e  (S, K): B is weight_e^T^T, (E, N, K) read column-major.
                grad_input = grouped_scaled_gemm(grad_output_fp8, grad_output_inverse, weight_t_fp8.transpose(-2, -1),
                                                 weight_t_inverse, offsets, ctx.input_dtype, spec.lowering)
                if gather_index is not None:  # the gather's backward: each source row sums its gathered rows' grads
                    # (index_put with accumulate, as autograd's own for an indexing: Inductor makes it one
                    # scatter-add kernel, where index_add is a library call)
                    grad_input = torch.index_put(grad_input.new_zeros((ctx.source_rows, grad_input.shape[1])),
                                                 (gather_index,), grad_input, accumulate=True)
            if needs_grad_weight:
                if grad_output_g_inverse is not None:  # cast and laid out by SwiGLU's or the combine's kernel
                    grad_output_g_placed = grad_output_placed
                elif spec.per_row:
                    grad_output_g_placed, grad_output_g_scale = group_columns_for_grad_weight(
                        grad_output_hp, offsets, spec.lowering, spec.power_2)
                    grad_output_g_inverse = grad_output_g_scale.reciprocal()  # (E, N)
                else:
                    grad_output_g_placed = placed_for_grad_weight(grad_output_fp8, offsets, spec.lowering)
                    grad_output_g_inverse = _each_group_column(grad_output_inverse, experts,
                                                               grad_output_fp8.shape[1])
                # grad_weight_e = grad_output_e^T . input_e  (E, N, K)
                grad_weight = grouped_scaled_gemm_weights(grad_output_g_placed, grad_output_g_inverse, input_g_placed,
                                                          input_g_inverse, offsets, ctx.weight_dtype, spec.lowering)
        return grad_input, grad_weight, None, None, None, None, None, None, None, grad_row_weights, None, None


def _one_buffer(x_fp8: torch.Tensor, spec: GroupedSpec) -> torch.Tensor:
    """On the native path, ``x_fp8`` through ``one_buffer``: the GEMM and ``fp8graph::transpose_fp8`` that both
    read it read one buffer (Inductor would otherwise store the cast once for each)."""
    return one_buffer(x_fp8) if spec.lowering is Lowering.SCALED_MM else x_fp8


def _gather_rows(x_fp8: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of an FP8 matrix, gathered as bytes (indexing is not defined for FP8 dtypes)."""
    return x_fp8.view(torch.uint8)[index].view(x_fp8.dtype)


def health_scales(scale: torch.Tensor) -> torch.Tensor:
    """A cast's scale broadcastable over its (R, C) tensor, for its health record."""
    return scale[:, None] if scale.dim() == 1 else scale


def _per_expert_row(scale: torch.Tensor) -> torch.Tensor:
    return scale[:, :, None]


@functools.cache
def grouped_fp8_target(recipe: Recipe, lowering: Lowering, update: bool = True,
                       weight_cache: str | None = None, swiglu: bool = False, combine_top_k: int = 0,
                       pooled_weight_copy: bool = False
                       ) -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """The graph target for expert sites with ``recipe`` (one of :data:`EXPERT_GRANULARITIES`), named for it:
    ``grouped_fp8(input_hp (S, K), weight_hp (E, N, K), offsets (E,), stats=None, history=None, scale=None,
    grad_history=None, grad_scale=None)``, or, for ``torch.bmm`` over every expert (Llama-4), ``input_hp``
    (E, T, K) and ``offsets=None``: E groups of T. With ``gather_index`` (S,), the rows are
    ``input_hp[gather_index]`` of a (T, K) ``input_hp``, cast before they are gathered. Delayed scaling takes
    the weight's state
    (``fp8graph.buffers.delayed_state``: 1 + E forward rows) and, with ``update=False`` (graphs without
    gradients, eval-mode modules), only reads its scales. With ``weight_cache`` (``"fill"`` or ``"reuse"``),
    ``cached_weight``, ``cached_weight_scale`` and ``cached_weight_t`` are the weight's FP8 copy, its (E, 1)
    scales and the copy of its transpose (``fp8graph.buffers.weight_cache``), written or read in place of
    casting the weight; row-wise adds ``cached_weight_t_scale`` (:class:`ExpertWeightCopy`). With ``swiglu``
    (where :func:`fuses_neighbours` says so) it returns ``silu(gate) * up`` of the output's halves (S, N / 2); with
    ``combine_top_k`` (where it says so) the experts' combine of the output (S / top_k, N),
    given ``row_weights`` (S, 1), each row's routing weight, and ``permutation`` (S,), the sort that ordered the
    rows by expert (:func:`_combine`). A call with ``swiglu`` returns ``(silu(gate) * up, output)``, the GEMM's
    output too (not differentiable); a site whose input is that SwiGLU takes the output as ``swiglu_source``
    (where :func:`takes_swiglu_source` says so) and casts SwiGLU from it, never reading its input's values. With
    ``pooled_weight_copy`` a trained call keeps its weight's copy for grad_input from the forward whatever its own
    size (:class:`GroupedSpec`: the expert MLP's two inputs pay for it)."""
    if (swiglu or combine_top_k) and not fuses_neighbours(recipe, lowering):
        raise ValueError(f"{recipe.name} on the {lowering.value} path leaves the ops next to an expert GEMM to "
                         "autograd (fuses_neighbours)")
    if swiglu and combine_top_k:
        raise ValueError("an expert GEMM's output is read by SwiGLU or by the experts' combine, not both")

    function = _GroupedFP8 if recipe.granularity in NATIVE_GROUPED_GRANULARITIES else GroupedBlocks

    def grouped_fp8(input_hp, weight_hp, offsets=None, stats=None, history=None, scale=None, grad_history=None,
                    grad_scale=None, gather_index=None, cached_weight=None, cached_weight_scale=None,
                    cached_weight_t=None, cached_weight_t_scale=None, row_weights=None, permutation=None,
                    swiglu_source=None):
        spec = GroupedSpec(recipe, lowering, update, swiglu, combine_top_k, pooled_weight_copy)
        if swiglu_source is not None and (not takes_swiglu_source(recipe, lowering) or gather_index is not None
                                          or offsets is None
                                          or swiglu_source.shape != (input_hp.shape[0], 2 * input_hp.shape[1])):
            raise ValueError(f"{grouped_fp8.__name__}: swiglu_source (S, 2 I), the output whose SwiGLU is the input "
                             "(S, I), comes to a per-tensor recipe on the native path (takes_swiglu_source), "
                             "with offsets and without a gather")
        if swiglu and offsets is None:
            raise ValueError(f"{grouped_fp8.__name__}: SwiGLU is taken into a grouped call with offsets, not a "
                             "batch of experts")
        if bool(combine_top_k) != (row_weights is not None and permutation is not None):
            raise ValueError(f"{grouped_fp8.__name__}: the combine's routing weights and permutation come with a "
                             "target made for the combine (combine_top_k), and only with it")
        state = None if history is None else (history, scale, grad_history, grad_scale)
        if recipe.stateful and state is None:
            raise ValueError(f"{recipe.name} on an expert GEMM needs the weight's delayed-scaling state")
        blocks_copy = cached_weight_scale is not None and cached_weight_scale.dim() == 3  # MXFP8's: a scale a block
        if (weight_cache is None) != (cached_weight is None) or (cached_weight is not None and (
                not recipe.caches_weights or (function is GroupedBlocks) != blocks_copy)):
            raise ValueError(f"{grouped_fp8.__name__}: the weight's FP8 copy and the cache's mode come together, on "
                             "a recipe that keeps weight copies (Recipe.caches_weights), laid out for it "
                             "(MXFP8's with its blocks' scales, fp8graph.buffers.weight_cache.copy_layout)")
        if gather_index is not None and function is GroupedBlocks:
            input_hp, gather_index = input_hp[gather_index], None  # blocks along K: the rows gathered first
        copy = () if weight_cache is None else (ExpertWeightCopy.of(
            weight_hp, weight_cache, cached_weight, cached_weight_scale, cached_weight_t, cached_weight_t_scale),)
        if offsets is not None:
            # Positional, after state: up to the last the call has, each before it in place (None where absent;
            # GroupedBlocks takes none past the copy).
            after_state = [gather_index, (copy or (None,))[0], row_weights, permutation, swiglu_source]
            while after_state and after_state[-1] is None:
                after_state.pop()
            return function.apply(input_hp, weight_hp, offsets, spec, stats, torch.is_grad_enabled(), state,
                                  *after_state)
        experts, tokens, _ = input_hp.shape
        offsets = torch.arange(1, experts + 1, device=input_hp.device, dtype=torch.int32) * tokens
        output = function.apply(input_hp.reshape(experts * tokens, input_hp.shape[2]), weight_hp, offsets, spec,
                                stats, torch.is_grad_enabled(), state, None, *copy)  # (E T, N)
        return output.reshape(experts, tokens, output.shape[1])

    label = recipe.name if update else f"{recipe.name}_frozen"
    label = f"{label}_{weight_cache}_cached_weight" if weight_cache else label
    label = f"{label}_swiglu" if swiglu else label
    label = f"{label}_combine{combine_top_k}" if combine_top_k else label
    label = f"{label}_pooled_copy" if pooled_weight_copy else label
    grouped_fp8.__name__ = target_name("grouped", label, lowering.value)
    grouped_fp8.recipe = recipe
    grouped_fp8.lowering = lowering
    grouped_fp8.weight_cache = weight_cache
    grouped_fp8.swiglu = swiglu
    grouped_fp8.combine_top_k = combine_top_k
    grouped_fp8.pooled_weight_copy = pooled_weight_copy
    return register_target(grouped_fp8, recipe, lowering, update, weight_cache, swiglu, combine_top_k,
                           pooled_weight_copy)
