"""The weights' FP8 copies, kept across calls while the weights do not change (``cache_weights=True``).

Gradient accumulation runs several forwards on the same weights, inference
many: quantizing every weight (an amax pass and a cast pass over it) at each
call redoes work. ``fp8graph.compile(model, cache_weights=True)`` gives every
weight that a per-tensor recipe (``Float8CurrentScaling``) casts two
non-persistent buffers on the module that owns it::

    fp8graph_cached_weight_<name>         the weight's FP8 copy, (N, K), in the recipe's weight dtype
    fp8graph_cached_weight_scale_<name>   its scale, ()

The copy is laid out (N, K) as the FP8 linear reads its weight, whichever way
the module stores it: a GPT-2 ``Conv1D`` weight, stored (K, N), gets the copy
of its transpose. A weight whose module does not say which way round it is
multiplied (``fp8graph.recipes.policy.weight_orientations``) gets a copy in its
own shape, which the linear reads transposed when it multiplies the weight as (K, N).
An expert weight (3-D, ``fp8graph.targets.grouped``) gets one E4M3 copy (the
expert GEMMs' dtype) in its own shape and layout, (E, N, K) or (E, K, N), a
second of its transpose, and one scale an expert, (E, 1)::

    fp8graph_cached_weight_t_<name>       the copy of its transpose, (E, K, N) or (E, N, K), contiguous

The forward GEMM reads the one laid out (E, N, K), grad_input's the one laid out
(E, K, N): each in the layout ``torch._scaled_grouped_mm`` takes, so no call
copies an FP8 weight to transpose it. Two bytes per element, the size of the
BF16 weight.

Before each call of the compiled model, :meth:`WeightCache.before_call`
compares the weights' version counters with those of the call that last
filled the copies. Every in-place change bumps a tensor's counter: an
optimizer step, ``load_state_dict``, ``torch.no_grad(): w.mul_(2)``. If a
weight changed (or nothing was filled yet) the call fills: its graphs
quantize the weights as usual and also write the copies. Otherwise it
reuses: its graphs read the copies and skip the weights' quantization. The
forward hooks that bring the buffers into the graph branch on the mode, so
Dynamo guards on it and compiles one graph of each kind: a
gradient-accumulation loop runs the fill graph on the first micro-batch
after each optimizer step and the reuse graph on the others.

A new tensor behind a parameter (``param.data = ...``, ``model.to(device or
dtype)``) is seen by its storage, dtype and device. Not seen: a write through
``param.data`` (``param.data.copy_(...)``: ``.data`` has a version counter of
its own) or from outside PyTorch into the storage; call
:meth:`WeightCache.invalidate` after one. Weights the
root module owns itself are not cached: Dynamo runs the root's hooks
outside the graph (see ``fp8graph.buffers.delayed_state``). Other recipes quantize their
weights at every call.
"""

from __future__ import annotations

import torch

from fp8graph.numerics.formats import Role
from fp8graph.buffers.anchors import AnchorHook, NewBuffer, register_new_buffers
from fp8graph.recipes.plan import Plan
from fp8graph.recipes.policy import Policy, weight_experts, weight_orientations
from fp8graph.recipes.scaling import expert_recipe
from fp8graph.buffers.delayed_state import weight_candidates

__all__ = ["CACHED_WEIGHT_PREFIX", "CACHED_SCALE_PREFIX", "CACHED_TRANSPOSE_PREFIX", "WeightCache",
           "register_weight_cache"]

CACHED_WEIGHT_PREFIX = "fp8graph_cached_weight_"
CACHED_SCALE_PREFIX = "fp8graph_cached_weight_scale_"
CACHED_TRANSPOSE_PREFIX = "fp8graph_cached_weight_t_"  # an expert weight's second copy, of its transpose


class WeightCache:
    """Which weights have an FP8 copy, where, and whether the next call may reuse them."""

    def __init__(self) -> None:
        # (holder, parameter name, owner, owner's parameter name): a tied weight appears under each holder.
        self._holders: list[tuple[torch.nn.Module, str, torch.nn.Module, str]] = []
        self.reuse = False
        self._filled_versions: tuple | None = None
        self._versions_at_call: tuple | None = None

    def add(self, holder: torch.nn.Module, name: str, owner: torch.nn.Module, owner_name: str) -> None:
        self._holders.append((holder, name, owner, owner_name))

    def __len__(self) -> int:
        return sum(holder is owner for holder, _, owner, _ in self._holders)

    def by_weight(self) -> dict[int, tuple[torch.Tensor, ...]]:
        """``{id(weight): (fp8 copy, scale)}`` for the tensors the holding modules hold now, ``(fp8 copy, scale,
        fp8 copy of the transpose)`` for an expert weight."""
        return {id(holder._parameters[name]): tuple(getattr(owner, prefix + owner_name)
                                                    for prefix in copy_prefixes(holder._parameters[name]))
                for holder, name, owner, owner_name in self._holders if holder._parameters.get(name) is not None}

    def _versions(self) -> tuple:
        """What identifies each weight's values: the tensor, its version counter (every in-place change), and
        its storage, dtype and device (``param.data = ...`` and ``model.to(...)`` swap them without a bump)."""
        weights = [owner._parameters[name] for holder, name, owner, _ in self._holders if holder is owner]
        return tuple((id(weight), weight._version, _storage_address(weight), weight.dtype, weight.device)
                     for weight in weights)

    def before_call(self) -> None:
        """Choose the mode of the coming call: reuse only if no cached weight changed since the last fill."""
        self._versions_at_call = self._versions()
        self.reuse = self._filled_versions is not None and self._filled_versions == self._versions_at_call

    def after_call(self) -> None:
        """A call that filled the copies finished: they now hold the weights as they were when it began."""
        if not self.reuse:
            self._filled_versions = self._versions_at_call

    def invalidate(self) -> None:
        """Make the next call fill, e.g. after changing weights through ``param.data``."""
        self._filled_versions = None



class _CachedWeightsHook(AnchorHook):
    """Anchors the FP8 copies as filled by this call, or as read by it (the cache's mode)."""

    def __init__(self, cache: WeightCache, owners_and_names: list[tuple[torch.nn.Module, str]]) -> None:
        super().__init__("fill", [(owner, tuple(prefix + name for prefix in copy_prefixes(owner._parameters[name])))
                                  for owner, name in owners_and_names])
        self.cache = cache

    def anchor_kind(self, module: torch.nn.Module) -> str:
        return "reuse" if self.cache.reuse else "fill"  # a branch Dynamo guards on: the two graphs differ


_REGISTERED_ATTRIBUTE = "_fp8graph_weight_cache"


def _storage_address(weight: torch.Tensor) -> int | None:
    try:
        return weight.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor) has no storage of its own
        return None


def copy_prefixes(param: torch.Tensor) -> tuple[str, ...]:
    """The buffers of a weight's copies, in the order the FP8 sites take them."""
    if weight_experts(param) is not None:
        return CACHED_WEIGHT_PREFIX, CACHED_SCALE_PREFIX, CACHED_TRANSPOSE_PREFIX
    return CACHED_WEIGHT_PREFIX, CACHED_SCALE_PREFIX


def _copy_shape(module: torch.nn.Module, param: torch.Tensor) -> tuple[int, ...]:
    """The FP8 copy's shape: (N, K), or the weight's own where its module leaves the orientation open (every
    expert weight: (E, N, K) or (E, K, N), as the experts store it)."""
    orientations = weight_orientations(module, param)
    return (*param.shape[:-2], *orientations[0]) if len(orientations) == 1 else tuple(param.shape)


def _copy_dtype(param: torch.Tensor, recipe) -> torch.dtype:
    """The copy's FP8 dtype: the recipe's for the weight; an expert weight's, as the expert GEMM runs it."""
    return (expert_recipe(recipe) if weight_experts(param) is not None else recipe).fp8_dtype(Role.WEIGHT)


def _scale_shape(param: torch.Tensor) -> tuple[int, ...]:
    """One scale for a matrix, one an expert for a 3-D expert weight (as ``targets.grouped`` casts it)."""
    experts = weight_experts(param)
    return () if experts is None else (experts, 1)


def _reuse_registered_cache(model: torch.nn.Module, plan: Plan, cache: WeightCache) -> WeightCache:
    """The copies an earlier ``fp8graph.compile(cache_weights=True)`` registered (or a copy of that model
    brought), if they serve ``policy``: the same weights, in the FP8 dtypes it asks for. Invalidated: a
    copied model's weights are new tensors, whose ids and versions say nothing of the copies' contents."""
    copies = cache.by_weight()
    for path, module in model.named_modules():
        if module is model:
            continue
        for name, param in weight_candidates(module):
            recipe = plan[param].cached
            wanted = None if recipe is None else _copy_dtype(param, recipe)
            there = copies[id(param)][0].dtype if id(param) in copies else None
            if wanted != there:
                raise ValueError(
                    f"{path}.{name}: the model was compiled before with cache_weights=True, and its FP8 weight "
                    f"copies cannot serve this policy (it asks for {wanted or 'no copy'}; there is "
                    f"{there or 'none'}). Compile it with the first policy again, or build a fresh model")
    cache.invalidate()
    return cache


def register_weight_cache(model: torch.nn.Module, policy: Policy, plan: Plan | None = None) -> WeightCache:
    """Register FP8 copies for the weights of submodules that the policy gives per-tensor current scaling.

    A model that holds them already (compiled before with ``cache_weights=True``, or a copy of one) keeps
    them when they serve ``policy`` (:func:`_reuse_registered_cache`), and refills them at its next call.
    ``plan``: the model's plan under ``policy`` (made here when ``None``).
    """
    plan = plan if plan is not None else Plan(model, policy)
    earlier = model.__dict__.get(_REGISTERED_ATTRIBUTE)
    if earlier is not None:
        return _reuse_registered_cache(model, plan, earlier)
    cache = WeightCache()
    new_buffers: list[NewBuffer] = []
    owner_of: dict[int, tuple[torch.nn.Module, str]] = {}
    anchored: dict[torch.nn.Module, list[tuple[torch.nn.Module, str]]] = {}
    for path, module in model.named_modules():
        if module is model:
            continue
        for name, param in weight_candidates(module):
            if id(param) in owner_of:  # a tied weight: one copy, kept by the first module
                owner, owner_name = owner_of[id(param)]
                cache.add(module, name, owner, owner_name)
                anchored.setdefault(module, []).append((owner, owner_name))
                continue
            recipe = plan[param].cached
            if recipe is None:
                continue
            copy_shape = _copy_shape(module, param)  # (N, K): a Conv1D's (K, N) weight is copied transposed
            initials = {CACHED_WEIGHT_PREFIX: torch.zeros(copy_shape, dtype=_copy_dtype(param, recipe),
                                                          device=param.device),
                        CACHED_SCALE_PREFIX: torch.ones(_scale_shape(param), device=param.device)}
            if weight_experts(param) is not None:
                initials[CACHED_TRANSPOSE_PREFIX] = initials[CACHED_WEIGHT_PREFIX].transpose(-2, -1).contiguous()
            for prefix in copy_prefixes(param):
                new_buffers.append(NewBuffer(module, path, prefix + name, initials[prefix], persistent=False))
            owner_of[id(param)] = (module, name)
            cache.add(module, name, module, name)
            anchored.setdefault(module, []).append((module, name))
    register_new_buffers(new_buffers, if_taken="a buffer of that name that is not fp8graph's: rename it, or build a "
                                               "fresh model")
    for module, owners_and_names in anchored.items():
        module.register_forward_hook(_CachedWeightsHook(cache, owners_and_names))
    model.__dict__[_REGISTERED_ATTRIBUTE] = cache
    return cache
