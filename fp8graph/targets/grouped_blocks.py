"""MXFP8 expert GEMMs: blocks of 32 along each GEMM's reduction dimension, E8M0 scales (``fp8graph.targets.grouped``).

    forward   output        = input . weight_e^T     blocks along K
    backward  grad_input    = grad_output . weight_e blocks along N
              grad_weight_e = grad_output_e^T . input_e   blocks of 32 tokens, each expert's group zero-padded
                                                          to a multiple of 32 so that no block spans two experts

Native on SM 10.x (``fp8graph.gemm.grouped_mx``: ``torch._scaled_grouped_mm``'s MXFP8 form); elsewhere
emulated exactly (``fp8graph::grouped_mm_exact`` on the dequantized operands: FP8 values times powers of two
are exact in fp32).
"""

from __future__ import annotations

import torch

from fp8graph.gemm.grouped_gemm import grouped_mm_exact
from fp8graph.gemm.grouped_mx import grouped_mx_gemm, grouped_mx_gemm_weights
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.gemm.tiled_operands import expert_blocks
from fp8graph.numerics.formats import Role
from fp8graph.numerics.groups import place_in_padded_groups
from fp8graph.numerics.tiles import Tiling, expand_scale, reference_dequantize_tiles, reference_quantize_tiles
from fp8graph.targets.linear_tensorwise import autocast_off, record_health

__all__ = ["GroupedBlocks"]


class GroupedBlocks(torch.autograd.Function):
    """MXFP8 expert GEMMs: every operand in blocks of 32 along its GEMM's reduction dimension, E8M0 scales.

    The weight gradient reduces over each group's tokens: the groups are zero-padded to multiples of 32
    tokens first, so that no block spans two experts.
    """

    @staticmethod
    def forward(ctx, input_hp, weight_hp, offsets, spec, stats, grad_enabled: bool, state=None, gather_index=None,
                weight_copy=None):
        if gather_index is not None:
            raise AssertionError("MXFP8's expert GEMMs take the gathered rows (blocks along K)")
        tiling = spec.recipe.tiling(Role.INPUT)
        needs_grad_input, needs_grad_weight = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        with autocast_off(input_hp.device.type):
            input_q = _blocks(input_hp, tiling, stats, Role.INPUT, spec.recipe)  # (S, K) along K
            weight_q, weight_t_q = _weight_casts(weight_hp, tiling, stats, spec.recipe, needs_grad_input, weight_copy)
            # output = input . weight_e^T  (S, N)
            output = _gemm_rows(input_q, weight_q, offsets, input_hp.dtype, tiling, spec.lowering)
            padded_offsets = input_t_q = None
            if needs_grad_weight:  # along each group's tokens
                input_padded, padded_offsets = place_in_padded_groups(input_hp, offsets, tiling.cols)  # (S', K)
                input_t_q = _blocks(input_padded.t(), tiling)  # (K, S')
        ctx.save_for_backward(offsets, *weight_t_q, *(input_t_q or (None, None)),
                              padded_offsets)
        ctx.spec, ctx.stats = spec, stats
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight_hp.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output_hp):  # (S, N)
        offsets, weight_t_fp8, weight_t_scale, input_t_fp8, input_t_scale, padded_offsets = ctx.saved_tensors
        spec = ctx.spec
        tiling = spec.recipe.tiling(Role.GRAD_OUTPUT)
        needs_grad_input, needs_grad_weight = ctx.needs_input_grad[:2]
        grad_input = grad_weight = None
        with autocast_off(grad_output_hp.device.type):
            if needs_grad_input:
                grad_output_q = _blocks(grad_output_hp, tiling, ctx.stats, Role.GRAD_OUTPUT, spec.recipe)
                # grad_input = grad_output . weight_e  (S, K)
                grad_input = _gemm_rows(grad_output_q, (weight_t_fp8, weight_t_scale), offsets, ctx.input_dtype,
                                        tiling, spec.lowering)
            if needs_grad_weight:
                grad_output_padded, _ = place_in_padded_groups(grad_output_hp, offsets, tiling.cols)  # (S', N)
                grad_output_t_q = _blocks(grad_output_padded.t(), tiling)  # (N, S')
                # grad_weight_e = grad_output_e^T . input_e  (E, N, K)
                grad_weight = _gemm_weights(grad_output_t_q, (input_t_fp8, input_t_scale), padded_offsets,
                                            ctx.weight_dtype, tiling, spec.lowering)
        return grad_input, grad_weight, None, None, None, None, None, None, None


def _weight_casts(weight_hp: torch.Tensor, tiling: Tiling, stats, recipe, needs_grad_input: bool, weight_copy):
    """``(weight_q, weight_t_q)``: the experts' weight (E, N, K) in blocks along K for the forward, and along N,
    laid out (E, K, N), for grad_input (``(None, None)`` where no grad_input is taken). Through ``weight_copy``
    (``fp8graph.targets.grouped.ExpertWeightCopy``) a ``"fill"`` call casts both and writes them into the
    copies, a ``"reuse"`` call reads the copies and never the weight."""
    if weight_copy is not None and weight_copy.mode == "reuse":
        weight_q, weight_t_q = (weight_copy.weight_fp8, weight_copy.scale), (weight_copy.weight_t_fp8,
                                                                             weight_copy.t_scale)
    else:
        weight_q = expert_blocks(weight_hp, tiling)  # (E, N, K) along K
        weight_t_q = (expert_blocks(weight_hp.transpose(-2, -1), tiling)  # (E, K, N) along N
                      if needs_grad_input or weight_copy is not None else (None, None))
        if weight_copy is not None:  # "fill": kept for the calls until the weight changes
            for copy, cast in zip((weight_copy.weight_fp8, weight_copy.scale, weight_copy.weight_t_fp8,
                                   weight_copy.t_scale), (*weight_q, *weight_t_q)):
                copy.copy_(cast)
    if stats is not None:  # the forward's cast, as the experts' stacked rows
        x_fp8, scale = (x.flatten(0, 1) for x in weight_q)
        record_health(stats, Role.WEIGHT, weight_hp.flatten(0, 1), x_fp8, expand_scale(scale, tiling, x_fp8.shape),
                      recipe)
    return weight_q, weight_t_q


def _blocks(x_hp: torch.Tensor, tiling: Tiling, stats=None, role: Role | None = None, recipe=None):
    """``x_hp`` (R, C) quantized in ``tiling``'s blocks along C: ``(x_fp8, scale (R, C / 32))``. With ``stats``,
    the cast's health goes into row ``role``."""
    x_fp8, scale = reference_quantize_tiles(x_hp, tiling)
    if stats is not None:
        record_health(stats, role, x_hp, x_fp8, expand_scale(scale, tiling, x_fp8.shape), recipe)
    return x_fp8, scale


def _dequantized(quantized, tiling: Tiling) -> torch.Tensor:
    """What the FP8 GEMM multiplies, in fp32 (exact: FP8 values times powers of two)."""
    x_fp8, scale = quantized
    if x_fp8.dim() == 3:
        experts = x_fp8.shape[0]
        return reference_dequantize_tiles(x_fp8.flatten(0, 1), scale.flatten(0, 1), tiling).reshape(
            experts, -1, x_fp8.shape[2])
    return reference_dequantize_tiles(x_fp8, scale, tiling)


def _gemm_rows(a_q, b_q, offsets, out_dtype, tiling: Tiling, lowering: Lowering) -> torch.Tensor:
    """``a`` (S, R) by each expert's ``b`` (E, C, R) transposed, rows grouped by ``offsets``: (S, C)."""
    if lowering is Lowering.SCALED_MM:
        return grouped_mx_gemm(*a_q, *b_q, offsets, out_dtype)
    return grouped_mm_exact(_dequantized(a_q, tiling), _dequantized(b_q, tiling).transpose(-2, -1),
                            offsets).to(out_dtype)


def _gemm_weights(a_q, b_q, offsets, out_dtype, tiling: Tiling, lowering: Lowering) -> torch.Tensor:
    """``a`` (N, S') by ``b`` (K, S') transposed, reduced over each group of tokens: (E, N, K)."""
    if lowering is Lowering.SCALED_MM:
        return grouped_mx_gemm_weights(*a_q, *b_q, offsets, out_dtype)
    return grouped_mm_exact(_dequantized(a_q, tiling), _dequantized(b_q, tiling).t(), offsets).to(out_dtype)

