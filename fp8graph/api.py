"""The public entry points: :func:`compile` and :func:`explain`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import logging

import torch
from torch._dynamo.utils import counters

from fp8graph import costs
from fp8graph.backend import DEFAULT_COMPILER, FP8Backend
from fp8graph.buffers.anchors import is_fp8graph_buffer, restore_buffer_dtypes
from fp8graph.compiled_module import make_compiled_fp8_module
from fp8graph.recipes.plan import CACHE_WHERE_POSSIBLE, Plan, choose_weight_cache, weight_copies_of
from fp8graph.recipes.policy import normalize_policy
from fp8graph.regions.regional_compile import BlockBackend, RegionalBackend, compile_regions, is_region_boundary
from fp8graph.regions.repeated_blocks import AUTO, find_blocks, find_trunks, group_blocks, is_auto, trunk_parts
from fp8graph.buffers.delayed_state import register_delayed_state
from fp8graph.inspection.report import ExplainReport, SiteRecord
from fp8graph.passes.module_paths import module_paths_by_id
from fp8graph.inspection.report_html import graph_outline
from fp8graph.inspection.skipped_frames import frames_skipped_since, unimplemented_now
from fp8graph.inspection.stats import FP8Stats
from fp8graph.buffers.kept_casts import reuse_scope_of
from fp8graph.buffers.weight_cache import CopiesCannotServe, register_weight_cache
from fp8graph.fsdp.install import install_fp8_all_gather

__all__ = ["compile", "explain"]

log = logging.getLogger("fp8graph")

_BACKEND_ATTRIBUTE = "fp8graph_backend"


def unwrap_data_parallel(model):
    """The user's module inside a ``DistributedDataParallel`` (or ``DataParallel``) wrapper.

    Policies, module paths, state buffers and statistics refer to it, so they
    read the same with and without DDP (``model.layers.0``, not
    ``module.model.layers.0``). FSDP2's ``fully_shard`` wraps nothing.
    """
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


def compile(model, policy=None, compiler: str = DEFAULT_COMPILER, lowering: str = "auto", stats: bool = False,
            freeze_weights: bool = False, cache_weights=CACHE_WHERE_POSSIBLE, regions=AUTO, fp8_all_gather: bool = True,
            **torch_compile_kwargs):
    """Compile ``model`` with its linear sites in FP8.

    Args:
        model: an ``nn.Module`` (or a function) to compile.
        policy: a :class:`fp8graph.Policy`; a bare recipe is shorthand for
            ``Policy(default=recipe)``; ``None`` gives every eligible linear
            site ``Float8CurrentScaling()``.
        compiler: ``"inductor"`` (default), ``"aot_eager"`` or ``"eager"``.
        lowering: ``"auto"`` (``_scaled_mm`` on CUDA SM >= 8.9, emulation
            elsewhere), ``"scaled_mm"`` or ``"emulated"``.
        stats: collect FP8 numerics statistics inside the compiled graphs
            (see :mod:`fp8graph.inspection.stats`); off by default and then free.
        freeze_weights: for inference: graphs compiled under ``torch.no_grad()``
            quantize each weight once, when compiling (Inductor's freezing
            folds the weight's FP8 copy into a constant), instead of on
            every call. Only for weights that no longer change: after an
            in-place update the frozen graphs mix folded old values with
            live new ones (Inductor's freezing contract), so compile again
            after loading new weights. Delayed-scaling scales and ``stats``
            work as without freezing; the scales fold with the weights.
            Training graphs are unaffected. Needs ``compiler="inductor"``.
        cache_weights: ``"auto"`` (default), ``True`` or ``False``: give each weight buffers for its FP8 casts
            (what its GEMMs read), used inside ``fp8graph.weights_unchanged(compiled)``: there the first call
            casts the weights and keeps the casts, and the others read them (gradient accumulation's
            micro-batches, an evaluation loop), so each weight is quantized once per declaration (see
            :mod:`fp8graph.buffers.weight_cache`). Outside a declaration every call casts its weights, bit for
            bit as ``False`` does, and the buffers hold no memory: fp8graph cannot see every change of a weight
            (a write through ``param.data``), so it reuses a cast only where the user says the weights are
            unchanged (:mod:`fp8graph.buffers.kept_casts`). Inside, one or two bytes per weight element, by
            recipe. Under Inductor a call that fills casts into the copies and its GEMMs read them
            (:mod:`fp8graph.targets.kept_copies`), and the calls that reuse skip the weights' casts.
            ``"auto"`` keeps them wherever they can work and a fill costs no more than casting per call, and
            says why not elsewhere (``fp8graph.plan``; :func:`fp8graph.recipes.plan.choose_weight_cache`):
            not for a function or a module without submodules, not with ``freeze_weights`` (which folds the
            copies instead), not under FSDP2 (whose FP8 all-gathers keep each shard's cast instead, inside
            the same declarations), nor a tiled recipe's matrices (their fill casts more: ``True`` keeps
            those). ``True`` refuses where copies cannot work; ``False`` gives no weight buffers.
        regions: which blocks to compile once for all their instances (see
            :mod:`fp8graph.regions.repeated_blocks`): ``"auto"`` (default) finds a model's
            repeated layers (HuggingFace ``_no_split_modules``, or an
            ``nn.ModuleList`` of one class), a list of classes or path globs
            names them, ``None`` compiles the whole model as one graph as
            ``torch.compile`` does. Instances the policy treats differently
            get regions of their own. ``"auto"`` means ``None`` with
            ``freeze_weights``: Inductor's freezing folds each layer's
            weights into its code, which then cannot serve another layer;
            and with ``fullgraph=True``, which asks for one graph where each
            region breaks the model's graph at its blocks.
            Each block instance gets a subclass of its class (same name) whose
            call enters the region while the compiled model runs and is the
            block's own call otherwise (see :mod:`fp8graph.regions.regional_compile`).
        fp8_all_gather: under FSDP2 (``fully_shard`` before compiling), all-gather each weight whose sites are
            all FP8 with one recipe as FP8 bytes and its scales instead of in high precision: half BF16's
            gathered bytes (MXFP8 gathers both its layouts: about BF16's), and the graph reads them instead of
            casting the gathered weight (see :mod:`fp8graph.fsdp`). ``fp8graph.explain`` lists how each weight
            is gathered and why.
        **torch_compile_kwargs: passed to ``torch.compile`` (``dynamic``, ``mode``, ...).

    Returns:
        The compiled module, as ``torch.compile`` returns it. Its
        ``fp8graph_backend.decisions`` lists what was decided for each site;
        with ``stats=True``, ``fp8graph_stats`` is the :class:`~fp8graph.inspection.stats.FP8Stats`.

    Example:
        >>> compiled = fp8graph.compile(model, policy=fp8graph.Float8CurrentScaling())
        >>> loss = compiled(input_ids, labels=input_ids).loss
    """
    for torch_only in ("options", "backend"):
        if torch_only in torch_compile_kwargs:
            raise TypeError(
                f"fp8graph.compile: {torch_only}= is torch.compile's; fp8graph.compile takes the backend's options as "
                f"its own arguments (policy=..., compiler=..., lowering=...), or call torch.compile(model, "
                f"backend='fp8', options={{'policy': ...}})")
    options = dict(policy=policy, compiler=compiler, lowering=lowering, stats=stats, freeze_weights=freeze_weights,
                   cache_weights=cache_weights, regions=regions, fp8_all_gather=fp8_all_gather, **torch_compile_kwargs)
    mode = torch_compile_kwargs.pop("mode", None)
    fullgraph = bool(torch_compile_kwargs.get("fullgraph", False))
    _check_options(model, compiler, stats, freeze_weights, cache_weights, regions, fp8_all_gather, fullgraph)
    user_model = unwrap_data_parallel(model)
    policy = normalize_policy(policy)
    cache_weights, copies_reason = choose_weight_cache(user_model, cache_weights, freeze_weights, fp8_all_gather)
    bare = _check_buffers_reach_the_graph(model, user_model, policy, stats, cache_weights)
    # Buffers on the user's modules, registered before anything is traced; those of an earlier compile
    # get back the dtypes a model.to(dtype) since may have changed.
    if isinstance(user_model, torch.nn.Module):
        restore_buffer_dtypes(user_model)
    collector = FP8Stats(user_model) if stats else None
    # Where the model's weights are declared unchanged (fp8graph.weights_unchanged): kept casts serve there only.
    scope = reuse_scope_of(user_model) if isinstance(user_model, torch.nn.Module) else None
    # What the policy gives every weight, decided here once; everything below reads it.
    plan = Plan(user_model, policy, weight_copies_of(cache_weights, freeze_weights), copies_reason,
                copies_everywhere=options["cache_weights"] is True) \
        if isinstance(user_model, torch.nn.Module) else None
    # Delayed state before the copies: where its buffer names are taken, the compile is refused with nothing added
    # (a refusal of the copies leaves the state, which the next compile continues).
    state = register_delayed_state(user_model, policy, plan) if policy.needs_state else None
    weight_cache = None
    if cache_weights:
        try:
            weight_cache = register_weight_cache(user_model, policy, scope, plan,
                                                 model if model is not user_model else None)
        except CopiesCannotServe as refused:
            if options["cache_weights"] is True:
                raise
            cache_weights, plan = False, Plan(user_model, policy, "per call", str(refused))
    all_gather = install_fp8_all_gather(user_model, policy, module_paths_by_id(user_model),
                                        dict(stats=stats, cache_weights=cache_weights), scope, plan) \
        if fp8_all_gather and isinstance(user_model, torch.nn.Module) else None
    blocks = find_blocks(user_model, None if freeze_weights or fullgraph else regions) \
        if isinstance(user_model, torch.nn.Module) else _no_blocks(regions)
    backend, session = _make_backends(
        dict(policy=policy, compiler=compiler, lowering=lowering, model=user_model, mode=mode, stats=collector,
             state=state, weight_cache=weight_cache, plan=plan), blocks, torch_compile_kwargs)
    compiled = torch.compile(model, backend=backend.root if session is not None else backend, **torch_compile_kwargs)
    # The compiled model's forward, innermost first: each wrapper calls the one before it.
    wrappers = [
        _traces_the_root_hooks(compiled, user_model) if bare and (stats or policy.needs_state) else None,
        _runs_with_regions(session, user_model) if session is not None else None,
        _checks_at_first_call(backend, session is not None) if isinstance(model, torch.nn.Module) else None,
        _traces_with_freezing if freeze_weights else None,
        _chooses_weight_cache_mode(weight_cache) if weight_cache is not None else None,
        _gathers_in_fp8(all_gather) if all_gather is not None else None,
    ]
    for wrap in wrappers:
        if wrap is not None:
            object.__setattr__(compiled, "forward", wrap(compiled.forward))
    # On the wrapper itself: OptimizedModule's setattr would forward to the user's model.
    object.__setattr__(compiled, _BACKEND_ATTRIBUTE, backend)
    backend.all_gather = all_gather
    object.__setattr__(compiled, "fp8graph_stats", collector)
    if isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):
        make_compiled_fp8_module(compiled, user_model, functools.partial(compile, **options))
    return compiled


def _check_options(model, compiler: str, stats: bool, freeze_weights: bool, cache_weights: bool, regions,
                   fp8_all_gather: bool = True, fullgraph: bool = False) -> None:
    for flag, value in (("stats", stats), ("freeze_weights", freeze_weights), ("cache_weights", cache_weights),
                        ("fp8_all_gather", fp8_all_gather)):
        if not isinstance(value, bool) and not (flag == "cache_weights" and value == CACHE_WHERE_POSSIBLE):
            # "false" would switch it on
            allowed = f"True, False or {CACHE_WHERE_POSSIBLE!r}" if flag == "cache_weights" else "True or False"
            raise TypeError(f"fp8graph.compile: {flag} must be {allowed}, got {value!r}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        what = "fp8graph.compile" if _BACKEND_ATTRIBUTE in vars(model) else "torch.compile"
        raise ValueError(
            f"fp8graph.compile: the model is already compiled by {what}; compiling its compiled form again would "
            "trace the first compile's wrapper. Pass the module itself (model._orig_mod) and give fp8graph.compile "
            "the torch.compile options (mode=..., dynamic=..., fullgraph=...), which it passes on")
    if freeze_weights and (compiler != "inductor" or not isinstance(model, torch.nn.Module)):
        raise ValueError("freeze_weights needs an nn.Module and compiler='inductor' (Inductor's freezing pass), "
                         f"got {type(model).__name__} and {compiler!r}")
    if freeze_weights and cache_weights is True:
        raise ValueError("freeze_weights and cache_weights both keep the weights' FP8 copies (folded into the "
                         "graph, or in buffers refreshed when a weight changes): choose one")
    for flag, value in (("stats", stats), ("cache_weights", cache_weights)):
        if value is True and not isinstance(model, torch.nn.Module):
            raise ValueError(f"{flag}=True needs an nn.Module: it keeps buffers on the model's modules")
    if freeze_weights and regions != AUTO and regions:
        raise ValueError("freeze_weights folds each layer's weights into its compiled code, which then cannot "
                         "serve the other instances of a region: use regions=None (or leave 'auto')")
    if fullgraph and regions != AUTO and regions:
        raise ValueError("fullgraph=True asks for the model as one graph, and regions compile each repeated block "
                         "as a graph of its own, breaking the model's graph at every block: use regions=None (or "
                         "leave 'auto')")


def _check_buffers_reach_the_graph(model, user_model, policy, stats: bool, cache_weights: bool) -> bool:
    """Whether ``user_model`` is a bare module (no submodules); refused where its buffers could not reach
    the graph."""
    bare = isinstance(user_model, torch.nn.Module) and next(user_model.children(), None) is None
    if bare and (cache_weights or ((stats or policy.needs_state) and model is not user_model)):
        what = "cache_weights=True" if cache_weights else "stats=True" if stats else "delayed scaling"
        raise ValueError(
            f"fp8graph: {what} needs a model with submodules{' inside DDP' if model is not user_model else ''}, "
            f"and this {type(user_model).__name__} has none: its buffers reach the graph through forward hooks, "
            "and Dynamo runs the compiled root module's hooks outside the graph. Wrap it, e.g. "
            "fp8graph.compile(torch.nn.Sequential(model), ...)")
    return bare


def _no_blocks(regions) -> list:
    if regions is not None and regions is not False and regions != AUTO:
        raise ValueError("regions name blocks of an nn.Module; a function has none")
    return []


def _make_backends(backend_kwargs: dict, blocks, torch_compile_kwargs: dict):
    """The backend to attach (an :class:`FP8Backend`, or a :class:`RegionalBackend` over blocks) and the session."""
    root = FP8Backend(**backend_kwargs)
    if not blocks:
        return root, None
    model, plan = backend_kwargs["model"], root.plan
    trunks = find_trunks(model, blocks, plan)
    session, block_backends = compile_regions(
        group_blocks(blocks + trunk_parts(trunks, blocks), plan), [trunk for _, trunk in trunks],
        lambda group: BlockBackend(group, **{**backend_kwargs, "plan": plan}), torch_compile_kwargs)
    order = {path: index for index, (path, _) in enumerate(model.named_modules())}
    return RegionalBackend(root, block_backends, order), session


def _runs_with_regions(session, user_model):
    """Let the blocks run their compiled regions while the compiled model runs (and only then).

    A HuggingFace model builds a KV cache in every forward unless told
    ``use_cache=False``, training forwards included, where nothing reads it;
    each layer then indexes the cache by its own number, Dynamo's guards
    tell the layers apart and the region recompiles once per layer. So a
    call in training mode that does not pass ``use_cache`` gets
    ``use_cache=False``: its output has no ``past_key_values``. Calls in
    eval mode (inference, generation) are left as they are.
    """
    use_cache = _use_cache_parameter(user_model)  # once, not on every call

    def wrap(forward):
        def forward_with_regions(*args, **kwargs):
            with session.active():
                return forward(*args, **_without_training_cache(user_model, use_cache, args, kwargs))

        return forward_with_regions

    return wrap


def _without_training_cache(user_model, use_cache: _UseCache | None, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with ``use_cache=False`` added where ``user_model`` trains and the call passed no ``use_cache``,
    by name or by position."""
    return _without_cache(use_cache, args, kwargs) if user_model.training else kwargs


def _without_cache(use_cache: _UseCache | None, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with ``use_cache=False`` added where the call passed no ``use_cache``, by name or by position."""
    if use_cache is None or "use_cache" in kwargs:
        return kwargs
    if use_cache.position is not None and len(args) > use_cache.position:
        return kwargs
    return {**kwargs, "use_cache": False}


@dataclasses.dataclass(frozen=True)
class _UseCache:
    """A forward's ``use_cache`` parameter: where a call may pass it by position (``None``: by name only)."""
    position: int | None


def _on_meta(model) -> bool:
    """Whether ``model``'s parameters are on the meta device (built there to be planned without memory)."""
    return isinstance(model, torch.nn.Module) and any(p.is_meta for p in model.parameters())


def _use_cache_parameter(model) -> _UseCache | None:
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return next((_UseCache(position if parameter.kind in positional else None)
                 for position, parameter in enumerate(parameters) if parameter.name == "use_cache"), None)


def _unmatched_rule_names(backend) -> list[str]:
    return [backend.policy.rule_label(i) for i in backend.unmatched_rules()]


def _refuse_unmatched_rules(backend) -> bool:
    """Raise, naming them, if a strict policy has rules that matched no site so far; else whether any did not."""
    unmatched = _unmatched_rule_names(backend)
    if unmatched and backend.policy.strict:
        raise ValueError(f"fp8graph: policy rules that match no site: {', '.join(unmatched)}")
    return bool(unmatched)


def _checks_at_first_call(backend, with_regions: bool):
    """After the first call (which compiled every graph it ran), refuse or report rules that matched no site, and
    report the functions Dynamo ran eagerly (whose own GEMMs no graph holds).

    A strict policy raises ``ValueError`` naming the rules, as :func:`explain`
    does; otherwise the ``fp8graph`` logger warns once. Sites in graphs that
    only later calls compile (another branch of the model) are not waited for.
    """
    def wrap(forward):
        checked = False

        def forward_checking_first_call(*args, **kwargs):
            nonlocal checked
            if checked:
                return forward(*args, **kwargs)
            before, graphs_before = unimplemented_now(), backend.graph_count
            output = forward(*args, **kwargs)
            checked = True
            if _refuse_unmatched_rules(backend):
                log.warning("fp8graph: policy rules that match no site: %s", ", ".join(_unmatched_rule_names(backend)))
            skipped_frames = frames_skipped_since(before)
            backend.frames_run_eagerly.extend(skipped_frames)
            for skipped in skipped_frames:
                if skipped.recompile_limit and backend.graph_count == graphs_before:  # the call's own frame
                    log.warning("fp8graph: Dynamo ran the call eagerly (%s): nothing of it compiled, every site runs "
                                "in high precision", skipped.why)
                    continue
                log.warning("fp8graph: Dynamo ran %s eagerly (%s): a GEMM in that function's own code stays in high "
                            "precision (the modules it calls compile on their own)%s", skipped.where, skipped.why,
                            _REGIONS_IN_A_LOOP if with_regions else "")
            return output

        return forward_checking_first_call

    return wrap


# A model whose own forward calls its blocks in a loop: each region call is a graph break inside the loop.
_REGIONS_IN_A_LOOP = ("; a forward that calls the model's repeated blocks in a loop breaks at each block (a region "
                      "of its own): compile with regions=None to trace it whole, in a new process or after "
                      "torch._dynamo.reset() (Dynamo skips a function it skipped once for the rest of the process)")


def _find_compiled(model):
    """The :func:`compile` result in ``model`` (itself, or inside DDP and torch.compile layers), or ``None``."""
    while model is not None:
        if _BACKEND_ATTRIBUTE in getattr(model, "__dict__", {}):
            return model
        inner = unwrap_data_parallel(model)
        if inner is model and isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            inner = model._orig_mod
        model = None if inner is model else inner
    return None


def _traces_the_root_hooks(compiled, module: torch.nn.Module):
    """Compile a call of ``module`` itself, so Dynamo inlines its own hooks into the graph.

    ``torch.compile(module)`` compiles the module's forward and runs its own
    hooks outside the graph; a module without submodules (a bare
    ``nn.Linear``) has no other hooks to bring its delayed-scaling state or
    stats buffer into the graph, so fp8graph compiles a function that calls it
    (in place of the compiled forward: this wrapper comes first).
    """
    def call_module(*args, **kwargs):
        return module(*args, **kwargs)

    return lambda forward: compiled.dynamo_ctx(call_module)


def _chooses_weight_cache_mode(weight_cache):
    """Before each call, decide whether it fills or reuses the weights' FP8 copies."""
    def wrap(forward):
        def forward_with_weight_cache(*args, **kwargs):
            weight_cache.before_call()
            output = forward(*args, **kwargs)
            weight_cache.after_call()
            return output

        return forward_with_weight_cache

    return wrap


def _gathers_in_fp8(plan):
    """Before each call, the FP8 all-gathers' amaxes are reduced afresh (``fp8graph.fsdp.shard_casts``)."""
    def wrap(forward):
        def forward_gathering_fp8(*args, **kwargs):
            plan.before_call()
            return forward(*args, **kwargs)

        return forward_gathering_fp8

    return wrap


def _traces_with_freezing(forward):
    """Make the compiled model trace and compile with Inductor's ``freezing`` on.

    Dynamo reads the flag too: only with it does a graph compiled without
    gradients get its parameters as constants (graph attributes) rather than
    inputs. The flag is set for the duration of each call, not globally.
    """
    from torch._inductor import config as inductor_config

    def forward_with_freezing(*args, **kwargs):
        with inductor_config.patch(freezing=True):
            return forward(*args, **kwargs)

    return forward_with_freezing


@contextlib.contextmanager
def _classes_restored(model):
    """Give every module of ``model`` (None: none) back the class it had on entry, on exit."""
    classes = {module: type(module) for module in model.modules()} if isinstance(model, torch.nn.Module) else {}
    try:
        yield
    finally:
        for module, cls in classes.items():
            if type(module) is not cls:
                module.__class__ = cls


@contextlib.contextmanager
def _model_state_kept(model):
    """Give ``model``'s own buffers the values they held on entry, and the random number generators their state,
    on exit.

    explain's run is a forward in the model's mode: in training mode it updates a BatchNorm's running statistics
    and draws dropout masks, which a user explaining between training steps must not find changed. Only the
    buffers of modules in training mode are kept (by convention an eval-mode forward changes no buffer), and
    only a buffer the run changed is written back: one saved for a backward still to run keeps its version
    otherwise. A buffer the run rebound (a cache a forward rebuilds, with attributes
    that describe it) is left as the run left it, as is an inference tensor (it keeps no version). fp8graph's
    own buffers are left as the run leaves them: it records no delayed-scaling state without gradients, and the
    weight copies it fills are marked stale. A buffer on the meta device has no values to keep.
    """
    kept, seen = [], set()  # (module, name, the buffer, its version, its values)
    if isinstance(model, torch.nn.Module):
        for module in model.modules():
            for name, buffer in module._buffers.items() if module.training else ():
                if (buffer is None or buffer.is_inference() or buffer.is_meta or id(buffer) in seen
                        or is_fp8graph_buffer(module, name)):  # a meta buffer holds no values to keep
                    continue
                seen.add(id(buffer))
                kept.append((module, name, buffer, buffer._version, buffer.detach().clone()))
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, version, values in kept:
                # A kernel may write a buffer without moving its version (BatchNorm's running statistics)
                if module._buffers.get(name) is buffer and (buffer._version != version
                                                            or not torch.equal(buffer, values)):
                    buffer.copy_(values)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def explain(model, *args, policy=None, lowering: str = "auto", regions=AUTO, gpu="H100", **kwargs) -> ExplainReport:
    """Trace ``model(*args, **kwargs)`` and report what fp8graph does with each site.

    A model returned by :func:`compile` (also inside a DDP wrapper) is
    explained with its own policy and lowering. The model runs once, without gradients, on the rewritten graph;
    its buffers (a BatchNorm's running statistics) and the random number generators are given back as they were.
    An uncompiled model is explained with the blocks ``regions`` selects (as
    :func:`compile` takes it); a compiled one with its own regions. A model on the meta device (planned without
    its memory) is traced as one graph and without a KV cache (``use_cache=False``).
    Policy rules that match no site are listed in ``report.unmatched_rules``
    (a strict policy raises ``ValueError`` instead). Each site with a known GEMM shape carries its
    modelled kernel time per training call on ``gpu`` (``"H100"``, ``"H200"``, ``"B200"``, a
    :class:`fp8graph.costs.GPU`, or ``None`` for none) in BF16 and in its recipe (:mod:`fp8graph.costs`).
    Nothing else the process compiled is touched: Dynamo keeps a compiled frame for
    the backend it was compiled with, so explain's run compiles the model's frames for
    its own backend, beside (never instead of) what ``torch.compile`` or
    :func:`compile` compiled before, and those run on without recompiling.

    Returns:
        An :class:`ExplainReport`: a list of :class:`SiteRecord` with counts per
        recipe and reason, the rewritten graphs' code and graph breaks;
        ``print()`` it for a table, ``report.to_html(path)`` for a page that
        draws the rewritten graphs.
    """
    if gpu is not None:
        gpu = costs.gpu(gpu)  # an unknown name fails here, before anything is traced
    compiled = _find_compiled(model)
    state = weight_cache = blocks = all_gather = None
    if compiled is not None and (policy is not None or lowering != "auto" or not is_auto(regions)):
        raise ValueError("fp8graph.explain: this model was compiled by fp8graph.compile and is explained with its "
                         "own policy, lowering and regions; policy=, lowering= and regions= are for an uncompiled "
                         "model: explain a fresh one to try them")
    if compiled is not None:
        compiled_backend = vars(compiled)[_BACKEND_ATTRIBUTE]
        policy, lowering = compiled_backend.policy, compiled_backend.lowering
        state, weight_cache = compiled_backend.state, compiled_backend.weight_cache
        all_gather = compiled_backend.all_gather
        blocks = [(path, module) for group in getattr(compiled_backend, "groups", [])
                  for path, module in zip(group.paths, group.modules)]
        model = compiled  # what was compiled, without the wrappers around it (DDP(compiled), ...)
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod  # trace the user's module, not the wrapper of another compile
    user_model = unwrap_data_parallel(model)
    policy = normalize_policy(policy)
    on_meta = _on_meta(user_model)
    if on_meta and compiled is None and not (is_auto(regions) or regions is None or regions is False):
        raise ValueError("fp8graph.explain: the model is on the meta device, and regions run the code between "
                         "them eagerly, which reads values a meta tensor does not hold: explain it with "
                         "regions='auto' or None (both trace the whole model there)")
    if blocks is None:  # explained as fp8graph.compile would compile it; on meta as one graph (above)
        blocks = find_blocks(user_model, regions) if isinstance(user_model, torch.nn.Module) and not on_meta else []
    if on_meta:  # a KV cache made on meta holds tensors outside Dynamo's trace; the sites are the same without it
        kwargs = _without_cache(_use_cache_parameter(user_model), args, kwargs)
    # An uncompiled model's blocks become regions for explain's run alone: their classes are given back after it.
    with _classes_restored(user_model if compiled is None else None), _model_state_kept(user_model):
        backend, session = _make_backends(
            dict(policy=policy, compiler="eager", lowering=lowering, model=user_model, state=state,
                 weight_cache=weight_cache, report_slow_sites=False,
                 decide_for_compiler=compiled_backend.compiler if compiled is not None else DEFAULT_COMPILER),
            blocks, {})
        root_backend = backend.root if session is not None else backend
        if weight_cache is not None:  # explain's run fills the copies: they may be stale or empty
            weight_cache.invalidate()
            weight_cache.before_call()
        graph_breaks_before, unimplemented_before = collections.Counter(counters["graph_break"]), unimplemented_now()
        with torch.no_grad(), session.active() if session is not None else contextlib.nullcontext():
            if all_gather is not None:  # explain's run gathers as the compiled model's call without gradients does
                all_gather.before_call()
            if session is not None:  # called as the compiled model calls it
                kwargs = _without_training_cache(user_model, _use_cache_parameter(user_model), args, kwargs)
            torch.compile(model, backend=root_backend)(*args, **kwargs)
    graph_breaks = [reason for reason in
                    (collections.Counter(counters["graph_break"]) - graph_breaks_before).elements()
                    if not is_region_boundary(reason)]
    # A compiled model's first call met them (Dynamo skips a frame once, for every backend).
    skipped_frames = (compiled_backend.frames_run_eagerly if compiled is not None else []) + \
        frames_skipped_since(unimplemented_before)
    graph_breaks += [f"ran eagerly: {skipped}" for skipped in dict.fromkeys(skipped_frames)]
    if backend.graph_count == 0:
        # Dynamo counts a frame's skip once: a frame it gave up on earlier in the process (its recompile_limit
        # reached by the models of one class compiled before) runs eagerly now without a new count.
        ran_eagerly = "".join(f"; Dynamo ran {skipped} eagerly" for skipped in dict.fromkeys(skipped_frames)) or (
            "; Dynamo ran it eagerly, likely a frame it gave up on earlier in this process (its recompile_limit "
            "reached by the models of one class compiled before: torch._dynamo.reset() between models); "
            "TORCH_LOGS=recompiles,graph_breaks says why")
        raise RuntimeError(f"Dynamo captured no graph of {type(model).__name__}: nothing to explain{ran_eagerly}")
    _refuse_unmatched_rules(backend)
    unmatched = _unmatched_rule_names(backend)
    paths_by_id = module_paths_by_id(user_model) if isinstance(user_model, torch.nn.Module) else None
    return ExplainReport(
        [SiteRecord.from_decision(d, backend.policy, gpu) for d in backend.decisions],
        backend.graph_count,
        unmatched_rules=unmatched,
        graph_breaks=graph_breaks,
        graph_code=[gm.code for gm in backend.graph_modules],
        graph_outlines=[graph_outline(gm, paths_by_id) for gm in backend.graph_modules],
        all_gathers=all_gather.records if all_gather is not None else [],
    )
