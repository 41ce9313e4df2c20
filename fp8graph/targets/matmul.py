"""FP8 matmul of two activations (attention scores, weighted values), opted in by a policy rule.

    forward   output  = a_fp8 @ b_fp8                  (..., M, N)   (+ addend, high precision)
    backward  grad_a  = grad_output_fp8 @ b_fp8^T      (..., M, K)
              grad_b  = a_fp8^T @ grad_output_fp8      (..., K, N)

``a`` is cast with the recipe's input dtype and ``b`` with its weight dtype,
each with one per-tensor scale; grad_output with the grad_output dtype.
Batch dimensions broadcast as in ``torch.matmul``; gradients are summed back
to each operand's shape. cuBLAS FP8 GEMMs are 2-D only, so these products
are always emulated (exactly: FP8 products are exact in fp32).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from fp8graph.numerics.formats import Role
from fp8graph.targets.linear_tensorwise import autocast_dtype, autocast_off, record_health, target_name
from fp8graph.numerics.quantize import quantize_current
from fp8graph.targets.cache_hash import register_target
from fp8graph.recipes.scaling import Recipe

__all__ = ["matmul_fp8_target"]


def _fp8_matmul(a_fp8, a_scale, b_fp8, b_scale, out_dtype):
    product_fp32 = torch.matmul(a_fp8.to(torch.float32), b_fp8.to(torch.float32))
    return (product_fp32 * (a_scale * b_scale).reciprocal()).to(out_dtype)


class _MatmulFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_hp, b_hp, recipe: Recipe, stats):
        device_type = a_hp.device.type
        output_dtype = autocast_dtype(device_type) or torch.promote_types(a_hp.dtype, b_hp.dtype)
        with autocast_off(device_type):
            a_fp8, a_scale = quantize_current(a_hp, recipe.fp8_dtype(Role.INPUT), recipe.power_2_scales)
            b_fp8, b_scale = quantize_current(b_hp, recipe.fp8_dtype(Role.WEIGHT), recipe.power_2_scales)
            output = _fp8_matmul(a_fp8, a_scale, b_fp8, b_scale, output_dtype)
            if stats is not None:  # a is recorded as the input role, b as the weight role
                record_health(stats, Role.INPUT, a_hp, a_fp8, a_scale, recipe)
                record_health(stats, Role.WEIGHT, b_hp, b_fp8, b_scale, recipe)
        ctx.stats = stats
        ctx.save_for_backward(a_fp8, a_scale, b_fp8, b_scale)
        ctx.recipe = recipe
        ctx.a_shape, ctx.a_dtype = a_hp.shape, a_hp.dtype
        ctx.b_shape, ctx.b_dtype = b_hp.shape, b_hp.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output_hp):
        a_fp8, a_scale, b_fp8, b_scale = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        grad_a = grad_b = None
        with autocast_off(grad_output_hp.device.type):
            grad_output_fp8, grad_output_scale = quantize_current(
                grad_output_hp, recipe.fp8_dtype(Role.GRAD_OUTPUT), recipe.power_2_scales)
            if ctx.stats is not None:
                record_health(ctx.stats, Role.GRAD_OUTPUT, grad_output_hp,
                              grad_output_fp8, grad_output_scale, recipe)
            if ctx.needs_input_grad[0]:
                grad_a = _fp8_matmul(grad_output_fp8, grad_output_scale, b_fp8.mT, b_scale, ctx.a_dtype)
                grad_a = grad_a.sum_to_size(ctx.a_shape)
            if ctx.needs_input_grad[1]:
                grad_b = _fp8_matmul(a_fp8.mT, a_scale, grad_output_fp8, grad_output_scale, ctx.b_dtype)
                grad_b = grad_b.sum_to_size(ctx.b_shape)
        return grad_a, grad_b, None, None


@functools.cache
def matmul_fp8_target(recipe: Recipe) -> Callable[..., torch.Tensor]:
    """The graph target for activation matmuls with ``recipe``, named for it."""

    def matmul_fp8(a_hp, b_hp, addend_hp=None, stats=None):
        output = _MatmulFP8.apply(a_hp, b_hp, recipe, stats)
        # addmm / baddbmm: the added term joins in high precision.
        return output if addend_hp is None else addend_hp + output

    matmul_fp8.__name__ = target_name("matmul", recipe.name, "emulated")
    matmul_fp8.recipe = recipe
    return register_target(matmul_fp8, recipe)
