"""Compile each repeated block once for all its instances (regional compilation).

:func:`fp8graph.compile` compiles the model with the root's backend, as
``torch.compile`` would, but the calls of the blocks that
:mod:`fp8graph.regions.repeated_blocks` found are graph breaks: each block call runs a
function compiled once per :class:`~fp8graph.regions.repeated_blocks.BlockGroup` with that
group's own :class:`BlockBackend`. Parameters and buffers are graph inputs
(Dynamo's ``inline_inbuilt_nn_modules``), so layers 2..N pass the guards of
layer 1's code and the FP8 rewrite, AOTAutograd and Inductor run once per
group, not once per layer.

What lies around the blocks: the module that calls them (the *trunk*,
HuggingFace's ``model.model``) runs eagerly while its parameter-holding
children (embedding, final norm) are regions of their own, and the root's
remaining code (``lm_head``, the loss) is compiled by the root's backend
(see :func:`fp8graph.regions.repeated_blocks.find_trunks` for why the trunk is not traced).

How a block call becomes a region: each block instance's class is replaced
by a subclass of it (same name, module and qualified name; one subclass per
class) whose ``__call__`` checks whether a compiled fp8graph model is
running. If so it calls the group's compiled function through a
``torch.compiler.disable``-d trampoline, a graph break for the enclosing
trace; if not (the model called eagerly, or compiled by plain
``torch.compile``) it is the block's own ``__call__``, which Dynamo inlines
as before. The region covers the whole call, forward hooks and HuggingFace's
gradient-checkpointing ``__call__`` included, so the delayed-scaling, stats
and weight-cache buffers that the hooks anchor reach the region's graph as
inputs of each instance, and a checkpointed block is a checkpoint region
inside the compiled graph (``fp8graph.passes.subgraphs``). Pickling or
copying a block gives its original class back.

Each group's compiled function has its own code object, so Dynamo keeps one
cache (and one recompile budget) per group. A session (which compiled
functions serve which block) is active only while the compiled model runs;
one compiled model runs at a time per process, as with ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from typing import Callable

import torch

from fp8graph.passes.annotate import Decision, resolve_site

from fp8graph.backend import FP8Backend
from fp8graph.instances import served_decisions
from fp8graph.recipes.plan import instance_path
from fp8graph.regions.repeated_blocks import BlockGroup

__all__ = ["BlockBackend", "RegionSession", "RegionalBackend", "block_class", "compile_regions",
           "is_region_boundary"]

log = logging.getLogger("fp8graph")

_active_session: "RegionSession | None" = None  # read by the blocks' __call__; Dynamo guards on it
_REGIONAL_CLASSES: dict[tuple[type, bool], type] = {}
_BLOCK_CLASS = "_fp8graph_block_class"


class RegionSession:
    """Which compiled function each block instance calls while a compiled model runs.

    The contract, all of the module's global state: a block instance's class (``block_class``) calls its
    region only inside ``session.active()``, which ``fp8graph.compile`` enters around each call of the
    compiled model; anywhere else the block is its own, uncompiled self. One session is active at a time
    per process (``_active_session``, which Dynamo guards on); entering another (a compiled model called
    inside another's forward) makes it active until it exits, then the prior one is again.
    """

    def __init__(self) -> None:
        self._calls: dict[int, Callable] = {}
        self._instances: dict[Callable, int] = {}

    def add(self, block: torch.nn.Module, compiled_call: Callable) -> None:
        self._calls[id(block)] = compiled_call
        self._instances[compiled_call] = self._instances.get(compiled_call, 0) + 1

    def call_for(self, block: torch.nn.Module) -> Callable:
        try:
            return self._calls[id(block)]
        except KeyError:
            raise RuntimeError(
                f"fp8graph: a {type(block).__name__} block was called by a compiled model that did not "
                "compile it as a region (a block shared with another fp8graph.compile'd model?): compile "
                "that model with regions=None") from None

    @contextlib.contextmanager
    def active(self):
        global _active_session
        prior, _active_session = _active_session, self
        # Guards that tell instances apart (a KV cache indexed by layer) recompile the region once per
        # instance; past Dynamo's recompile limit the other instances would run eagerly, in high precision.
        limit = torch._dynamo.config.recompile_limit + max(self._instances.values(), default=0)
        try:
            with torch._dynamo.config.patch(recompile_limit=limit):
                yield
        finally:
            _active_session = prior


@torch.compiler.disable
def _run_region(session: RegionSession, block: torch.nn.Module, args: tuple, kwargs: dict):
    # Disabled, so the enclosing trace breaks here; the compiled call re-enters Dynamo with its group's backend.
    return session.call_for(block)(block, *args, **kwargs)


def is_region_boundary(graph_break_reason: str) -> bool:
    """Whether a Dynamo graph-break reason is one of the breaks regional compilation makes on purpose."""
    return any(f"<function {fn.__name__} at" in graph_break_reason for fn in (_run_region, _run_eagerly))


def _call_block(block, *args, **kwargs):
    """Template of each group's region: the block's own ``__call__`` (hooks, checkpointing, forward)."""
    return getattr(type(block), _BLOCK_CLASS).__call__(block, *args, **kwargs)


def _region_function(name: str) -> Callable:
    # A code object per group: Dynamo caches compiled code, and counts recompiles, per code object.
    names = {"co_name": name, **({"co_qualname": name} if hasattr(_call_block.__code__, "co_qualname") else {})}
    code = _call_block.__code__.replace(**names)
    return types.FunctionType(code, _call_block.__globals__, name)


@torch.compiler.disable
def _run_eagerly(call: Callable, module: torch.nn.Module, args: tuple, kwargs: dict):
    # The trunk runs eagerly; the regions it calls still enter Dynamo through their own compiled functions.
    return call(module, *args, **kwargs)


def _regional_class(block_class: type, trunk: bool = False) -> type:
    if getattr(block_class, _BLOCK_CLASS, None) is not None:
        return block_class  # a region already (maybe under FSDP2's subclass): one trampoline is enough
    regional = _REGIONAL_CLASSES.get((block_class, trunk))
    if regional is not None:
        return regional
    original_call = block_class.__call__

    def __call__(self, *args, **kwargs):
        if _active_session is None:
            return original_call(self, *args, **kwargs)
        if trunk:
            return _run_eagerly(original_call, self, args, kwargs)
        return _run_region(_active_session, self, args, kwargs)

    def __reduce_ex__(self, protocol):
        # Rebuilt as the class it was before: the region belongs to the compile, not to the module.
        return _new_block, (block_class,), self.__getstate__()

    regional = type(block_class.__name__, (block_class,), {
        "__call__": __call__, "__reduce_ex__": __reduce_ex__, _BLOCK_CLASS: block_class,
        "__module__": block_class.__module__, "__qualname__": block_class.__qualname__,
    })
    _REGIONAL_CLASSES[(block_class, trunk)] = regional
    return regional


def _new_block(cls: type) -> torch.nn.Module:
    return cls.__new__(cls)


def block_class(module: torch.nn.Module) -> type:
    """The class ``module`` had before it became a region."""
    return getattr(type(module), _BLOCK_CLASS, type(module))


def make_region(block: torch.nn.Module) -> None:
    """Give ``block`` the subclass whose ``__call__`` runs its region while a compiled model runs."""
    block.__class__ = _regional_class(type(block))


def make_eager_trunk(trunk: torch.nn.Module) -> None:
    """Give ``trunk`` the subclass whose ``__call__`` runs eagerly (around its regions) while a compiled model runs."""
    trunk.__class__ = _regional_class(type(trunk), trunk=True)


class BlockBackend(FP8Backend):
    """The backend of one block group: rewrites the template instance's graph, checked for every instance.

    Dynamo traces the group's first call, on whichever instance made it;
    the sites carry that instance's paths. Every instance of the group must
    resolve like it, with the traced shapes too (a predicate on ``M``, say):
    a policy that tells them apart would silently run one instance's recipe
    on another, so it is refused, naming both modules.
    """

    records_served_instances = False  # the group's instances are reported by RegionalBackend.decisions

    def __init__(self, group: BlockGroup, **backend_kwargs):
        super().__init__(**backend_kwargs)
        self.group = group
        # Per compiled graph: the instance traced, its decisions, and whether an earlier graph of the
        # same kind (grad mode, sites and shapes) serves the other instances already.
        self.traced: list[tuple[str, list[Decision], bool]] = []
        self._pending: tuple[str, list[Decision], tuple] | None = None
        self._kinds: dict[tuple, str] = {}
        self._warned = False

    def run_passes(self, gm, example_inputs):
        decisions = super().run_passes(gm, example_inputs)
        traced = self._traced_instance(decisions)
        for decision in decisions:
            self._check_alike(decision, traced)
        kind = (torch.is_grad_enabled(), tuple(
            (d.site.path[len(traced):], d.site.op, d.site.M, d.site.K, d.site.N) for d in decisions))
        self._pending = (traced, decisions, kind)
        return decisions

    def __call__(self, gm, example_inputs):
        compiled = super().__call__(gm, example_inputs)
        traced, decisions, kind = self._pending  # recorded once lowering succeeded, as FP8Backend does
        first = self._kinds.setdefault(kind, traced)
        self.traced.append((traced, decisions, first != traced))
        if first != traced and not self._warned:
            self._warned = True
            log.warning(
                "fp8graph: the region of %s compiled again for %s, alike %s: Dynamo's guards tell the instances "
                "apart, so each compiles on its own and regional compilation saves no time (TORCH_LOGS=recompiles "
                "names the guard; a HuggingFace KV cache built by a training forward is one: call the model with "
                "use_cache=False)", self.group.block_type.__name__, traced, first)
        return compiled

    def _judged_decisions(self, decisions: list[Decision]) -> list[Decision]:
        """Each site under every instance's path: the region's graph runs for all of them."""
        return _expand(decisions, self._pending[0], self.group, self.plan)

    def _traced_instance(self, decisions: list[Decision]) -> str:
        for decision in decisions:
            for path in self.group.paths:
                if instance_path(decision.site.path, path, path) is not None:
                    return path
        return self.group.template

    def _check_alike(self, decision: Decision, traced: str) -> None:
        """Refuse a region whose instances the policy treats differently at this site.

        A site on a weight its module owns, whose plan entry was decided before tracing, needs no look:
        the group's instances share their plan signature (``group_blocks``). The rest, sites without a
        weight (activation matmuls) and weights whose rules read the traced shape, are resolved here for
        each instance's path.
        """
        site = decision.site
        planned = decision.planned
        if planned is not None and planned.path == site.path and not planned.recipes.undecided:
            return
        modules = self.modules_by_path or {}

        def resolution(path):
            found = resolve_site(self.policy, site, path, modules.get(path))
            return found.recipe, found.rule_index

        expected = resolution(site.path)
        for instance in self.group.paths:
            other = instance_path(site.path, traced, instance)
            if other is None or other == site.path:
                continue
            if resolution(other) != expected:
                raise ValueError(
                    f"fp8graph: the policy gives {other} ({site.op}, M={site.M}) another recipe than "
                    f"{site.path}, and both are instances of {self.group.block_type.__name__} compiled as one "
                    "region (they looked alike before tracing). Write the rule against module paths or "
                    "classes, or compile with regions=None")


def _expand(decisions: list[Decision], traced: str, group: BlockGroup, plan) -> list[Decision]:
    """One decision per instance of ``group`` for each decision taken on the traced instance, joined to that
    instance's weights in ``plan``."""
    inside = [d for d in decisions if instance_path(d.site.path, traced, traced) is not None]
    # A site outside the block (none in practice) is reported as traced.
    expanded = [d for d in decisions if instance_path(d.site.path, traced, traced) is None]
    for instance in group.paths:
        expanded += served_decisions(inside, traced, instance, plan)
    return expanded


class RegionalBackend:
    """What :func:`fp8graph.compile` attaches as ``fp8graph_backend`` when blocks are regions.

    Reads like an :class:`FP8Backend`: ``decisions`` has one entry per site of
    every instance under its own module path (a region's decisions, taken
    once, are repeated for each instance), ``graph_modules`` the root's graphs
    then each group's. ``root`` and ``block_backends`` are the backends behind it.
    """

    def __init__(self, root: FP8Backend, block_backends: list[BlockBackend], module_order: dict[str, int]):
        self.root = root
        self.block_backends = block_backends
        self._module_order = module_order

    policy = property(lambda self: self.root.policy)
    compiler = property(lambda self: self.root.compiler)
    lowering = property(lambda self: self.root.lowering)
    mode = property(lambda self: self.root.mode)
    stats = property(lambda self: self.root.stats)
    state = property(lambda self: self.root.state)
    weight_cache = property(lambda self: self.root.weight_cache)
    plan = property(lambda self: self.root.plan)
    frames_run_eagerly = property(lambda self: self.root.frames_run_eagerly)

    @property
    def groups(self) -> list[BlockGroup]:
        return [backend.group for backend in self.block_backends]

    @property
    def decisions(self) -> list[Decision]:
        decisions = list(self.root.decisions)
        for backend in self.block_backends:
            for traced, graph_decisions, per_instance in backend.traced:
                # A per-instance recompile repeats sites that its kind's first graph reported for every instance.
                if not per_instance:
                    decisions += _expand(graph_decisions, traced, backend.group, self.root.plan)
        order = self._module_order
        # Module order, as a whole-model graph lists them; calls of one module keep their order.
        return sorted(decisions, key=lambda d: _order_key(d.site.path, order))

    @property
    def slow_sites(self) -> list:
        """The root's and every region's (each site under every instance's path)."""
        return self.root.slow_sites + [slow for backend in self.block_backends for slow in backend.slow_sites]

    @property
    def graph_modules(self) -> list[torch.fx.GraphModule]:
        return [gm for backend in (self.root, *self.block_backends) for gm in backend.graph_modules]

    @property
    def graph_count(self) -> int:
        return len(self.graph_modules)

    def unmatched_rules(self) -> list[int]:
        matched = {d.rule_index for d in self.decisions}
        return [i for i in range(len(self.policy.rules)) if i not in matched]


def _order_key(path: str, order: dict[str, int]) -> int:
    while path not in order and "." in path:
        path = path.rsplit(".", 1)[0]
    return order.get(path, -1)


def compile_regions(groups: list[BlockGroup], trunks: list[torch.nn.Module],
                    make_backend: Callable[[BlockGroup], BlockBackend],
                    torch_compile_kwargs: dict) -> tuple[RegionSession, list[BlockBackend]]:
    """Turn every instance of ``groups`` into a region; one compiled function (and backend) per group."""
    session = RegionSession()
    for trunk in trunks:
        make_eager_trunk(trunk)
    backends = []
    for index, group in enumerate(groups):
        backend = make_backend(group)
        name = f"{block_class(group.modules[0]).__name__}_region_{index}"
        compiled_call = torch.compile(_region_function(name), backend=backend, **torch_compile_kwargs)
        for block in group.modules:
            make_region(block)
            session.add(block, compiled_call)
        backends.append(backend)
    return session, backends
