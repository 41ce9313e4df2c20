"""The FP8 expert GEMM of a mixture-of-experts decode step: weights picked per token, read in FP8.

transformers' ``batched_mm`` experts (what ``generate()`` decodes with on a GPU) multiply each selected
(token, expert) pair as ``torch.bmm(W[expert_ids], x.unsqueeze(-1))``, or, for (E, K, N) weights,
``torch.bmm(x.unsqueeze(1), W[expert_ids])``. A rewritten site calls
``gathered_fp8(input_hp, weight_hp (E, N, K), expert_ids)`` with the bmm's own input operand and returns
the bmm's shape. The casts are the expert recipe's, as the grouped target (``targets.grouped``) makes
them for the forward GEMM:

    recipe     input rows           weight_e
    rowwise    per row              per output row (N)
    current    per tensor           per expert
    delayed    per tensor, stored   per expert, stored (the scales only: a decode graph has no gradients)

and ``fp8graph::gathered_gemv`` multiplies each row by its expert's FP8 weight where it lies. The site is
rewritten only in graphs whose weights Inductor freezes (``passes.expert_sites``): the weight's amax and
cast are then folded into an FP8 constant, and a decode step reads 1 byte per weight element of the
selected experts, where the BF16 graph copies each selected weight (2 bytes written, read twice).
Inference only: there is no backward.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.kernels.gathered_gemv import reference_gathered_gemv
from fp8graph.numerics.formats import Role
from fp8graph.recipes.scaling import Granularity, Recipe
from fp8graph.targets.cache_hash import register_target
from fp8graph.targets.grouped import GroupedSpec, cast_experts, cast_forward_delayed, cast_rows, health_scales
from fp8graph.targets.linear_tensorwise import autocast_off, record_health, target_name

__all__ = ["GATHERED_GRANULARITIES", "gathered_fp8_target"]

# What a scale of the recipes the decode form runs covers (its kernel takes scales per tensor or per row: not
# blocks).
GATHERED_GRANULARITIES = frozenset({Granularity.TENSOR, Granularity.ROW})


@functools.cache
def gathered_fp8_target(recipe: Recipe, lowering: Lowering) -> Callable[..., torch.Tensor]:
    """The graph target for decode-form expert sites with ``recipe`` (one of :data:`GATHERED_GRANULARITIES`):
    ``gathered_fp8(input_hp (S, K, 1) or (S, 1, K), weight_hp (E, N, K), expert_ids (S,), stats=None,
    history=None, scale=None, grad_history=None, grad_scale=None)`` -> (S, N, 1) or (S, 1, N)."""

    def gathered_fp8(input_hp, weight_hp, expert_ids, stats=None, history=None, scale=None, grad_history=None,
                     grad_scale=None):
        if torch.is_grad_enabled() and (input_hp.requires_grad or weight_hp.requires_grad):
            raise RuntimeError("fp8graph: the FP8 decode form of expert GEMMs has no backward (it runs on frozen "
                               "weights, under torch.no_grad())")
        spec = GroupedSpec(recipe, lowering, update=False)
        rows, weight_first = input_hp.shape[0], input_hp.shape[2] == 1  # (S, K, 1), or (S, 1, K)
        input_2d = input_hp.reshape(rows, weight_hp.shape[2])
        with autocast_off(input_hp.device.type):
            if spec.delayed:
                if history is None:
                    raise ValueError(f"{recipe.name} on an expert GEMM needs the weight's delayed-scaling state")
                (input_fp8, input_scale, input_inverse), (weight_fp8, weight_scale, weight_inverse), _, _ = \
                    cast_forward_delayed(input_2d, weight_hp, (history, scale, grad_history, grad_scale), spec,
                                         reduce=None)  # records nothing (update=False)
            else:
                input_fp8, input_scale, input_inverse = cast_rows(input_2d, spec)  # along K
                weight_fp8, weight_scale, weight_inverse = cast_experts(weight_hp, spec)  # (E, N, K), along K
            if stats is not None:
                record_health(stats, Role.INPUT, input_2d, input_fp8, health_scales(input_scale), spec.recipe)
                record_health(stats, Role.WEIGHT, weight_hp, weight_fp8, weight_scale[:, :, None], spec.recipe)
            # K contiguous, as the kernel walks it: a (E, K, N) parameter's FP8 copy is made (E, N, K) once,
            # folded with the cast.
            weight_fp8 = weight_fp8.contiguous()
            arguments = (input_fp8, input_inverse, weight_fp8, weight_inverse, expert_ids, input_hp.dtype)
            output = (torch.ops.fp8graph.gathered_gemv(*arguments) if lowering is Lowering.SCALED_MM
                      else reference_gathered_gemv(*arguments))  # (S, N)
        return output[:, :, None] if weight_first else output[:, None, :]

    gathered_fp8.__name__ = target_name("gathered", recipe.name, lowering.value)
    gathered_fp8.recipe = recipe
    gathered_fp8.lowering = lowering
    return register_target(gathered_fp8, recipe, lowering)
