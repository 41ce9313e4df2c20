"""The FP8 linear for recipes with one scale per row, tile or block (row-wise, block, MXFP8).

Each GEMM quantizes both operands along its own reduction dimension::

    forward   output      = input (M, K)       . weight (N, K)         tiles along K
    backward  grad_input  = grad_output (M, N) . weight_t (K, N)       tiles along N
              grad_weight = grad_output_t (N, M) . input_t (K, M)      tiles along M

A tile's scale covers elements of one GEMM's reduction dimension only, so an
operand quantized for one GEMM cannot serve another transposed (its scales
would run across the other GEMM's reduction). Each operand is therefore
quantized both ways from high precision: ``input`` and ``input_t``,
``weight`` and ``weight_t`` in the forward (the transposes saved in FP8 for
the backward), ``grad_output`` and ``grad_output_t`` in the backward. On CUDA
the 1x128 and 128x128 tilings run fp8graph's kernel, which writes both
layouts from one read; the others run Inductor's code, fused with the
operand's producer (``fp8graph.kernels.quantize_tiles`` says which and why).
A weight with square tiles (block scaling's 128x128) has the same tiles
transposed, so both layouts share one quantization.

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

import functools
from typing import Callable

import torch

from fp8graph.fsdp.gathered_weight import GatheredFP8Weight, is_gathered
from fp8graph.numerics.formats import Role
from fp8graph.kernels.quantize_tiles import kernel_quantizes
from fp8graph.targets.linear_tensorwise import autocast_dtype, record_health, target_name
from fp8graph.gemm.scaled_gemm import Lowering, one_buffer, tiled_scaled_gemm
from fp8graph.recipes.scaling import TiledRecipe
from fp8graph.targets.cache_hash import register_target
from fp8graph.numerics.tiles import Tiling, e8m0_to_scale, expand_scale, reference_quantize_tiles

__all__ = ["linear_tiled_target", "record_tiled_health"]


class _TiledOperand:
    """An FP8 operand laid out (rows, reduction), with its scales and tiling."""

    def __init__(self, fp8: torch.Tensor, scale: torch.Tensor, tiling: Tiling):
        self.fp8, self.scale, self.tiling = fp8, scale, tiling

    def transposed(self) -> "_TiledOperand":
        """The same quantization read the other way round (square tiles only)."""
        return _TiledOperand(self.fp8.t(), self.scale.t(), self.tiling)


def _quantize(x_hp: torch.Tensor, tiling: Tiling, along_rows: bool, along_columns: bool,
              use_kernel: bool | None = None) -> tuple[_TiledOperand | None, _TiledOperand | None]:
    """``x_hp`` (R, C) quantized along its rows (C reduced) and, transposed, along its columns (R reduced).

    On CUDA, tilings that fp8graph's kernel quantizes faster than Inductor's
    code (``fp8graph.kernels.quantize_tiles.kernel_quantizes``) run it, both
    layouts from one read. Elsewhere the plain-torch ``reference_quantize_tiles``, which
    Inductor fuses with the producer of ``x_hp``; square tiles then reuse the
    row-major quantization transposed (bit for bit what a requantization gives).
    ``use_kernel`` overrides the choice (tests run the ops' CPU reference so).
    """
    if use_kernel is None:
        use_kernel = x_hp.device.type == "cuda" and kernel_quantizes(tiling)
    if use_kernel:
        tile_args = (tiling.rows, tiling.cols, tiling.scale_kind.value)
        if along_rows and along_columns:
            x_fp8, scale, x_t_fp8, scale_t = torch.ops.fp8graph.quantize_tiles_and_transpose(x_hp, *tile_args)
            return _TiledOperand(x_fp8, scale, tiling), _TiledOperand(x_t_fp8, scale_t, tiling)
        x_q = _TiledOperand(*torch.ops.fp8graph.quantize_tiles(x_hp, *tile_args), tiling) if along_rows else None
        x_t_q = (_TiledOperand(*torch.ops.fp8graph.quantize_tiles(x_hp.t(), *tile_args), tiling)
                 if along_columns else None)
        return x_q, x_t_q
    x_q = _inductor_quantized(x_hp, tiling) if along_rows else None
    x_t_q = None
    if along_columns:
        x_t_q = (x_q.transposed() if tiling.is_square and x_q is not None
                 else _inductor_quantized(x_hp.t(), tiling))
    return x_q, x_t_q


def _inductor_quantized(x_hp: torch.Tensor, tiling: Tiling) -> _TiledOperand:
    """``reference_quantize_tiles`` of ``x_hp``, its FP8 values one buffer however many GEMMs read them (q, k and v
    quantize their shared input identically: one node once the graph's duplicates merge)."""
    x_fp8, scale = reference_quantize_tiles(x_hp, tiling)
    return _TiledOperand(one_buffer(x_fp8) if x_hp.device.type == "cuda" else x_fp8, scale, tiling)


def _gathered_operands(weight: GatheredFP8Weight, recipe: TiledRecipe, needs_grad_input: bool):
    """``(weight_q (N, K), weight_t_q (K, N) or None, row_scale)`` of a weight FSDP2 gathered in FP8
    (``fp8graph.fsdp.shard_casts``); ``row_scale`` (N,): row-wise's scales, which grad_input moves to
    grad_output (see the module's doc), else None."""
    weight.require_form_of(recipe)
    tiling = recipe.tiling(Role.WEIGHT)
    if weight.form == "tiles":
        if not tiling.is_square:
            raise AssertionError("only square weight tiles are all-gathered in tiles (fp8graph.fsdp.install)")
        weight_q = _TiledOperand(weight.fp8_data, weight.scale, tiling)
        return weight_q, weight_q.transposed() if needs_grad_input else None, None
    if weight.form == "rows":
        weight_q = _TiledOperand(weight.fp8_data, weight.scale.reshape(-1, 1), tiling)
        if not needs_grad_input:
            return weight_q, None, None
        unscaled = torch.ones((weight.shape[1], 1), dtype=torch.float32, device=weight.fp8_data.device)
        return weight_q, _TiledOperand(weight.fp8_data.t(), unscaled, tiling), weight.scale
    # MXFP8: both layouts gathered, grad_input's blocked along N.
    weight_q = _TiledOperand(weight.fp8_data, e8m0_to_scale(weight.scale), tiling)
    weight_t_q = (_TiledOperand(weight.fp8_t_data.t(), e8m0_to_scale(weight.scale_t).t(), tiling)
                  if needs_grad_input else None)
    return weight_q, weight_t_q, None


def _gemm(a: _TiledOperand, b: _TiledOperand, out_dtype, lowering, use_fast_accum=False) -> torch.Tensor:
    return tiled_scaled_gemm(a.fp8, a.scale, a.tiling, b.fp8, b.scale, b.tiling, out_dtype, lowering,
                             use_fast_accum)


class _LinearTiled(torch.autograd.Function):
    """``output = input @ weight^T + bias`` on the (M, K) input: the output is the GEMM's own (M, N) result,
    never a view, which user code may write into in place (see ``linear_tensorwise._LinearsFP8``)."""

    @staticmethod
    def forward(ctx, input_hp_2d, weight_hp, bias_hp, recipe: TiledRecipe, lowering: Lowering, stats,
                grad_enabled: bool):
        device_type = input_hp_2d.device.type
        output_dtype = autocast_dtype(device_type) or input_hp_2d.dtype
        input_tiling, weight_tiling = recipe.tiling(Role.INPUT), recipe.tiling(Role.WEIGHT)
        # The gradient GEMMs' operands, quantized along M (input_t) and N (weight_t), are made
        # only where a gradient needs them: none under torch.no_grad(), which needs_input_grad
        # does not see (the caller passes the grad mode).
        needs_grad_input, needs_grad_weight = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        with torch.autocast(device_type, enabled=False):
            input_q, input_t_q = _quantize(input_hp_2d, input_tiling, True, needs_grad_weight)  # (M, K), (K, M')
            weight_row_scale = None
            if is_gathered(weight_hp):  # FSDP2 gathered it cast (fp8graph.fsdp.shard_casts)
                weight_q, weight_t_q, weight_row_scale = _gathered_operands(weight_hp, recipe, needs_grad_input)
            else:
                weight_q, weight_t_q = _quantize(weight_hp, weight_tiling, True, needs_grad_input)  # (N, K), (K, N)
            # Fast accumulation for the forward GEMM, as for per-tensor scaling.
            output = _gemm(input_q, weight_q, output_dtype, lowering, use_fast_accum=True)
            if bias_hp is not None:
                output = output + bias_hp.to(output_dtype)
            if stats is not None:
                if is_gathered(weight_hp):
                    raise AssertionError("stats=True gathers weights in high precision (fp8graph.fsdp.install)")
                record_tiled_health(stats, Role.INPUT, input_hp_2d, input_q, recipe)
                record_tiled_health(stats, Role.WEIGHT, weight_hp, weight_q, recipe)
        ctx.save_for_backward(*_saved(input_t_q), *_saved(weight_t_q), weight_row_scale)
        ctx.recipe, ctx.lowering, ctx.stats = recipe, lowering, stats
        ctx.input_dtype, ctx.weight_dtype = input_hp_2d.dtype, weight_hp.dtype
        ctx.bias_dtype = None if bias_hp is None else bias_hp.dtype
        return output  # (M, N)

    @staticmethod
    def backward(ctx, grad_output_hp_2d):  # (M, N)
        input_t_fp8, input_t_scale, weight_t_fp8, weight_t_scale, weight_row_scale = ctx.saved_tensors
        recipe: TiledRecipe = ctx.recipe
        needs_grad_input, needs_grad_weight, needs_grad_bias = ctx.needs_input_grad[:3]
        grad_input = grad_weight = grad_bias = None
        grad_tiling = recipe.tiling(Role.GRAD_OUTPUT)
        with torch.autocast(grad_output_hp_2d.device.type, enabled=False):
            if weight_row_scale is not None and needs_grad_input:
                # A row-wise weight gathered in FP8: its row scales move to grad_output (see the module's doc).
                grad_output_q, _ = _quantize(grad_output_hp_2d.float() / weight_row_scale, grad_tiling, True, False)
                _, grad_output_t_q = _quantize(grad_output_hp_2d, grad_tiling, False, needs_grad_weight)
            else:
                # Along N for grad_input, along M (transposed) for grad_weight; one read where both are needed.
                grad_output_q, grad_output_t_q = _quantize(
                    grad_output_hp_2d, grad_tiling, needs_grad_input or ctx.stats is not None, needs_grad_weight)
            if ctx.stats is not None:
                record_tiled_health(ctx.stats, Role.GRAD_OUTPUT, grad_output_hp_2d, grad_output_q, recipe)
            if needs_grad_input:
                weight_t_q = _TiledOperand(weight_t_fp8, weight_t_scale, recipe.tiling(Role.WEIGHT))  # (K, N)
                grad_input = _gemm(grad_output_q, weight_t_q, ctx.input_dtype, ctx.lowering)  # (M, K)
            if needs_grad_weight:
                input_t_q = _TiledOperand(input_t_fp8, input_t_scale, recipe.tiling(Role.INPUT))  # (K, M')
                if grad_output_t_q.fp8.shape[1] != input_t_fp8.shape[1]:
                    raise AssertionError("grad_output and input padded to different token counts")
                grad_weight = _gemm(grad_output_t_q, input_t_q, ctx.weight_dtype, ctx.lowering)
            if needs_grad_bias and ctx.bias_dtype is not None:
                grad_bias = grad_output_hp_2d.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _saved(x_q: _TiledOperand | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if x_q is None else (x_q.fp8, x_q.scale)


def record_tiled_health(stats: torch.Tensor, role: Role, x_hp: torch.Tensor, x_q: _TiledOperand,
                        recipe: TiledRecipe) -> None:
    """Row ``role`` of the module's stats buffer for a tiled cast (padding left out): its
    health with each element's own tile scale; the scale recorded is the smallest."""
    columns = x_hp.shape[1]
    scale = expand_scale(x_q.scale, x_q.tiling, x_q.fp8.shape)[:, :columns]
    record_health(stats, role, x_hp, x_q.fp8[:, :columns], scale, recipe)


@functools.cache
def linear_tiled_target(recipe: TiledRecipe, lowering: Lowering) -> Callable[..., torch.Tensor]:
    """The graph target for sites with a row-wise, block or MX ``recipe``, named for it."""

    def linear_tiled(input_hp, weight_hp, bias_hp=None, stats=None):
        input_hp_2d = input_hp.reshape(-1, input_hp.shape[-1])  # (M, K)
        output = _LinearTiled.apply(input_hp_2d, weight_hp, bias_hp, recipe, lowering, stats, torch.is_grad_enabled())
        return output.reshape(*input_hp.shape[:-1], output.shape[-1])

    linear_tiled.__name__ = target_name("linear", recipe.name, lowering.value)
    linear_tiled.recipe = recipe
    linear_tiled.lowering = lowering
    linear_tiled.reads_gathered_weights = True  # FSDP2's FP8-gathered weights (fp8graph.fsdp.graph_check)
    return register_target(linear_tiled, recipe, lowering)
