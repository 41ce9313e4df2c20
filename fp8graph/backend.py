"""The ``fp8`` torch.compile backend.

Dynamo hands the backend an FX graph of torch-level ops with parameters as
placeholders. The backend runs the passes (``fp8graph.passes.pipeline``)
and compiles the rewritten graph through AOTAutograd and Inductor (or
``aot_eager`` for fast tests, or ``eager``)::

    torch.compile(model, backend="fp8")                         # default recipe
    torch.compile(model, backend="fp8", options={"policy": Float8CurrentScaling(Format.E4M3),
                                                 "compiler": "aot_eager"})

``backend="fp8"`` is found through the ``torch_dynamo_backends`` entry point.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.fx

from fp8graph.buffers.amax_reduction import sharded_over
from fp8graph.buffers.anchors import converted_buffers
from fp8graph.buffers.delayed_state import DelayedState
from fp8graph.buffers.kept_casts import ReuseScope
from fp8graph.buffers.weight_cache import WeightCache
from fp8graph.costs import running_gpu
from fp8graph.fsdp.install import fsdp_mesh
from fp8graph.gemm.scaled_gemm import LOWERING_CHOICES
from fp8graph.passes.annotate import Decision
from fp8graph.passes.module_paths import module_paths_by_id
from fp8graph.passes.pipeline import PassContext, graph_device, placeholder_values, run_passes
from fp8graph.inspection.slow_sites import SlowSite, casts_weights_per_call, slow_sites, warn_once
from fp8graph.instances import InstanceSignatures, served_decisions
from fp8graph.recipes.plan import Plan
from fp8graph.recipes.policy import normalize_policy
from fp8graph.targets.partitioning import joint_pre_pass, partition_min_cut
from fp8graph.targets.kept_copies import post_grad_post_pass

__all__ = ["FP8Backend", "fp8_backend"]

log = logging.getLogger("fp8graph")

COMPILERS = ("inductor", "aot_eager", "eager")
DEFAULT_COMPILER = "inductor"
_OPTION_NAMES = ("policy", "compiler", "lowering")


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
            ``model`` (``cache_weights``), or ``None``.
        plan: the :class:`fp8graph.recipes.plan.Plan` of ``model`` under ``policy`` (made here when ``None``).
            With policy rules, each graph is guarded on the plan signature of the modules its weights
            are read through (``fp8graph.instances``): instances the policy treats differently never
            share a compiled frame.
        decide_for_compiler: the compiler whose graphs the decisions are made for, when it is not ``compiler``
            (``explain`` runs with ``"eager"`` the graphs of a model compiled for another).

    Every graph's decisions are appended to ``self.decisions`` and each
    rewritten graph to ``self.graph_modules``. A graph traced for one instance of a module whose forward
    Dynamo compiles as a frame of its own serves every instance of its class with the same plan signature:
    their decisions are recorded too, under their own paths.
    """

    # Regions report every instance of their groups themselves (fp8graph.regions.regional_compile).
    records_served_instances = True

    def __init__(self, policy=None, compiler=DEFAULT_COMPILER, lowering="auto", model=None, mode=None, stats=None,
                 state=None, weight_cache=None, plan=None, report_slow_sites=True, decide_for_compiler=None):
        self.policy = normalize_policy(policy)
        if plan is not None and plan.policy != self.policy:
            raise ValueError("the plan was made for another policy than the backend's")
        self.plan = plan if plan is not None or not isinstance(model, torch.nn.Module) else Plan(model, self.policy)
        self.instances = InstanceSignatures.of(model, self.plan) if self.plan is not None else None
        if self.policy.needs_state and state is None:
            raise ValueError(
                "the policy uses DelayedScaling, whose amax histories and scales live in buffers that "
                "fp8graph.compile(model, policy=...) registers on the model before tracing; "
                "torch.compile(backend='fp8') and explain() of an uncompiled model cannot hold them. "
                "Use fp8graph.compile, and explain the compiled model")
        self.state = state if state is not None else DelayedState()
        self.weight_cache = weight_cache if weight_cache is not None else WeightCache(ReuseScope())
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
        self.pass_context = PassContext(self.policy, lowering, self.paths_by_id, self.modules_by_path, self.state,
                                        self.weight_cache, stats, self.plan,
                                        run_eagerly=(decide_for_compiler or compiler) == "eager")
        self.decisions: list[Decision] = []
        self._buffer_frames: dict[int, int | None] = {}  # id(state or stats buffer) -> Dynamo frame id
        self.graph_modules: list[torch.fx.GraphModule] = []
        # Functions Dynamo ran eagerly at the compiled model's first call (fp8graph.inspection.skipped_frames).
        self.frames_run_eagerly: list = []
        # Sites in FP8 modelled at several times their BF16 time on their GPU, warned of once a process
        # (fp8graph.inspection.slow_sites); explain shows every site's times instead.
        self.report_slow_sites = report_slow_sites
        self.slow_sites: list[SlowSite] = []

    def unmatched_rules(self) -> list[int]:
        """Indices of the policy's rules that matched no site in any graph compiled so far."""
        matched = {d.rule_index for d in self.decisions}
        return [i for i in range(len(self.policy.rules)) if i not in matched]

    @property
    def graph_count(self) -> int:
        """How many graphs this backend compiled (recompiles and graph breaks add one each)."""
        return len(self.graph_modules)

    def run_passes(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> list[Decision]:
        """Rewrite ``gm`` in place (``fp8graph.passes.pipeline``); returns every site's decision."""
        decisions, stats_written, self._copies_written = run_passes(gm, example_inputs, self.pass_context)
        if torch.is_grad_enabled():
            self._claim_written_buffers(stats_written)
        for decision in decisions:
            what = decision.recipe.name if decision.rewritten else f"kept: {decision.reason}"
            log.info("fp8graph: %s (%s) -> %s", decision.site.path or "<root>", decision.site.op, what)
        return decisions

    def _claim_written_buffers(self, path_and_buffer) -> None:
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
        for path, buffer in path_and_buffer:
            claimed_by = self._buffer_frames.setdefault(id(buffer), frame)
            if claimed_by != frame:
                raise ValueError(
                    f"fp8graph: module {path or '<root>'!r} has FP8 sites in two compiled graphs (a graph "
                    "break between its calls, or calls from two compiled functions) and its stats buffer is "
                    "written by both graphs' backward passes, which would overwrite each other. Remove the "
                    "graph break (see torch._dynamo.explain), or compile with stats=False")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]):
        root = (self.modules_by_path or {}).get("")
        converted = converted_buffers(root) if root is not None else []
        if converted:
            raise ValueError(
                f"fp8graph: {len(converted)} of fp8graph's buffers changed dtype after fp8graph.compile, e.g. "
                f"{', '.join(converted[:3])}: model.to(dtype), .half() or .bfloat16() converts every floating-point "
                "buffer. Call fp8graph.compile(model, ...) again after converting the model (it restores them), "
                "or convert before compiling")
        # The instances the graph's weights are read through, found before the passes take the anchors.
        roots = self.instances.roots(gm, placeholder_values(gm, example_inputs)) if self.instances else {}
        if self.instances is not None and self.policy.rules:  # without rules every instance resolves alike
            self.instances.guard(roots)
        mesh = fsdp_mesh(root) if root is not None else None
        with sharded_over(mesh):  # amaxes reduce over its groups
            decisions = self.run_passes(gm, example_inputs)
            compiled = _saying_what_it_fills(_run_under(mesh, self.compiler, self._compile_graph(gm, example_inputs)),
                                             self._copies_written, self.weight_cache)
        # Recorded only once compiling succeeded: Dynamo may abort a compile by
        # an exception raised inside it (e.g. to restart analysis with a
        # Python scalar specialized) and call the backend again.
        recorded = len(self.decisions)
        self.decisions.extend(decisions)
        if self.records_served_instances:
            for traced in roots:
                for instance in self.instances.alike(traced):
                    self.decisions.extend(served_decisions(decisions, traced, instance, self.plan))
        self.graph_modules.append(gm)
        self._report_slow_sites(self.decisions[recorded:], example_inputs)
        return compiled

    def _report_slow_sites(self, decisions: list[Decision], example_inputs: Sequence[object]) -> None:
        """List, and warn once of, each site of a CUDA graph that the cost model puts at several times its BF16
        time in FP8 on the GPU it runs on (:mod:`fp8graph.inspection.slow_sites`)."""
        from torch._inductor import config as inductor_config

        device = graph_device(example_inputs)
        if device.type != "cuda" or not self.report_slow_sites or not casts_weights_per_call(
                self.weight_cache.mode, torch.is_grad_enabled(), inductor_config.freezing):
            return
        listed = {slow.key for slow in self.slow_sites}
        slow = slow_sites(self._judged_decisions(decisions), running_gpu(device), torch.is_grad_enabled())
        self.slow_sites.extend(site for site in slow if site.key not in listed)
        warn_once(slow, log)

    def _judged_decisions(self, decisions: list[Decision]) -> list[Decision]:
        """The decisions of a graph just compiled whose sites :meth:`_report_slow_sites` judges."""
        return decisions

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]):
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
        config_patches["post_grad_custom_post_pass"] = post_grad_post_pass(inductor_config.post_grad_custom_post_pass)
        if _fills_tiled_copies_on_cpu(gm, example_inputs):
            # Inductor's C++ code fuses a fill's two casts of one weight (MXFP8's blocks along K and along N: both
            # read the weight) and then fails its loop split (torch 2.13); its Triton code compiles them fused.
            config_patches["cpp.max_horizontal_fusion_size"] = 1
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
    policy = normalize_policy(options.get("policy"))
    if policy.strict and policy.rules:
        raise ValueError(
            "a strict policy with rules needs fp8graph.compile(model, policy=...): strict=True raises for rules "
            "that match no site, which only a whole call of the model can tell, and torch.compile(backend='fp8') "
            "compiles each of its graphs on its own. fp8graph.explain(model, ...) lists the unmatched rules too")
    backend = FP8Backend(mode=mode, **options)
    compiled = backend(gm, example_inputs)
    if backend.unmatched_rules():  # another graph of the model may hold their sites: not a warning
        log.info("fp8graph: policy rules that match no site of this graph (torch.compile(backend='fp8') judges each "
                 "graph on its own; fp8graph.compile checks the whole model after its first call): %s",
                 ", ".join(policy.rule_label(i) for i in backend.unmatched_rules()))
    return compiled


def _run_under(mesh, compiler: str, compiled):
    """``compiled``, run inside :func:`sharded_over` ``mesh`` where ``compiler`` is ``"eager"``: its targets then
    resolve their amax reductions when they run, after the trace's :func:`sharded_over` has ended (a traced
    graph's reductions were resolved inside it)."""
    if compiler != "eager" or mesh is None:
        return compiled

    def run(*args):
        with sharded_over(mesh):
            return compiled(*args)

    return run


def _saying_what_it_fills(compiled, positions: list[int], cache: WeightCache):
    """``compiled``, telling ``cache`` after each run which FP8 weight copies it wrote (the inputs at
    ``positions``): the copies a later call may read (``WeightCache.written_by_a_run``). Told by the run, not the
    trace: a graph serves every instance of a region, and a call that runs eagerly writes nothing."""
    if not positions:
        return compiled

    def run(*args):
        boxed = len(args) == 1 and isinstance(args[0], list)  # one list of inputs, which the call empties
        inputs = args[0] if boxed else args
        written = [inputs[position] for position in positions]
        result = compiled(*args)
        cache.written_by_a_run(written)
        return result

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # called as Dynamo calls what it wraps
    return run


def _fills_tiled_copies_on_cpu(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Whether the graph runs on the CPU and fills a tiled recipe's kept weight copies (both GEMMs' casts)."""
    on_cpu = any(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in example_inputs)
    return on_cpu and any(getattr(node.target, "weight_cache", None) == "fill"
                          and getattr(getattr(node.target, "recipe", None), "tiled", False)
                          for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                          for node in module.graph.nodes)
