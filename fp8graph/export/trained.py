"""The FP8 weights a compiled model trains with: each weight's recipe, bytes and scales, as its sites cast it.

    weights, kept = trained_weights(compiled)     # after at least one call: the traced sites decide

A weight's recipe is what the rewritten sites that read it ran (``backend.decisions``, joined to the plan's
entry of the weight): one recipe, or the weight is refused by name. Its bytes and scales are computed by the
functions the rewrite itself casts with (``fp8graph.numerics``, ``fp8graph.targets.grouped``), so they are the
bytes the forward GEMM read at the weights as they are now:

    recipe     2-D weight (N, K)                          experts' weight (E, N, K)
    current    one scale                                  one scale per expert
    delayed    the weight's stored scale (its state)      one stored scale per expert
    rowwise    one scale per output row (N, 1)            one per expert and row (E, N, 1)
    block      one per 128x128 block (N/128, K/128)       (expert sites never run block scaling)
    mxfp8      one E8M0 byte per 32 along K (N, K/32)     (E, N, K/32)

Every scale here is a dequantization factor, as checkpoints store them: ``real = fp8 x scale_inv``.
A delayed-scaling weight also carries the input's stored scale (its sites' static activation scale).
"""

from __future__ import annotations

import dataclasses

import torch

from fp8graph.numerics.formats import Role
from fp8graph.numerics.quantize import quantize, quantize_current
from fp8graph.numerics.tiles import e8m0_bytes, reference_quantize_tiles
from fp8graph.recipes.policy import weight_experts
from fp8graph.recipes.scaling import Granularity, Recipe

__all__ = ["TrainedWeight", "trained_weights"]


@dataclasses.dataclass(frozen=True)
class TrainedWeight:
    """One weight as its FP8 sites read it in the forward GEMM."""

    key: str  # its state_dict key (module path and attribute)
    module_path: str
    recipe: Recipe
    weight_fp8: torch.Tensor  # the recipe's weight dtype (E4M3 but for Format.E5M2), the weight's own shape
    # real = weight_fp8 x weight_scale_inv, over the granularity's grid (see the module's table); MXFP8: E8M0 bytes
    # (uint8), real = weight_fp8 x 2**(byte - 127).
    weight_scale_inv: torch.Tensor
    input_scale_inv: torch.Tensor | None = None  # delayed scaling: the input's stored dequantization factor

    @property
    def experts(self) -> bool:
        return weight_experts(self.weight_fp8) is not None

    @property
    def granularity(self) -> Granularity:
        return self.recipe.granularity


def _cast_matrix(weight_hp: torch.Tensor, recipe: Recipe, state_scale: torch.Tensor | None):
    """``(weight_fp8, weight_scale_inv)`` of one (N, K) matrix under ``recipe``; ``state_scale``: delayed's
    stored scale of this matrix."""
    weight_hp, fp8_dtype = weight_hp.detach(), recipe.fp8_dtype(Role.WEIGHT)
    if recipe.stateful:
        return quantize(weight_hp, state_scale, fp8_dtype), state_scale.reciprocal()
    if recipe.granularity is Granularity.TENSOR:
        weight_fp8, scale = quantize_current(weight_hp, fp8_dtype, recipe.power_2_scales)
        return weight_fp8, scale.reciprocal()
    weight_fp8, scale = reference_quantize_tiles(weight_hp, recipe.tiling(Role.WEIGHT))
    if recipe.granularity is Granularity.MX:
        return weight_fp8, e8m0_bytes(scale).view(torch.uint8)  # the E8M0 bytes the scale was built from
    return weight_fp8, scale.reciprocal()


def cast_weight(weight_hp: torch.Tensor, recipe: Recipe, state_scales: torch.Tensor | None = None):
    """``(weight_fp8, weight_scale_inv)`` of a (N, K) weight or an experts' (E, N, K) weight, cast each expert
    apart as the expert GEMMs do; ``state_scales``: delayed scaling's stored weight scales (one, or one per
    expert)."""
    if weight_hp.dim() == 2:
        return _cast_matrix(weight_hp, recipe, None if state_scales is None else state_scales.reshape(()))
    casts = [_cast_matrix(weight_hp[e], recipe, None if state_scales is None else state_scales[e].reshape(()))
             for e in range(weight_hp.shape[0])]
    return torch.stack([c[0] for c in casts]), torch.stack([c[1] for c in casts])


def _backend_of(compiled):
    backend = getattr(compiled, "fp8graph_backend", None)
    if backend is None:
        raise TypeError("fp8graph export needs the model fp8graph.compile returned, after at least one call (it "
                        "keeps what each site ran; torch.compile(..., backend='fp8') keeps no such record): got "
                        f"{type(compiled).__name__}")
    return backend


def _decisions_by_weight(backend) -> dict[str, list]:
    """``{weight key: [decision, ...]}`` of every site joined to a planned weight."""
    by_weight: dict[str, list] = {}
    for decision in backend.decisions:
        if decision.planned is not None:
            by_weight.setdefault(decision.planned.qualified_name, []).append(decision)
    return by_weight


def _delayed_scales(module: torch.nn.Module, name: str, recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input scale, weight scale(s))`` of a delayed-scaling weight: what an eval-mode call casts with, the
    scales its histories give (``fp8graph.targets.linear_tensorwise``)."""
    from fp8graph.buffers.delayed_state import HISTORY_PREFIX, SCALE_PREFIX
    from fp8graph.numerics.delayed_scaling import scale_from_history
    from fp8graph.numerics.formats import Role

    scale, history = getattr(module, SCALE_PREFIX + name, None), getattr(module, HISTORY_PREFIX + name, None)
    if scale is None or history is None:
        raise ValueError(f"{name} of {type(module).__name__} runs delayed scaling but has no state: compile the model "
                         "with fp8graph.compile (which registers it) before exporting")
    scale = scale_from_history(history.detach().float(), scale.detach().float(), recipe.fp8_dtype(Role.WEIGHT),
                               recipe.margin, recipe.amax_compute_algo)
    return scale[0], scale[1:]


def trained_weights(compiled) -> tuple[list[TrainedWeight], dict[str, str]]:
    """Every weight a rewritten site read, cast as the forward GEMM reads it, and every other planned weight
    with why it stays in high precision: ``(weights, {key: reason})``.

    Args:
        compiled: what ``fp8graph.compile`` returned, called at least once (so that its sites are decided).
    """
    backend = _backend_of(compiled)
    if backend.plan is None or not backend.decisions:
        raise ValueError("the model has not been called since it was compiled: its sites are decided when traced, "
                         "so run one step (or one forward) before exporting")
    model = getattr(compiled, "_orig_mod", compiled)
    modules = dict(model.named_modules())
    by_weight = _decisions_by_weight(backend)
    weights, kept = [], {}
    for entry in backend.plan:
        decisions = by_weight.get(entry.qualified_name, [])
        recipes = {d.recipe for d in decisions if d.rewritten}
        if not recipes:
            reasons = sorted({d.reason for d in decisions if d.reason})
            kept[entry.qualified_name] = "; ".join(reasons) or "no traced site reads it as a GEMM weight"
            continue
        if len(recipes) > 1:
            raise ValueError(f"{entry.qualified_name}: its sites ran {len(recipes)} recipes "
                             f"({', '.join(sorted(map(str, recipes)))}); a checkpoint holds one FP8 copy of a weight")
        (recipe,) = recipes
        module = modules[entry.path]
        weight_hp = getattr(module, entry.name)
        input_scale_inv, state_scales = None, None
        if recipe.stateful:
            input_scale, state_scales = _delayed_scales(module, entry.name, recipe)
            input_scale_inv = input_scale.reciprocal()
        weight_fp8, weight_scale_inv = cast_weight(weight_hp, recipe, state_scales)
        weights.append(TrainedWeight(entry.qualified_name, entry.path, recipe, weight_fp8, weight_scale_inv,
                                     input_scale_inv))
    return weights, kept

