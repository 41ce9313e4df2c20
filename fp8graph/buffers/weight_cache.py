"""The weights' FP8 casts, kept for the calls declared to see the same weights (``fp8graph.weights_unchanged``).

Gradient accumulation runs several forwards on the same weights, inference
many: quantizing every weight (an amax pass and a cast pass over it) at each
call redoes work. ``fp8graph.compile`` (``cache_weights="auto"``, or ``True``)
gives every weight whose recipe casts it from the weight alone non-persistent
buffers on the module that owns it, holding what the weight's sites' GEMMs read
(:func:`copy_layout` says what, per recipe and kind of weight; which weights get
them is the plan's ``WeightEntry.cached``)::

    fp8graph_cached_weight_<name>          the forward GEMM's FP8 operand
    fp8graph_cached_weight_scale_<name>    its scales (delayed scaling: the scale it was cast with)
    fp8graph_cached_weight_t_<name>        grad_input's, where it is a second copy (experts, row-wise, MXFP8)
    fp8graph_cached_weight_t_scale_<name>  its scales, where they are not the first's (row-wise, MXFP8)

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

A cast is reused only inside ``fp8graph.weights_unchanged(model)``
(``fp8graph.buffers.kept_casts`` says why: a write through ``param.data`` is
invisible to fp8graph). Before each call of the compiled model,
:meth:`WeightCache.before_call` chooses one of three modes:

    "per call"   outside every declaration: the call casts the weights and keeps nothing (the graph of
                 ``cache_weights=False``); the buffers are empty placeholders, holding no memory
    "fill"       the first call of a declaration, or one after a change fp8graph sees (an optimizer step,
                 a version counter, a new tensor behind a parameter): it casts and writes the copies
    "reuse"      the others: their graphs read the copies and skip the weights' casts

The buffers get their memory when the outermost declaration opens and give it
back when it closes. The forward hooks that bring the buffers into the graph
branch on the mode, so Dynamo guards on it and compiles one graph of each kind.
Weights the root module owns itself are not cached: Dynamo runs the root's hooks
outside the graph (see ``fp8graph.buffers.delayed_state``). Under DDP the copies
are left out of its buffer broadcasts (:func:`_kept_from_ddp_broadcasts`).
"""

from __future__ import annotations

import torch

from fp8graph.numerics.formats import Role
from fp8graph.buffers.anchors import ANCHORS, AnchorHook, NewBuffer, register_new_buffers
from fp8graph.buffers.kept_casts import CastStamp, ReuseScope
from fp8graph.gemm.tiled_operands import cached_weight_operands, expert_blocks
from fp8graph.kernels.quantize_tiles import kernel_quantizes
from fp8graph.recipes.plan import Plan
from fp8graph.recipes.policy import Policy, weight_experts, weight_orientations
from fp8graph.recipes.scaling import NATIVE_GROUPED_GRANULARITIES, Recipe, expert_recipe
from fp8graph.buffers.delayed_state import weight_candidates

__all__ = ["CACHED_SCALE_PREFIX", "CACHED_TRANSPOSE_PREFIX", "CACHED_TRANSPOSE_SCALE_PREFIX", "CACHED_WEIGHT_PREFIX",
           "COPY_KEYWORDS", "COPY_PREFIXES", "CopiesCannotServe", "MODES", "WeightCache", "copy_layout",
           "register_weight_cache"]

CACHED_WEIGHT_PREFIX = "fp8graph_cached_weight_"
CACHED_SCALE_PREFIX = "fp8graph_cached_weight_scale_"
CACHED_TRANSPOSE_PREFIX = "fp8graph_cached_weight_t_"  # the copy grad_input reads, where it is a second one
CACHED_TRANSPOSE_SCALE_PREFIX = "fp8graph_cached_weight_t_scale_"  # its scales, where they are not the first's
# The buffers of a weight's copies, in the order copy_layout lists them; a layout keeps some of them.
COPY_PREFIXES = (CACHED_WEIGHT_PREFIX, CACHED_SCALE_PREFIX, CACHED_TRANSPOSE_PREFIX, CACHED_TRANSPOSE_SCALE_PREFIX)
# The keyword each buffer is passed to the sites' targets under.
COPY_KEYWORDS = dict(zip(COPY_PREFIXES, ("cached_weight", "cached_weight_scale", "cached_weight_t",
                                         "cached_weight_t_scale")))
PER_CALL, FILL, REUSE = MODES = ("per call", "fill", "reuse")


class CopiesCannotServe(ValueError):
    """An earlier compile's FP8 copies on this model are not those the new compile's policy asks for."""


class _Holder:
    """One weight as a module holds it: ``holder.name`` reads it, ``owner`` keeps its copies as ``<prefix><owner_name>``
    (a tied weight is held by several modules, its copies by the first), laid out as ``layout`` (meta tensors, by
    prefix) for ``recipe``, the recipe its sites run."""

    def __init__(self, holder, name, owner, owner_name, recipe: Recipe, layout: dict[str, torch.Tensor]):
        self.holder, self.name, self.owner, self.owner_name = holder, name, owner, owner_name
        self.recipe, self.layout = recipe, layout
        weight = self.weight
        self.shape = None if weight is None else tuple(weight.shape)  # what the copies are laid out for

    @property
    def owns(self) -> bool:
        return self.holder is self.owner

    @property
    def weight(self) -> torch.Tensor | None:
        return self.owner._parameters.get(self.owner_name)

    @property
    def held(self) -> torch.Tensor | None:
        """The weight the holder holds, while it is the one the owner's copies are of: a tied weight untied
        since (``holder.weight = nn.Parameter(...)``) has no copy, and its sites cast it at every call."""
        held = self.holder._parameters.get(self.name)
        return held if held is not None and held is self.weight else None

    def copies(self) -> dict[str, torch.Tensor]:
        return {prefix: getattr(self.owner, prefix + self.owner_name) for prefix in self.layout}


class WeightCache:
    """Which weights have an FP8 copy, where, and what the next call does with them (:data:`MODES`)."""

    def __init__(self, scope: ReuseScope) -> None:
        self._holders: list[_Holder] = []
        self.scope = scope
        self.mode = PER_CALL
        self._filled: CastStamp | None = None
        self._filled_moving_state = False
        self._stamp_at_call: CastStamp | None = None
        self._moves_state_at_call = False
        self._hooks: list[_CachedWeightsHook] = []
        # id(copy buffer) -> (hook, index of its weight among the hook's sources), while a declaration is open
        self._hook_of_buffer: dict[int, tuple[_CachedWeightsHook, int]] = {}
        self._watch(scope)

    def _watch(self, scope: ReuseScope) -> None:
        """The copies hold memory only while a declaration is open."""
        if self._allocate not in scope.on_open:
            scope.on_open.append(self._allocate)
            scope.on_close.append(self._release)

    def add(self, holder: torch.nn.Module, name: str, owner: torch.nn.Module, owner_name: str, recipe: Recipe,
            layout: dict[str, torch.Tensor]) -> None:
        self._holders.append(_Holder(holder, name, owner, owner_name, recipe, layout))

    def __len__(self) -> int:
        return sum(holder.owns for holder in self._holders)

    @property
    def reuse(self) -> bool:
        """Whether the coming (or last) call reads the kept casts instead of casting the weights."""
        return self.mode == REUSE

    def by_weight(self) -> dict[int, tuple[Recipe, dict[str, torch.Tensor]]]:
        """``{id(weight): (recipe, copies)}`` for the tensors the holding modules hold now: the recipe the copies
        serve (a site with another reads none), and the copies by prefix, in :func:`copy_layout`'s order."""
        return {id(entry.held): (entry.recipe, entry.copies()) for entry in self._holders if entry.held is not None}

    def layouts(self) -> dict[int, dict[str, torch.Tensor]]:
        """``{id(weight): layout}``: what each weight's copies hold (meta tensors), whether allocated or not."""
        return {id(entry.held): entry.layout for entry in self._holders if entry.held is not None}

    def _versions(self) -> tuple:
        """What identifies each weight's values as fp8graph sees them: the tensor, its version counter (every
        in-place change autograd sees), and where its values lie, its dtype and device (``param.data = ...``
        and ``model.to(...)`` swap them without a bump; another view of the same storage moves its offset, shape
        or strides). A weight gone from its module (pruned, parametrized) is identified as gone."""
        weights = [entry.weight for entry in self._holders if entry.owns]
        return tuple(None if weight is None else
                     (id(weight), weight._version, *_addresses(weight), weight.shape, weight.stride(), weight.dtype,
                      weight.device)
                     for weight in weights)

    def _moves_delayed_state(self) -> bool:
        """Whether the coming call moves delayed-scaling state: gradients on and a module holding a delayed
        copy in training mode (otherwise its sites only read the stored scales: fp8graph.buffers.delayed_state)."""
        return torch.is_grad_enabled() and any(entry.holder.training for entry in self._holders
                                               if entry.recipe.stateful)

    def before_call(self) -> None:
        """Choose the mode of the coming call. Outside a declaration: per call. Inside: reuse if the last fill was
        made in this declaration and still serves (``fp8graph.buffers.kept_casts.CastStamp``), and, for a call that
        moves delayed-scaling state, if that fill moved it too (a fill that only read the stored scales kept a cast
        with the stored scale, where a training call casts with the one its history gives, and records it)."""
        if not self.scope.open:
            self.mode, self._stamp_at_call = PER_CALL, None
            return
        weights = self._versions()
        self._moves_state_at_call = self._moves_delayed_state()
        serves = (self._filled is not None and self._filled.still_serves(self.scope, weights)
                  and (self._filled_moving_state or not self._moves_state_at_call))
        self.mode = REUSE if serves else FILL
        if not serves:
            self._forget_fills()
        self._stamp_at_call = CastStamp.now(self.scope, weights)

    def after_call(self) -> None:
        """A call that filled the copies finished: they now hold the weights as they were when it began."""
        if self.mode == FILL:
            self._filled = self._stamp_at_call
            self._filled_moving_state = self._moves_state_at_call

    def invalidate(self) -> None:
        """Make the next call inside a declaration fill."""
        self._filled = None
        self._forget_fills()

    def _forget_fills(self) -> None:
        """No weight's copies hold a fill that serves: each is written again before it is read."""
        for hook in self._hooks:
            hook.filled = [False] * len(hook.sources)
            hook.written = [set() for _ in hook.sources]

    def written_by_a_run(self, buffers: list[torch.Tensor]) -> None:
        """A compiled graph ran and wrote these copies (its FP8 sites' fills; the backend wraps each graph that
        fills to say so): a weight whose copies are all written now holds a fill that serves."""
        for buffer in buffers:
            hook, index = self._hook_of_buffer.get(id(buffer), (None, None))
            if hook is not None:
                hook.written[index].add(id(buffer))
                hook.filled[index] = hook.written[index] >= hook.buffer_ids[index]

    def _allocate(self) -> None:
        """Give every copy its memory, zeros on its weight's device (a declaration opens)."""
        for entry in self._holders:
            weight = entry.weight
            if entry.owns and weight is not None and tuple(weight.shape) != entry.shape:
                raise ValueError(
                    f"fp8graph.weights_unchanged: {entry.owner_name} of {type(entry.owner).__name__} is "
                    f"{tuple(weight.shape)} now, its FP8 copies were laid out for {entry.shape} when the model "
                    "was compiled: call fp8graph.compile(model) again after replacing a weight by one of another "
                    "shape")
            if entry.owns and weight is not None:
                for prefix, like in entry.layout.items():
                    entry.owner._buffers[prefix + entry.owner_name] = _zeros(like.shape, like.dtype, weight.device,
                                                                             like.stride())
        for hook in self._hooks:
            hook.buffer_ids = [{id(getattr(owner, name)) for name in names} for owner, names in hook.sources]
        self._hook_of_buffer = {buffer: (hook, index) for hook in self._hooks
                                for index, buffers in enumerate(hook.buffer_ids) for buffer in buffers}
        self.invalidate()

    def _release(self) -> None:
        """Give the copies' memory back: empty placeholders of their dtypes (the outermost declaration closes)."""
        for entry in self._holders:
            weight = entry.weight
            if entry.owns and weight is not None:
                for prefix, like in entry.layout.items():
                    entry.owner._buffers[prefix + entry.owner_name] = _placeholder(like, weight.device)
        self._hook_of_buffer = {}
        self.invalidate()


class _CachedWeightsHook(AnchorHook):
    """Anchors the FP8 copies as filled by this call, or as read by it (the cache's mode); anchors nothing for a
    call that casts per call, whose graph then has no copies to read or write."""

    def __init__(self, cache: WeightCache, owners_and_names: list[tuple[torch.nn.Module, str, tuple[str, ...]]]):
        super().__init__("fill", [(owner, tuple(prefix + name for prefix in prefixes))
                                  for owner, name, prefixes in owners_and_names])
        self.cache = cache
        # Per weight (each of ``sources``): whether compiled runs wrote all its copies since the cache last forgot
        # its fills (WeightCache.written_by_a_run), which of them, and which buffers they are.
        self.filled = [False] * len(self.sources)
        self.written: list[set[int]] = [set() for _ in self.sources]
        self.buffer_ids: list[set[int]] = [set() for _ in self.sources]
        cache._hooks.append(self)

    def __call__(self, module: torch.nn.Module, args, output) -> None:
        mode = self.cache.mode  # a branch Dynamo guards on: the graphs differ
        if mode == PER_CALL:
            return
        for (owner, names), filled in zip(self.sources, self.filled):
            # A weight no compiled run of this declaration wrote the copies of (its module was not called, its
            # sites stayed in high precision then, as a policy deciding by the token count keeps a short call's,
            # or the call ran eagerly) is cast and its copies written by this call, rather than read unwritten.
            ANCHORS[FILL if mode == REUSE and not filled else mode](*(getattr(owner, name) for name in names))


_REGISTERED_ATTRIBUTE = "_fp8graph_weight_cache"


def _addresses(weight: torch.Tensor) -> tuple[int | None, int | None]:
    """Where the weight's storage begins and where its values do (a view's offset)."""
    try:
        return weight.untyped_storage().data_ptr(), weight.data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor) has no storage of its own
        return None, None


def copy_layout(module: torch.nn.Module, param: torch.Tensor, recipe: Recipe, device=None) -> dict[str, torch.Tensor]:
    """The buffers that keep ``param``'s FP8 copies under ``recipe`` (the policy's), by prefix in
    :data:`COPY_PREFIXES` order, as zeros on ``device`` (the weight's by default; ``"meta"`` for the layout
    alone): the one place that says what a kept copy holds. The sites' targets
    write and read them as keywords (:data:`COPY_KEYWORDS`)::

        recipe              weight            copies
        per tensor          matrix            (N, K), ()
        per tensor          experts           its own shape, (E, 1), its transpose
        delayed             matrix, experts   as per tensor (the scales it was cast with)
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
    return copies


def _site_recipe(param: torch.Tensor, recipe: Recipe) -> Recipe:
    """The recipe the weight's sites run under the policy's ``recipe``: an expert GEMM's is all E4M3."""
    return expert_recipe(recipe) if weight_experts(param) is not None else recipe


def _placeholder(like: torch.Tensor, device) -> torch.Tensor:
    """What a copy's buffer holds outside a declaration: no element, its dtype (``Module.to`` converts it as it
    would the copy), on its weight's device."""
    return torch.empty(0, dtype=like.dtype, device=device)


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


def _reuse_registered_cache(model: torch.nn.Module, plan: Plan, cache: WeightCache,
                            scope: ReuseScope) -> WeightCache:
    """The copies an earlier ``fp8graph.compile`` registered (or a copy of that model brought), if they serve
    ``policy``: the same weights, in the FP8 dtypes it asks for. Invalidated: a copied model's weights are new
    tensors, whose ids and versions say nothing of the copies' contents."""
    layouts = cache.layouts()
    for path, module in model.named_modules():
        if module is model:
            continue
        for name, param in weight_candidates(module):
            recipe = plan[param].cached
            wanted = None if recipe is None else _layout_of(copy_layout(module, param, recipe, device="meta"))
            there = _layout_of(layouts[id(param)]) if id(param) in layouts else None
            if wanted != there:
                raise CopiesCannotServe(
                    f"{path}.{name}: the model was compiled before with FP8 weight copies, and its "
                    f"copies cannot serve this policy (it asks for {_describe(wanted)}; there is "
                    f"{_describe(there)}). Compile it with the first policy again, or build a fresh model")
    cache.scope = scope
    cache._watch(scope)
    cache.invalidate()
    return cache


def register_weight_cache(model: torch.nn.Module, policy: Policy, scope: ReuseScope, plan: Plan | None = None,
                          data_parallel: torch.nn.Module | None = None) -> WeightCache | None:
    """Register FP8 copies for the weights of submodules whose plan keeps one (``WeightEntry.cached``), laid
    out by :func:`copy_layout`, as empty placeholders: ``scope`` (the model's, ``fp8graph.buffers.kept_casts``)
    gives them memory while a declaration is open.

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
        return _reuse_registered_cache(model, plan, earlier, scope)
    cache = WeightCache(scope)
    new_buffers: list[NewBuffer] = []
    owner_of: dict[int, tuple[torch.nn.Module, str, Recipe, dict[str, torch.Tensor]]] = {}
    anchored: dict[torch.nn.Module, list[tuple[torch.nn.Module, str, tuple[str, ...]]]] = {}
    for path, module in model.named_modules():
        if module is model:
            continue
        for name, param in weight_candidates(module):
            if id(param) in owner_of:  # a tied weight: one copy, kept by the first module
                owner, owner_name, site_recipe, layout = owner_of[id(param)]
                cache.add(module, name, owner, owner_name, site_recipe, layout)
                anchored.setdefault(module, []).append((owner, owner_name, tuple(layout)))
                continue
            recipe = plan[param].cached
            if recipe is None:
                continue
            layout = copy_layout(module, param, recipe, device="meta")
            for prefix, like in layout.items():
                new_buffers.append(NewBuffer(module, path, prefix + name, _placeholder(like, param.device),
                                             persistent=False))
            site_recipe = _site_recipe(param, recipe)
            owner_of[id(param)] = (module, name, site_recipe, layout)
            cache.add(module, name, module, name, site_recipe, layout)
            anchored.setdefault(module, []).append((module, name, tuple(layout)))
    if not new_buffers:
        return None
    register_new_buffers(new_buffers, if_taken="a buffer of that name that is not fp8graph's: rename it, or build a "
                                               "fresh model")
    _kept_from_ddp_broadcasts(model, [f"{b.path}.{b.name}" if b.path else b.name for b in new_buffers], data_parallel)
    for module, owners_and_names in anchored.items():
        module.register_forward_hook(_CachedWeightsHook(cache, owners_and_names))
    model.__dict__[_REGISTERED_ATTRIBUTE] = cache
    if scope.open:  # compiled inside a declaration: the copies get their memory now
        cache._allocate()
    return cache
