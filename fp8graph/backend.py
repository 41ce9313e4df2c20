"""The ``fp8`` torch.compile backend.

Dynamo hands the backend an FX graph of torch-level ops with parameters as
placeholders. The backend runs the passes (find sites -> annotate -> rewrite)
and lowers the rewritten graph through AOTAutograd and Inductor (or
``aot_eager`` for fast tests, or ``eager``)::

    torch.compile(model, backend="fp8")                         # default recipe
    torch.compile(model, backend="fp8", options={"policy": Float8CurrentScaling(Format.E4M3),
                                                 "compiler": "aot_eager"})

``backend="fp8"`` is found through the ``torch_dynamo_backends`` entry point.
"""

from __future__ import annotations

import logging
import operator
from typing import Sequence

import torch
import torch.fx

from fp8graph.passes import annotate_sites, find_sites, group_sites, rewrite_sites, take_anchored_inputs
from fp8graph.passes.annotate import Decision
from fp8graph.passes.module_paths import module_paths_by_id

from fp8graph.gemm.scaled_gemm import LOWERING_CHOICES, choose_lowering
from fp8graph.targets.partitioning import joint_pre_pass, partition_min_cut
from fp8graph.recipes.policy import normalize_policy
from fp8graph.buffers.delayed_state import DelayedState, state_anchor
from fp8graph.buffers.stats import stats_anchor
from fp8graph.buffers.weight_cache import WeightCache, fill_anchor, reuse_anchor

__all__ = ["FP8Backend", "fp8_backend"]

log = logging.getLogger("fp8graph")

COMPILERS = ("inductor", "aot_eager", "eager")
_OPTION_NAMES = ("policy", "compiler", "lowering")


def _graph_device(example_inputs: Sequence[object]) -> torch.device:
    """Where the graph's GEMMs run: the device of its parameters (else of any tensor input)."""
    tensors = [value for value in example_inputs if isinstance(value, torch.Tensor)]
    parameters = [value for value in tensors if isinstance(value, torch.nn.Parameter)]
    for value in parameters or tensors:
        return value.device
    return torch.device("cpu")


def _placeholder_values(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> dict:
    """The real tensor behind each placeholder.

    DDP's graph splitting compiles each piece with fake example inputs; the
    ``GraphArg`` Dynamo leaves in a placeholder's meta still refers (weakly)
    to the real parameter or buffer, which is what identifies a weight's state.
    ``GraphArg._example`` is private (torch 2.11 to 2.13 hold it); without it the
    example input is used, which is the real tensor outside DDP's split. Under
    Inductor's freezing, parameters and buffers are ``get_attr`` nodes instead.
    """
    values = {}
    for node, example in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
        grapharg = node.meta.get("grapharg")
        real = getattr(grapharg, "_example", None)
        real = real() if callable(real) else real  # a TensorWeakRef, or the value itself
        values[node] = real if isinstance(real, torch.Tensor) else example
    for node in gm.graph.find_nodes(op="get_attr"):
        values[node] = operator.attrgetter(node.target)(gm)
    return values


class FP8Backend:
    """A Dynamo backend that rewrites linear sites to FP8, then lowers the graph.

    Args:
        policy: a :class:`fp8graph.Policy`, a bare recipe (shorthand for
            ``Policy(default=recipe)``), or ``None`` for ``Float8CurrentScaling()``
            on every eligible linear site.
        compiler: ``"inductor"``, ``"aot_eager"`` or ``"eager"``.
        lowering: ``"auto"``, ``"scaled_mm"`` or ``"emulated"`` (see ``fp8graph.gemm.scaled_gemm``).
        model: the compiled module, when known: module paths then come from
            module identities and predicates see the module itself; without it
            paths come from Dynamo's source names.
        mode: an Inductor mode (``"max-autotune"``, ...), as ``torch.compile(mode=...)`` passes it.
        stats: an :class:`fp8graph.inspection.stats.FP8Stats` to collect numerics into, or ``None``.
        state: the delayed-scaling state ``fp8graph.buffers.delayed_state.register_delayed_state``
            registered on ``model``; required when the policy uses ``DelayedScaling``.
        weight_cache: the :class:`fp8graph.buffers.weight_cache.WeightCache` registered on
            ``model`` (``cache_weights=True``), or ``None``.

    Every graph's decisions are appended to ``self.decisions`` and each
    rewritten graph to ``self.graph_modules``.
    """

    def __init__(self, policy=None, compiler="inductor", lowering="auto", model=None, mode=None, stats=None,
                 state=None, weight_cache=None):
        self.policy = normalize_policy(policy)
        if self.policy.needs_state and state is None:
            raise ValueError(
                "the policy uses DelayedScaling, whose amax histories and scales live in buffers that "
                "fp8graph.compile(model, policy=...) registers on the model before tracing; "
                "torch.compile(backend='fp8') and explain() of an uncompiled model cannot hold them. "
                "Use fp8graph.compile, and explain the compiled model")
        self.state = state if state is not None else DelayedState()
        self.weight_cache = weight_cache if weight_cache is not None else WeightCache()
        if compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        if lowering not in LOWERING_CHOICES:
            raise ValueError(f"lowering must be one of {LOWERING_CHOICES}, got {lowering!r}")
        self.compiler = compiler
        self.lowering = lowering
        self.paths_by_id = module_paths_by_id(model) if isinstance(model, torch.nn.Module) else None
        self.modules_by_path = (
            dict(model.named_modules()) if isinstance(model, torch.nn.Module) else None)
        self.mode = mode
        self.stats = stats
        self.decisions: list[Decision] = []
        self._buffer_frames: dict[int, int | None] = {}  # id(state or stats buffer) -> Dynamo frame id
        self.graph_modules: list[torch.fx.GraphModule] = []

    def unmatched_rules(self) -> list[int]:
        """Indices of the policy's rules that matched no site in any graph compiled so far."""
        matched = {d.rule_index for d in self.decisions}
        return [i for i in range(len(self.policy.rules)) if i not in matched]

    @property
    def graph_count(self) -> int:
        """How many graphs this backend compiled (recompiles and graph breaks add one each)."""
        return len(self.graph_modules)

    def run_passes(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> list[Decision]:
        device = _graph_device(example_inputs)
        value_of = _placeholder_values(gm, example_inputs)
        stats_placeholders = {id(value_of[n]): n for n in take_anchored_inputs(gm, stats_anchor)}
        state_placeholders = {id(value_of[n]): n for n in take_anchored_inputs(gm, state_anchor)}
        # A call fills the weights' FP8 copies or reuses them, never both: one kind of anchor per graph.
        fill, reuse = take_anchored_inputs(gm, fill_anchor), take_anchored_inputs(gm, reuse_anchor)
        cache_placeholders = {id(value_of[n]): n for n in fill + reuse}
        sites = find_sites(gm, example_inputs, self.paths_by_id)
        state_by_weight = self.state.by_weight()
        cache_by_weight = self.weight_cache.by_weight()

        def cache_nodes(site):
            buffers = cache_by_weight.get(id(value_of.get(site.weight_input)), ())
            nodes = tuple(cache_placeholders.get(id(buffer)) for buffer in buffers)
            return nodes if nodes and None not in nodes else None

        def state_nodes(site):
            entry = state_by_weight.get(id(value_of.get(site.weight_input)))
            if entry is None:
                return None
            nodes = tuple(state_placeholders.get(id(buffer)) for buffer in entry.buffers())
            return None if None in nodes else nodes

        decisions = annotate_sites(sites, self.policy,
                                   lambda recipe, is_linear: choose_lowering(device, self.lowering, recipe,
                                                                             batched=not is_linear),
                                   self.modules_by_path,
                                   has_state=lambda site: state_nodes(site) is not None)
        # Graphs compiled without gradients (inference) read the scales but
        # leave the histories alone; Dynamo compiles one graph per grad mode.
        def stats_nodes(site):
            buffer = self.stats.buffer_of(site.path) if self.stats is not None else None
            return stats_placeholders.get(id(buffer))

        # Sites that read one input share its cast; they must carry the same kinds of buffers.
        groups = group_sites(decisions, lambda d: (state_nodes(d.site) is not None, cache_nodes(d.site) is not None))
        rewrite_sites(gm, stats_nodes, state_nodes, update_state=torch.is_grad_enabled(), cache_nodes=cache_nodes,
                      weight_cache="reuse" if reuse else "fill", groups=groups)
        if torch.is_grad_enabled():
            self._claim_written_buffers([(d.site.path, stats_nodes(d.site)) for d in decisions
                                         if d.rewritten and stats_nodes(d.site) is not None], value_of)
        for decision in decisions:
            what = decision.recipe.name if decision.rewritten else f"kept: {decision.reason}"
            log.info("fp8graph: %s (%s) -> %s", decision.site.path or "<root>", decision.site.op, what)
        return decisions

    def _claim_written_buffers(self, path_and_node, value_of) -> None:
        """Refuse a stats buffer that training graphs of two code locations write.

        Forward and backward both write a stats buffer, so the backward gets
        it as the graph's forward left it and writes it back whole: with
        ``a(x); graph_break(); a(x)`` the first graph's backward would undo
        what the second graph recorded, and autograd refuses the buffer the
        second forward changed. Recompiles of one frame (new shapes) and DDP's
        pieces of one graph share a frame id and are fine: they do not
        interleave forwards and backwards. Delayed-scaling state has no such
        limit: the forward and the backward write buffers of their own
        (``fp8graph.buffers.delayed_state``).
        """
        compile_id = torch._guards.CompileContext.current_compile_id()
        frame = None if compile_id is None else compile_id.frame_id
        for path, node in path_and_node:
            claimed_by = self._buffer_frames.setdefault(id(value_of[node]), frame)
            if claimed_by != frame:
                raise ValueError(
                    f"fp8graph: module {path or '<root>'!r} has FP8 sites in two compiled graphs (a graph "
                    "break between its calls, or calls from two compiled functions) and its stats buffer is "
                    "written by both graphs' backward passes, which would overwrite each other. Remove the "
                    "graph break (see torch._dynamo.explain), or compile with stats=False")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]):
        decisions = self.run_passes(gm, example_inputs)
        compiled = self._lower(gm, example_inputs)
        # Recorded only once lowering succeeded: Dynamo may abort a compile by
        # an exception raised inside it (e.g. to restart analysis with a
        # Python scalar specialized) and call the backend again.
        self.decisions.extend(decisions)
        self.graph_modules.append(gm)
        return compiled

    def _lower(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]):
        if self.compiler == "eager":
            return gm.forward
        if self.compiler == "aot_eager":  # Dynamo's aot_eager, its partitioner preceded by the joint pass
            from torch._dynamo.backends.common import aot_autograd
            from torch._dynamo.backends.debugging import boxed_nop

            return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition_min_cut,
                                keep_inference_input_mutations=True)(gm, example_inputs)
        from torch._inductor import config as inductor_config
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        config_patches = dict(list_mode_options(self.mode) if self.mode else {})
        config_patches["joint_custom_pre_pass"] = joint_pre_pass(inductor_config.joint_custom_pre_pass)
        return compile_fx(gm, example_inputs, config_patches=config_patches)


def fp8_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode=None):
    """Entry point of ``torch.compile(..., backend="fp8", options={...})``.

    ``options`` may hold ``policy``, ``compiler`` and ``lowering`` (see :class:`FP8Backend`).
    """
    options = dict(options or {})
    if "stats" in options:
        raise ValueError("stats need fp8graph.compile(model, stats=True): they live in a buffer "
                         "that must be registered on the model before tracing")
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown fp8 backend option(s) {unknown}; known: {list(_OPTION_NAMES)}")
    return FP8Backend(mode=mode, **options)(gm, example_inputs)
