"""MXFP8 expert GEMMs: blocks of 32 along each GEMM's reduction dimension, E8M0 scales (``fp8graph.targets.grouped``).

    forward   output        = input . weight_e^T     blocks along K
    backward  grad_input    = grad_output . weight_e blocks along N
              grad_weight_e = grad_output_e^T . input_e   blocks of 32 tokens, each expert's group zero-padded
                                                          to a multiple of 32 so that no block spans two experts

Emulated exactly (``fp8graph::grouped_mm_exact`` on the dequantized operands: FP8 values times powers of two
are exact in fp32); ``torch._scaled_grouped_mm``'s MXFP8 form (SM 10.x) is not called yet.
"""

from __future__ import annotations

import torch

from fp8graph.gemm.grouped_gemm import grouped_mm_exact
from fp8graph.numerics.formats import Role
from fp8graph.numerics.groups import padded_group_rows
from fp8graph.numerics.tiles import Tiling, expand_scale, reference_dequantize_tiles, reference_quantize_tiles
from fp8graph.targets.linear_tensorwise import record_health

__all__ = ["GroupedBlocks"]


class GroupedBlocks(torch.autograd.Function):
    """MXFP8 expert GEMMs: every operand in blocks of 32 along its GEMM's reduction dimension, E8M0 scales.

    The scales vary along the reduction, so the emulation multiplies the dequantized operands (exact in fp32:
    FP8 values times powers of two). The weight gradient reduces over each group's tokens: the groups are
    zero-padded to multiples of 32 tokens first, so that no block spans two experts.
    """

    @staticmethod
    def forward(ctx, input_hp, weight_hp, offsets, spec, stats, grad_enabled: bool, state=None):
        tiling = spec.recipe.tiling(Role.INPUT)
        experts, rows, columns = weight_hp.shape
        needs_grad_input, needs_grad_weight = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        with torch.autocast(input_hp.device.type, enabled=False):
            input_dq = _blocks(input_hp, tiling, stats, Role.INPUT, spec.recipe)  # (S, K) along K
            weight_dq = _blocks(weight_hp.reshape(experts * rows, columns), tiling, stats, Role.WEIGHT,
                                spec.recipe).reshape(experts, rows, columns)  # (E, N, K) along K
            # output = input . weight_e^T  (S, N)
            output = grouped_mm_exact(input_dq, weight_dq.transpose(-2, -1), offsets).to(input_hp.dtype)
            weight_t_dq = padding = input_t_dq = None
            if needs_grad_input:  # along N
                weight_t_dq = _blocks(weight_hp.transpose(-2, -1).reshape(experts * columns, rows),
                                      tiling).reshape(experts, columns, rows)  # (E, K, N)
            if needs_grad_weight:  # along each group's tokens
                padding = padded_group_rows(offsets, input_hp.shape[0], tiling.cols)
                input_t_dq = _blocks(_padded(input_hp, padding).t(), tiling)  # (K, S')
        ctx.save_for_backward(offsets, weight_t_dq, input_t_dq, *(padding[:2] if padding else (None, None)))
        ctx.spec, ctx.stats, ctx.padded_rows = spec, stats, padding[2] if padding else None
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight_hp.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output_hp):  # (S, N)
        offsets, weight_t_dq, input_t_dq, destination, padded_offsets = ctx.saved_tensors
        tiling = ctx.spec.recipe.tiling(Role.GRAD_OUTPUT)
        needs_grad_input, needs_grad_weight = ctx.needs_input_grad[:2]
        grad_input = grad_weight = None
        with torch.autocast(grad_output_hp.device.type, enabled=False):
            if needs_grad_input:
                grad_output_dq = _blocks(grad_output_hp, tiling, ctx.stats, Role.GRAD_OUTPUT, ctx.spec.recipe)
                # grad_input = grad_output . weight_e  (S, K)
                grad_input = grouped_mm_exact(grad_output_dq, weight_t_dq.transpose(-2, -1),
                                              offsets).to(ctx.input_dtype)
            if needs_grad_weight:
                padding = (destination, padded_offsets, ctx.padded_rows)
                grad_output_t_dq = _blocks(_padded(grad_output_hp, padding).t(), tiling)  # (N, S')
                # grad_weight_e = grad_output_e^T . input_e  (E, N, K)
                grad_weight = grouped_mm_exact(grad_output_t_dq, input_t_dq.t(), padded_offsets).to(ctx.weight_dtype)
        return grad_input, grad_weight, None, None, None, None, None


def _blocks(x_hp: torch.Tensor, tiling: Tiling, stats=None, role: Role | None = None, recipe=None) -> torch.Tensor:
    """``x_hp`` (R, C) quantized in ``tiling``'s blocks along C and dequantized (fp32, exact): what the FP8
    GEMM multiplies. With ``stats``, the cast's health goes into row ``role``."""
    x_fp8, scale = reference_quantize_tiles(x_hp, tiling)
    if stats is not None:
        record_health(stats, role, x_hp, x_fp8, expand_scale(scale, tiling, x_fp8.shape), recipe)
    return reference_dequantize_tiles(x_fp8, scale, tiling)


def _padded(x_hp: torch.Tensor, padding) -> torch.Tensor:
    """``x_hp`` (S, C) with its rows moved into groups zero-padded to whole blocks (``padded_group_rows``)."""
    destination, _, padded_rows = padding
    return x_hp.new_zeros((padded_rows, x_hp.shape[1])).index_copy(0, destination, x_hp)
