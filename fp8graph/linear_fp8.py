"""The FP8 linear: three scaled GEMMs with high-precision inputs and outputs.

A rewritten site calls ``linear_fp8(input_hp, weight_hp, bias_hp)`` with
``weight_hp`` of shape (N, K), exactly like ``F.linear``::

    forward   output      = input_fp8 @ weight_fp8_t          (M, N)  + bias in high precision
    backward  grad_input  = grad_output_fp8 @ weight_fp8      (M, K)
              grad_weight = grad_output_fp8_t @ input_fp8     (N, K)
              grad_bias   = grad_output.sum(0)                 high precision

The quantization is plain torch ops inside an ``autograd.Function``.
AOTAutograd traces through both ``forward`` and ``backward``, so Inductor sees
the amax, scale and cast as ordinary ops and fuses them with their neighbours;
only the GEMM is an opaque call. With per-tensor scales the FP8 copies saved
for backward are reused transposed: transposing a tensor-wise quantized tensor
is exact.

Layouts. cuBLAS's FP8 GEMMs on Hopper read A row-major and B column-major,
so each operand is needed in both layouts: the input by the forward GEMM and,
transposed, by grad_weight's; grad_output by grad_input's and, transposed, by
grad_weight's; the weight by the forward and, transposed, by grad_input's.

- Current scaling: the transposed copy is written by Inductor's code from the
  high-precision tensor in the same kernel as the row-major cast, after the
  amax reduction (H100: 55-57% of a copy for amax and both layouts, as fast as
  any split that was measured).
- Delayed scaling (``lowering`` scaled_mm): the row-major cast records its amax
  in the same pass and fuses into the tensor's producer; the transposed copy
  is ``fp8graph::transpose_fp8`` of the FP8 bytes. Left to Inductor it is
  recomputed from the high-precision tensor inside the amax's kernel, which
  the GPU ran at 29-61% of a copy instead of 80-83%
  (``bench/results/2026-11-23-h100/quantize-structure-probe.txt``).
- Weights: the forward casts them; the backward casts the transposed copy again
  from the parameter, with the forward's scale, rather than keeping FP8 weights
  saved from forward to backward (1 byte a parameter, 7 GB at 8B parameters,
  which would lift peak memory above BF16's). With ``cache_weights``
  (current scaling) the weight's row-major FP8 copy is kept across calls while
  the weight does not change.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .cache_hash import register_target
from .delayed_scaling import delayed_cast
from .distributed import amax_reduction
from .formats import ROLES, Role
from .health import quantization_health
from .kernels.transpose_fp8 import transpose_fp8
from .lowering import Lowering, scaled_gemm
from .quantize import quantize_current
from .recipes import Recipe
from .recompute import state_snapshot

__all__ = ["RoleCaster", "autocast_dtype", "linear_fp8_target", "record_health", "target_name"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast gives matmuls on ``device_type``, or ``None`` outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class RoleCaster:
    """Casts a site's tensors per role: current scaling, or delayed scaling with its state.

    ``state`` is ``(history, scale)``, the site's buffers of shape (3, len)
    and (3,). With ``update`` each delayed cast first moves the state one step
    (new scale from the history, history rolled) and records its amax, all
    written into the buffers in place; without it the stored scale is used.
    With ``snapshot`` (sites in a ``torch.utils.checkpoint`` region, see
    ``fp8graph.recompute``) forward casts read the state through a saved copy.
    """

    def __init__(self, recipe: Recipe, state=None, update: bool = True, snapshot: bool = False,
                 weight_cache=None):
        self.recipe, self.state, self.update, self.snapshot = recipe, state, update, snapshot
        self.weight_cache = weight_cache

    def transposes_fp8(self, lowering: Lowering) -> bool:
        """Whether the transposed layouts of input and grad_output are read from their FP8 copies
        (``fp8graph::transpose_fp8``): delayed casts for cuBLAS, which reads both layouts (see the module's doc)."""
        return self.state is not None and lowering is Lowering.SCALED_MM

    def __call__(self, role: Role, x_hp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fp8_dtype = self.recipe.fp8_dtype(role)
        if role is Role.WEIGHT and self.weight_cache is not None:
            return self._cached_weight(x_hp, fp8_dtype)
        if self.state is None:
            return quantize_current(x_hp, fp8_dtype, self.recipe.power_2_scales)
        history, scale = self.state
        index = ROLES.index(role)
        # Backward casts read the live buffers: an earlier backward of the same
        # step (a module called twice) may have recorded into them.
        history_read, scale_read = (
            (state_snapshot(history), state_snapshot(scale)) if self.snapshot and role is not Role.GRAD_OUTPUT
            else (history, scale))
        x_fp8, scale_used, new_history = delayed_cast(
            x_hp, history_read[index], scale_read[index], fp8_dtype,
            self.recipe.margin, self.recipe.amax_compute_algo, self.update,
            reduce_amax=amax_reduction(self.recipe.reduce_amax))
        if self.update:
            history[index].copy_(new_history)
            scale[index].copy_(scale_used)
        return x_fp8, scale_used.clone()  # never the buffer itself: it changes next step

    def _cached_weight(self, weight_hp: torch.Tensor, fp8_dtype: torch.dtype):
        """The weight's FP8 copy: read from the cache, or quantized and written into it (``fp8graph.weight_cache``)."""
        mode, cached_weight, cached_scale = self.weight_cache
        if mode == "reuse":
            return cached_weight, cached_scale.clone()
        weight_fp8, weight_scale = quantize_current(weight_hp, fp8_dtype, self.recipe.power_2_scales)
        cached_weight.copy_(weight_fp8)
        cached_scale.copy_(weight_scale)
        return weight_fp8, weight_scale


class _LinearFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_hp, weight_hp, bias_hp, caster: RoleCaster, lowering: Lowering, stats):
        recipe = caster.recipe
        device_type = input_hp.device.type
        # Under autocast F.linear returns the autocast dtype; so does this.
        output_dtype = autocast_dtype(device_type) or input_hp.dtype
        in_features = weight_hp.shape[1]
        lead_shape = input_hp.shape[:-1]
        with torch.autocast(device_type, enabled=False):
            input_hp_2d = input_hp.reshape(-1, in_features)  # (M, K)
            input_fp8, input_scale = caster(Role.INPUT, input_hp_2d)
            weight_fp8, weight_scale = caster(Role.WEIGHT, weight_hp)
            # output = input @ weight_t  (M, N); fast accumulation is accurate
            # enough for the forward GEMM, as Transformer Engine does.
            output = scaled_gemm(
                input_fp8, input_scale, weight_fp8.t(), weight_scale,
                output_dtype, lowering, use_fast_accum=True,
            )
            if bias_hp is not None:
                output = output + bias_hp.to(output_dtype)
            if stats is not None:
                record_health(stats, Role.INPUT, input_hp_2d, input_fp8, input_scale, recipe)
                record_health(stats, Role.WEIGHT, weight_hp, weight_fp8, weight_scale, recipe)
        ctx.stats = stats
        if caster.transposes_fp8(lowering) and ctx.needs_input_grad[1]:
            # grad_weight's GEMM reads the input column-major: keep that copy, not the row-major one.
            input_fp8 = transpose_fp8(input_fp8).t()
        ctx.save_for_backward(input_fp8, input_scale, weight_fp8, weight_scale)
        ctx.caster = caster
        ctx.lowering = lowering
        ctx.input_dtype = input_hp.dtype
        ctx.weight_dtype = weight_hp.dtype
        ctx.bias_dtype = None if bias_hp is None else bias_hp.dtype
        ctx.lead_shape = lead_shape
        return output.reshape(*lead_shape, weight_hp.shape[0])

    @staticmethod
    def backward(ctx, grad_output_hp):
        input_fp8, input_scale, weight_fp8, weight_scale = ctx.saved_tensors
        recipe: Recipe = ctx.caster.recipe
        out_features, in_features = weight_fp8.shape
        needs_grad_input, needs_grad_weight, needs_grad_bias = ctx.needs_input_grad[:3]
        grad_input = grad_weight = grad_bias = None
        with torch.autocast(grad_output_hp.device.type, enabled=False):
            grad_output_hp_2d = grad_output_hp.reshape(-1, out_features)  # (M, N)
            grad_output_fp8, grad_output_scale = ctx.caster(Role.GRAD_OUTPUT, grad_output_hp_2d)
            if ctx.stats is not None:
                record_health(ctx.stats, Role.GRAD_OUTPUT, grad_output_hp_2d,
                              grad_output_fp8, grad_output_scale, recipe)
            if needs_grad_input:
                # grad_input = grad_output @ weight  (M, K); split accumulation.
                grad_input = scaled_gemm(
                    grad_output_fp8, grad_output_scale, weight_fp8, weight_scale,
                    ctx.input_dtype, ctx.lowering,
                ).reshape(*ctx.lead_shape, in_features)
            if needs_grad_weight:
                # grad_weight = grad_output_t @ input  (N, K)
                grad_output_fp8_t = (transpose_fp8(grad_output_fp8) if ctx.caster.transposes_fp8(ctx.lowering)
                                     else grad_output_fp8.t())
                grad_weight = scaled_gemm(
                    grad_output_fp8_t, grad_output_scale, input_fp8, input_scale,
                    ctx.weight_dtype, ctx.lowering,
                )
            if needs_grad_bias and ctx.bias_dtype is not None:
                grad_bias = grad_output_hp_2d.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None


def record_health(stats: torch.Tensor, role: Role, x_hp, x_fp8, scale, recipe: Recipe) -> None:
    """Write the health of one cast into row ``role`` of the module's stats buffer, in place."""
    health = quantization_health(x_hp, x_fp8, scale, recipe.fp8_dtype(role))
    stats[ROLES.index(role)].copy_(health)


def target_name(kind: str, recipe_name: str, lowering_name: str) -> str:
    """A graph target's name: ``fp8graph_<kind>_<recipe>_<lowering>`` as an identifier."""
    label = "".join(ch if ch.isalnum() else "_" for ch in f"{recipe_name}_{lowering_name}")
    while "__" in label:
        label = label.replace("__", "_")
    return f"fp8graph_{kind}_{label.strip('_')}"


@functools.cache
def linear_fp8_target(recipe: Recipe, lowering: Lowering, update: bool = True,
                      in_checkpoint: bool = False, weight_cache: str | None = None) -> Callable[..., torch.Tensor]:
    """The graph target for sites with ``recipe`` lowered by ``lowering``.

    FX graphs can only hold primitive constants as arguments, so the recipe
    and lowering are bound into a function with a readable name, which the
    rewritten graph's code then shows (``fp8graph_linear_current_HYBRID_emulated``).
    Delayed-scaling sites also take their ``history`` and ``scale`` buffers;
    ``update=False`` (graphs compiled without gradients) only reads them.
    ``in_checkpoint`` marks sites inside a ``torch.utils.checkpoint`` region,
    whose forward casts read the state through a saved snapshot.
    ``weight_cache`` (``"fill"`` or ``"reuse"``) makes the site take the
    buffers of its weight's FP8 copy and write or read them (``fp8graph.weight_cache``).
    """

    def linear_fp8(input_hp, weight_hp, bias_hp=None, stats=None, history=None, scale=None,
                   cached_weight=None, cached_weight_scale=None):
        state = None if history is None else (history, scale)
        cache = None if weight_cache is None else (weight_cache, cached_weight, cached_weight_scale)
        caster = RoleCaster(recipe, state, update, snapshot=in_checkpoint and state is not None, weight_cache=cache)
        return _LinearFP8.apply(input_hp, weight_hp, bias_hp, caster, lowering, stats)

    label = recipe.name if update else f"{recipe.name}_frozen"
    label = f"{label}_checkpointed" if in_checkpoint else label
    label = f"{label}_{weight_cache}_cached_weight" if weight_cache else label
    linear_fp8.__name__ = target_name("linear", label, lowering.value)
    linear_fp8.recipe = recipe
    linear_fp8.lowering = lowering
    return register_target(linear_fp8, recipe, lowering, update, in_checkpoint, weight_cache)
