"""The FP8 linear for recipes with one scale per row, tile or block (row-wise, block, MXFP8).

Each GEMM quantizes both operands along its own reduction dimension::

    forward   output      = input (M, K)       . weight (N, K)         tiles along K
    backward  grad_input  = grad_output (M, N) . weight_t (K, N)       tiles along N
              grad_weight = grad_output_t (N, M) . input_t (K, M)      tiles along M

A tile's scale covers elements of one GEMM's reduction dimension only, so an
operand quantized for one GEMM cannot serve another transposed (its scales
would run across the other GEMM's reduction). The transposed operands are
therefore quantized from high precision: ``input_t`` and ``weight_t`` in the
forward, next to the forward casts (Inductor reads the input once for both)
and saved in FP8; ``grad_output`` both ways in the backward. The exception is
a weight with square tiles (block scaling's 128x128): transposed, its tiles
are the same tiles, so its quantization is reused, bit for bit what a
requantization would give. Only the weight-gradient output and the bias stay
in high precision.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .formats import Role
from .kernels.quantize_tiles import triton_available
from .linear_fp8 import autocast_dtype, record_health, target_name
from .lowering import Lowering, tiled_scaled_gemm
from .recipes import TiledRecipe
from .cache_hash import register_target
from .tiles import Tiling, expand_scale, quantize_tiled

__all__ = ["linear_tiled_target", "record_tiled_health"]


class _TiledOperand:
    """An FP8 operand laid out (rows, reduction), with its scales and tiling."""

    def __init__(self, x_hp: torch.Tensor, tiling: Tiling):
        self.tiling = tiling
        if x_hp.device.type == "cuda" and triton_available():
            # One read of each tile (see fp8graph.kernels.quantize_tiles); elsewhere
            # the plain-torch version, which Inductor fuses with its producer.
            self.fp8, self.scale = torch.ops.fp8graph.quantize_tiles(
                x_hp, tiling.rows, tiling.cols or 0, tiling.scale_kind.value)
        else:
            self.fp8, self.scale = quantize_tiled(x_hp, tiling)

    @classmethod
    def of(cls, fp8: torch.Tensor, scale: torch.Tensor, tiling: Tiling) -> "_TiledOperand":
        operand = cls.__new__(cls)
        operand.fp8, operand.scale, operand.tiling = fp8, scale, tiling
        return operand

    def transposed(self) -> "_TiledOperand":
        """The same quantization read the other way round (square tiles only)."""
        return _TiledOperand.of(self.fp8.t(), self.scale.t(), self.tiling)


def _gemm(a: _TiledOperand, b: _TiledOperand, out_dtype, lowering, use_fast_accum=False) -> torch.Tensor:
    return tiled_scaled_gemm(a.fp8, a.scale, a.tiling, b.fp8, b.scale, b.tiling, out_dtype, lowering,
                             use_fast_accum)


class _LinearTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_hp, weight_hp, bias_hp, recipe: TiledRecipe, lowering: Lowering, stats):
        device_type = input_hp.device.type
        output_dtype = autocast_dtype(device_type) or input_hp.dtype
        out_features, in_features = weight_hp.shape
        lead_shape = input_hp.shape[:-1]
        input_tiling, weight_tiling = recipe.tiling(Role.INPUT), recipe.tiling(Role.WEIGHT)
        with torch.autocast(device_type, enabled=False):
            input_hp_2d = input_hp.reshape(-1, in_features)  # (M, K)
            input_q = _TiledOperand(input_hp_2d, input_tiling)
            weight_q = _TiledOperand(weight_hp, weight_tiling)
            # Fast accumulation for the forward GEMM, as for per-tensor scaling.
            output = _gemm(input_q, weight_q, output_dtype, lowering, use_fast_accum=True)
            if bias_hp is not None:
                output = output + bias_hp.to(output_dtype)
            if stats is not None:
                record_tiled_health(stats, Role.INPUT, input_hp_2d, input_q, recipe)
                record_tiled_health(stats, Role.WEIGHT, weight_hp, weight_q, recipe)
            # Operands of the gradient GEMMs, quantized along M and N from high precision.
            input_t_q = _TiledOperand(input_hp_2d.t(), input_tiling)  # (K, M)
            weight_t_q = (weight_q.transposed() if recipe.weight_tiles_are_square
                          else _TiledOperand(weight_hp.t(), weight_tiling))  # (K, N)
        ctx.save_for_backward(input_t_q.fp8, input_t_q.scale, weight_t_q.fp8, weight_t_q.scale)
        ctx.recipe, ctx.lowering, ctx.stats = recipe, lowering, stats
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight_hp.dtype
        ctx.bias_dtype = None if bias_hp is None else bias_hp.dtype
        ctx.lead_shape = lead_shape
        return output.reshape(*lead_shape, out_features)

    @staticmethod
    def backward(ctx, grad_output_hp):
        input_t_fp8, input_t_scale, weight_t_fp8, weight_t_scale = ctx.saved_tensors
        recipe: TiledRecipe = ctx.recipe
        input_t_q = _TiledOperand.of(input_t_fp8, input_t_scale, recipe.tiling(Role.INPUT))
        weight_t_q = _TiledOperand.of(weight_t_fp8, weight_t_scale, recipe.tiling(Role.WEIGHT))
        in_features, out_features = weight_t_fp8.shape
        tokens = input_t_fp8.shape[1]  # M padded to the tile width
        needs_grad_input, needs_grad_weight, needs_grad_bias = ctx.needs_input_grad[:3]
        grad_input = grad_weight = grad_bias = None
        grad_tiling = recipe.tiling(Role.GRAD_OUTPUT)
        with torch.autocast(grad_output_hp.device.type, enabled=False):
            grad_output_hp_2d = grad_output_hp.reshape(-1, out_features)  # (M, N)
            if needs_grad_input or ctx.stats is not None:
                grad_output_q = _TiledOperand(grad_output_hp_2d, grad_tiling)  # along N
                if ctx.stats is not None:
                    record_tiled_health(ctx.stats, Role.GRAD_OUTPUT, grad_output_hp_2d, grad_output_q,
                                        recipe)
            if needs_grad_input:
                grad_input = _gemm(grad_output_q, weight_t_q, ctx.input_dtype, ctx.lowering)
                grad_input = grad_input.reshape(*ctx.lead_shape, in_features)
            if needs_grad_weight:
                grad_output_t_q = _TiledOperand(grad_output_hp_2d.t(), grad_tiling)  # (N, M') along M
                if grad_output_t_q.fp8.shape[1] != tokens:
                    raise AssertionError("grad_output and input padded to different token counts")
                grad_weight = _gemm(grad_output_t_q, input_t_q, ctx.weight_dtype, ctx.lowering)
            if needs_grad_bias and ctx.bias_dtype is not None:
                grad_bias = grad_output_hp_2d.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None


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
        return _LinearTiled.apply(input_hp, weight_hp, bias_hp, recipe, lowering, stats)

    linear_tiled.__name__ = target_name("linear", recipe.name, lowering.value)
    linear_tiled.recipe = recipe
    linear_tiled.lowering = lowering
    return register_target(linear_tiled, recipe, lowering)
