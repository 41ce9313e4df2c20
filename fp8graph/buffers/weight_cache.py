"""The weights' FP8 copies, kept across calls while the weights do not change (``cache_weights``, on by default).

Gradient accumulation runs several forwards on the same weights, inference
many: quantizing every weight (an amax pass and a cast pass over it) at each
call redoes work. ``fp8graph.compile`` (``cache_weights="auto"``, or ``True``)
gives every weight whose recipe casts it from the weight alone non-persistent
buffers on the module that owns it, holding what the weight's sites' GEMMs read
(:func:`copy_layout` says what, per recipe and kind of weight; which weights get
them is the plan's ``WeightEntry.cached``)::

    fp8graph_cached_weight_<name>          the forward GEMM's FP8 operand
    fp8graph_cached_weight_scale_<name>    its scales
    fp8graph_cached_weight_t_<name>        grad_input's, where it is a second copy (experts, row-wise, MXFP8)
    fp8graph_cached_weight_t_scale_<name>  its scales, where they are not the first's (row-wise, MXFP8)
    fp8graph_cached_weight_amax_<name>     the weight's amax (delayed scaling: what a reusing call records)

A matrix's copy is laid out (N, K) as the FP8 linear reads its weight, whichever
way the module stores it: a GPT-2 ``Conv1D`` weight, stored (K, N), gets the
copy of its transpose. A weight whose module does not say which way round it is
multiplied (``fp8graph.recipes.policy.weight_orientations``) gets copies in its
own shape, which the site reads transposed, or swapped, when it multiplies the
weight as (K, N). An expert weight (3-D, ``fp8graph.targets.grouped``) gets E4M3
copies (the expert GEMMs' dtype) in its own shape and of its transpose: the
forward GEMM reads the one laid out (E, N, K), grad_input's the one laid out
(E, K, N), each in the layout ``torch._scaled_grouped_mm`` takes, so no call
copies an FP8 weight to transpose it.

Before each call of the compiled model, :meth:`WeightCache.before_call`
compares the weights' version counters with those of the call that last
filled the copies. Every in-place change bumps a tensor's counter: an
optimizer step, ``load_state_dict``, ``torch.no_grad(): w.mul_(2)``; a fused
optimizer's step does not, and every ``torch.optim.Optimizer``'s step marks
the copies of its weights for refilling through torch's global step hook. If a
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
:meth:`WeightCache.invalidate` after one. Weights the root module owns itself
are not cached: Dynamo runs the root's hooks outside the graph (see
``fp8graph.buffers.delayed_state``). Under DDP the copies are left out of its
buffer broadcasts (:func:`_kept_from_ddp_broadcasts`).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fp8graph.numerics.formats import Role
from fp8graph.buffers.anchors import AnchorHook, NewBuffer, register_new_buffers
from fp8graph.gemm.tiled_operands import cached_weight_operands, expert_blocks
from fp8graph.kernels.quantize_tiles import kernel_quantizes
from fp8graph.recipes.plan import Plan
from fp8graph.recipes.policy import Policy, weight_experts, weight_orientations
from fp8graph.recipes.scaling import NATIVE_GROUPED_GRANULARITIES, Recipe, expert_recipe
from fp8graph.buffers.delayed_state import weight_candidates

__all__ = ["CACHED_AMAX_PREFIX", "CACHED_WEIGHT_PREFIX", "CACHED_SCALE_PREFIX", "CACHED_TRANSPOSE_PREFIX",
           "CACHED_TRANSPOSE_SCALE_PREFIX", "COPY_KEYWORDS", "COPY_PREFIXES", "CopiesCannotServe", "WeightCache",
           "copy_layout", "optimizer_steps", "register_weight_cache", "watch_optimizer_steps"]

CACHED_WEIGHT_PREFIX = "fp8graph_cached_weight_"
CACHED_SCALE_PREFIX = "fp8graph_cached_weight_scale_"
CACHED_TRANSPOSE_PREFIX = "fp8graph_cached_weight_t_"  # the copy grad_input reads, where it is a second one
CACHED_TRANSPOSE_SCALE_PREFIX = "fp8graph_cached_weight_t_scale_"  # its scales, where they are not the first's
CACHED_AMAX_PREFIX = "fp8graph_cached_weight_amax_"  # delayed scaling: the amax the fill recorded
# The buffers of a weight's copies, in the order copy_layout lists them; a layout keeps some of them.
COPY_PREFIXES = (CACHED_WEIGHT_PREFIX, CACHED_SCALE_PREFIX, CACHED_TRANSPOSE_PREFIX, CACHED_TRANSPOSE_SCALE_PREFIX,
                 CACHED_AMAX_PREFIX)
# The keyword each buffer is passed to the sites' targets under.
COPY_KEYWORDS = dict(zip(COPY_PREFIXES, ("cached_weight", "cached_weight_scale", "cached_weight_t",
                                         "cached_weight_t_scale", "cached_weight_amax")))


class CopiesCannotServe(ValueError):
    """An earlier compile's FP8 copies on this model are not those the new compile's policy asks for."""


class WeightCache:
    """Which weights have an FP8 copy, where, and whether the next call may reuse them."""

    def __init__(self) -> None:
        # (holder, parameter name, owner, owner's parameter name, the recipe the copies are laid out for, as the
        # weight's sites run it, and the prefixes of the copies' buffers): a tied weight appears under each holder.
        self._holders: list[tuple[torch.nn.Module, str, torch.nn.Module, str, Recipe, tuple[str, ...]]] = []
        self.reuse = False
        self._filled_versions: tuple | None = None
        self._versions_at_call: tuple | None = None
        self._filled_moving_state = self._moves_state_at_call = False

    def add(self, holder: torch.nn.Module, name: str, owner: torch.nn.Module, owner_name: str, recipe: Recipe,
            prefixes: tuple[str, ...]) -> None:
        self._holders.append((holder, name, owner, owner_name, recipe, prefixes))

    def __len__(self) -> int:
        return sum(holder is owner for holder, _, owner, *_ in self._holders)

    def by_weight(self) -> dict[int, tuple[Recipe, dict[str, torch.Tensor]]]:
        """``{id(weight): (recipe, copies)}`` for the tensors the holding modules hold now: the recipe the copies
        serve (a site with another reads none), and the copies by prefix, in :func:`copy_layout`'s order."""
        return {id(holder._parameters[name]): (recipe, {prefix: getattr(owner, prefix + owner_name)
                                                        for prefix in prefixes})
                for holder, name, owner, owner_name, recipe, prefixes in self._holders
                if holder._parameters.get(name) is not None}

    def _versions(self) -> tuple:
        """What identifies each weight's values: the tensor, its version counter (every in-place change), and
        its storage, dtype and device (``param.data = ...`` and ``model.to(...)`` swap them without a bump)."""
        weights = [owner._parameters[name] for holder, name, owner, *_ in self._holders if holder is owner]
        return tuple((id(weight), weight._version, _storage_address(weight), weight.dtype, weight.device)
                     for weight in weights)

    def _moves_delayed_state(self) -> bool:
        """Whether the coming call moves delayed-scaling state: gradients on and a module holding a delayed
        copy in training mode (otherwise its sites only read the stored scales: fp8graph.buffers.delayed_state)."""
        return torch.is_grad_enabled() and any(holder.training for holder, *_, recipe, _ in self._holders
                                               if recipe.stateful)

    def before_call(self) -> None:
        """Choose the mode of the coming call: reuse only if no cached weight changed since the last fill, and,
        for a call that moves delayed-scaling state, if that fill moved it too (a fill that only read the
        stored scales kept a cast with the stored scale, where a training call casts with the one its history
        gives, and records it)."""
        self._versions_at_call = self._versions()
        self._moves_state_at_call = self._moves_delayed_state()
        unchanged = self._filled_versions is not None and self._filled_versions == self._versions_at_call
        self.reuse = unchanged and (self._filled_moving_state or not self._moves_state_at_call)

    def after_call(self) -> None:
        """A call that filled the copies finished: they now hold the weights as they were when it began."""
        if not self.reuse:
            self._filled_versions = self._versions_at_call
            self._filled_moving_state = self._moves_state_at_call

    def invalidate(self) -> None:
        """Make the next call fill, e.g. after changing weights through ``param.data``."""
        self._filled_versions = None

    def holds_any(self, weight_ids: set[int]) -> bool:
        return any(id(owner._parameters.get(name)) in weight_ids for holder, name, owner, *_ in self._holders
                   if holder is owner)


# Every cache alive, for the optimizer hook: a fused optimizer (torch.optim.AdamW(fused=True), the default of
# HuggingFace's Trainer on a GPU) writes the weights in one kernel without moving their version counters.
_LIVE_CACHES: "weakref.WeakSet[WeightCache]" = weakref.WeakSet()
_STEP_HOOK: list = []
_OPTIMIZER_STEPS = [0]  # steps any torch.optim.Optimizer took in this process since the hook was registered


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Any ``torch.optim.Optimizer``'s step (subclasses too: their ``step`` runs the global hooks) makes the
    caches that hold one of its parameters fill at their next call, and moves :func:`optimizer_steps`."""
    _OPTIMIZER_STEPS[0] += 1
    stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for cache in list(_LIVE_CACHES):
        if cache.holds_any(stepped):
            cache.invalidate()


def watch_optimizer_steps(cache: WeightCache | None = None) -> None:
    """Register the optimizer hook (once a process), and ``cache`` with it."""
    if cache is not None:
        _LIVE_CACHES.add(cache)
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))


def optimizer_steps() -> int:
    """How many optimizer steps this process took since :func:`watch_optimizer_steps` first ran: what a copy kept
    elsewhere (FSDP2's shard casts) compares, beside the version counter a fused optimizer leaves alone."""
    return _OPTIMIZER_STEPS[0]



class _CachedWeightsHook(AnchorHook):
    """Anchors the FP8 copies as filled by this call, or as read by it (the cache's mode)."""

    def __init__(self, cache: WeightCache, owners_and_names: list[tuple[torch.nn.Module, str, tuple[str, ...]]]):
        super().__init__("fill", [(owner, tuple(prefix + name for prefix in prefixes))
                                  for owner, name, prefixes in owners_and_names])
        self.cache = cache

    def anchor_kind(self, module: torch.nn.Module) -> str:
        return "reuse" if self.cache.reuse else "fill"  # a branch Dynamo guards on: the two graphs differ


_REGISTERED_ATTRIBUTE = "_fp8graph_weight_cache"


def _storage_address(weight: torch.Tensor) -> int | None:
    try:
        return weight.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor) has no storage of its own
        return None


def copy_layout(module: torch.nn.Module, param: torch.Tensor, recipe: Recipe, device=None) -> dict[str, torch.Tensor]:
    """The buffers that keep ``param``'s FP8 copies under ``recipe`` (the policy's), by prefix in
    :data:`COPY_PREFIXES` order, as zeros on ``device`` (the weight's by default; ``"meta"`` for the layout
    alone): the one place that says what a kept copy holds. The sites' targets
    write and read them as keywords (:data:`COPY_KEYWORDS`)::

        recipe              weight            copies
        per tensor          matrix            (N, K), ()
        per tensor          experts           its own shape, (E, 1), its transpose
        delayed             matrix, experts   as per tensor, and the weight's amax: (1,), (E, 1)
        row-wise            experts           its own shape, a scale a row, its transpose, a scale a row of it
        MXFP8               experts           its own shape and its blocks' scales, its transpose and its blocks'
        row-wise, MXFP8     matrix            (N, K) and its tiles' scales, (K, N) and its tiles' scales
        block (128x128)     matrix            (N, K) and its tiles' scales: grad_input reads them transposed

    A matrix whose module leaves the orientation open (``weight_orientations``) is kept in its own shape,
    which its site reads transposed where it multiplies the weight the other way round; an expert weight's
    two layouts are filled both ways from one cast, and its site takes the one laid out as each GEMM
    reads it."""
    device = param.device if device is None else device
    experts = weight_experts(param)
    if recipe.tiled and experts is None:
        like = torch.empty(_copy_shape(module, param), dtype=param.dtype, device="meta")
        operands = cached_weight_operands(like, recipe, use_kernel=_kernel_on(param.device, recipe))
        # Laid out as the casts write them (grad_input's along N may be N-major): a fill copies them as they are.
        return {prefix: _zeros(operand.shape, operand.dtype, device, operand.stride())
                for prefix, operand in zip(COPY_PREFIXES, operands)}
    if recipe.tiled and recipe.granularity not in NATIVE_GROUPED_GRANULARITIES:  # experts cast block by block
        like = torch.empty(param.shape, dtype=param.dtype, device="meta")
        tiling = recipe.tiling(Role.WEIGHT)
        operands = (*expert_blocks(like, tiling), *expert_blocks(like.transpose(-2, -1), tiling))
        return {prefix: _zeros(operand.shape, operand.dtype, device)
                for prefix, operand in zip(COPY_PREFIXES, operands)}
    fp8_dtype = _site_recipe(param, recipe).fp8_dtype(Role.WEIGHT)
    copy = _zeros(_copy_shape(module, param), fp8_dtype, device)
    if experts is None:
        copies = {CACHED_WEIGHT_PREFIX: copy, CACHED_SCALE_PREFIX: torch.ones((), device=device)}
    else:
        _, rows, columns = param.shape
        copies = {CACHED_WEIGHT_PREFIX: copy,
                  CACHED_SCALE_PREFIX: torch.ones((experts, rows if recipe.tiled else 1), device=device),
                  CACHED_TRANSPOSE_PREFIX: _zeros((experts, columns, rows), fp8_dtype, device)}
        if recipe.tiled:  # row-wise: each layout cast along its own rows
            copies[CACHED_TRANSPOSE_SCALE_PREFIX] = torch.ones((experts, columns), device=device)
    if recipe.stateful:  # a reusing call records the amax the weight's history would get from casting it
        copies[CACHED_AMAX_PREFIX] = torch.zeros((experts, 1) if experts else (1,), device=device)
    return copies


def _site_recipe(param: torch.Tensor, recipe: Recipe) -> Recipe:
    """The recipe the weight's sites run under the policy's ``recipe``: an expert GEMM's is all E4M3."""
    return expert_recipe(recipe) if weight_experts(param) is not None else recipe


def _zeros(shape, dtype: torch.dtype, device, stride=None) -> torch.Tensor:
    """Zero bytes of ``dtype`` (E8M0 has no zero: its bytes are zero all the same), with ``stride`` if given."""
    stride = stride if stride is not None else torch.empty(shape, device="meta").stride()
    zeros = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    (zeros.view(torch.uint8) if dtype.itemsize == 1 else zeros).zero_()
    return zeros


def _kernel_on(device: torch.device, recipe: Recipe) -> bool:
    """Whether the weight's cast runs fp8graph's kernel there (its outputs' layouts are the copies')."""
    return device.type == "cuda" and kernel_quantizes(recipe.tiling(Role.WEIGHT))


def _copy_shape(module: torch.nn.Module, param: torch.Tensor) -> tuple[int, ...]:
    """The FP8 copy's shape: (N, K), or the weight's own where its module leaves the orientation open (every
    expert weight: (E, N, K) or (E, K, N), as the experts store it)."""
    orientations = weight_orientations(module, param)
    return (*param.shape[:-2], *orientations[0]) if len(orientations) == 1 else tuple(param.shape)


def _layout_of(copies) -> tuple:
    """What must match for kept copies to serve another compile: each copy's shape and dtype, in order."""
    copies = copies.values() if isinstance(copies, dict) else copies
    return tuple((tuple(copy.shape), copy.dtype) for copy in copies)


def _kept_from_ddp_broadcasts(model: torch.nn.Module, names: list[str], data_parallel) -> None:
    """DDP broadcasts every buffer from rank 0 before each forward, and its collectives take no FP8 (gloo: "Invalid
    scalar type"); each rank fills its own copies from the same weights anyway. The copies join the names DDP
    ignores: on the wrapper ``model`` was compiled inside, and on ``model`` for a DDP built around the compiled
    model later (which reads them at construction, under its ``_orig_mod.`` prefix too)."""
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    ignored += [name for name in names + [f"_orig_mod.{name}" for name in names] if name not in ignored]
    model._ddp_params_and_buffers_to_ignore = ignored
    if data_parallel is not None and hasattr(data_parallel, "parameters_to_ignore"):
        data_parallel.parameters_to_ignore.update(names)


def _describe(layout: tuple | None) -> str:
    if layout is None:
        return "no copy"
    return ", ".join(f"{str(dtype).removeprefix('torch.')} {'x'.join(map(str, shape)) or 'scalar'}"
                     for shape, dtype in layout)


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
            wanted = None if recipe is None else _layout_of(copy_layout(module, param, recipe, device="meta"))
            there = _layout_of(copies[id(param)][1]) if id(param) in copies else None
            if wanted != there:
                raise CopiesCannotServe(
                    f"{path}.{name}: the model was compiled before with FP8 weight copies, and its "
                    f"copies cannot serve this policy (it asks for {_describe(wanted)}; there is "
                    f"{_describe(there)}). Compile it with the first policy again, or build a fresh model")
    cache.invalidate()
    return cache


def register_weight_cache(model: torch.nn.Module, policy: Policy, plan: Plan | None = None,
                          data_parallel: torch.nn.Module | None = None) -> WeightCache | None:
    """Register FP8 copies for the weights of submodules whose plan keeps one (``WeightEntry.cached``), laid
    out by :func:`copy_layout`.

    A model that holds them already (compiled before with weight copies, or a copy of one) keeps
    them when they serve ``policy`` (:func:`_reuse_registered_cache`), and refills them at its next call;
    :class:`CopiesCannotServe` where they do not.
    ``plan``: the model's plan under ``policy`` (made here when ``None``). None, and nothing registered, where
    no weight gets a copy (no site on it may take a recipe that caches). ``data_parallel``: the
    ``DistributedDataParallel`` around ``model``, if any (:func:`_kept_from_ddp_broadcasts`).
    """
    plan = plan if plan is not None else Plan(model, policy)
    earlier = model.__dict__.get(_REGISTERED_ATTRIBUTE)
    if earlier is not None:
        watch_optimizer_steps(earlier)  # a copied model's cache is a copy
        return _reuse_registered_cache(model, plan, earlier)
    cache = WeightCache()
    new_buffers: list[NewBuffer] = []
    owner_of: dict[int, tuple[torch.nn.Module, str, Recipe, tuple[str, ...]]] = {}
    anchored: dict[torch.nn.Module, list[tuple[torch.nn.Module, str, tuple[str, ...]]]] = {}
    for path, module in model.named_modules():
        if module is model:
            continue
        for name, param in weight_candidates(module):
            if id(param) in owner_of:  # a tied weight: one copy, kept by the first module
                owner, owner_name, site_recipe, prefixes = owner_of[id(param)]
                cache.add(module, name, owner, owner_name, site_recipe, prefixes)
                anchored.setdefault(module, []).append((owner, owner_name, prefixes))
                continue
            recipe = plan[param].cached
            if recipe is None:
                continue
            copies = copy_layout(module, param, recipe)
            for prefix, initial in copies.items():
                new_buffers.append(NewBuffer(module, path, prefix + name, initial, persistent=False))
            site_recipe = _site_recipe(param, recipe)
            owner_of[id(param)] = (module, name, site_recipe, tuple(copies))
            cache.add(module, name, module, name, site_recipe, tuple(copies))
            anchored.setdefault(module, []).append((module, name, tuple(copies)))
    if not new_buffers:
        return None
    register_new_buffers(new_buffers, if_taken="a buffer of that name that is not fp8graph's: rename it, or build a "
                                               "fresh model")
    _kept_from_ddp_broadcasts(model, [f"{b.path}.{b.name}" if b.path else b.name for b in new_buffers], data_parallel)
    for module, owners_and_names in anchored.items():
        module.register_forward_hook(_CachedWeightsHook(cache, owners_and_names))
    model.__dict__[_REGISTERED_ATTRIBUTE] = cache
    watch_optimizer_steps(cache)
    return cache
