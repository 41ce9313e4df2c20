"""Replace each site annotated with a recipe by an FP8 linear.

    before:  y = linear(x, w, b)          | y = addmm(b, x2d, w_kn)   | y = matmul(x, w_kn)
    after:   y = fp8graph_linear_<recipe>(x, w, b)                    | weight fed as w_kn.t()

    before:  q = linear(x, w_q); k = linear(x, w_k); v = linear(x, w_v)     (a group, ``group_sites``)
    after:   qkv = fp8graph_linears_<recipe>(x, [w_q, w_k, w_v], [None, None, None]); q = qkv[0]; ...
             (per-tensor and tiled recipes alike: one cast of x for the three GEMMs, and one of its transpose)

    before:  s = matmul(q, k_t)           | s = baddbmm(c, q, k_t)   (two activations, opted in by a rule)
    after:   s = fp8graph_matmul_<recipe>(q, k_t, None)  | s = fp8graph_matmul_<recipe>(q, k_t, c)

    before:  y = _grouped_mm(x, w.transpose(-2, -1), offs=o)  | y = _grouped_mm(x, w_ekn, offs=o)   (experts)
    after:   y = fp8graph_grouped_<recipe>(x, w, o)           | weight fed as w_ekn.transpose(-2, -1)

    before:  x = h[idx]; y = _grouped_mm(x, w.t(-2, -1), offs=o)      (the tokens gathered, read only here)
    after:   y = fp8graph_grouped_<recipe>(h, w, o, gather_index=idx)  h cast, FP8 rows gathered; x left unused

    before:  gate, up = _grouped_mm(x, w.t(-2, -1), offs=o).chunk(2, -1); a = silu(gate) * up   (read only so)
    after:   a = fp8graph_grouped_<recipe>_swiglu(x, w, o)     (fuses_neighbours: chunk, silu and product erased)

    before:  y = _grouped_mm(h, w.t(-2, -1), offs=o); out = (y * rw)[inv].view(T, k, N).sum(dim=1)   (the combine)
    after:   out = fp8graph_grouped_<recipe>_combine<k>(h, w, o, row_weights=rw, permutation=perm)  (fuses_neighbours:
             the product, gather, view and sum erased; inv, proven perm's inverse, left unread)

    before:  y = bmm(w[ids], x3)          | y = bmm(x3, w_ekn[ids])   (MoE decode, frozen weights)
    after:   y = fp8graph_gathered_<recipe>(x3, w, ids)  | weight fed as w_ekn.transpose(-2, -1)

With stats on, every FP8 call also takes its module's stats buffer:
``fp8graph_linear_<recipe>(x, w, b, stats)``, likewise for matmuls; a group's
call takes lists of its sites' buffers (``stats=[...]``, ``histories=[...]``).

Sites inside ``torch.utils.checkpoint`` bodies get the top-level stats and
state placeholders threaded in as extra operands of the region (see
``subgraphs``). Recomputation in backward then replays the casts on the
same functional inputs: the scales the first forward used, and one update.

The replacement keeps the original node's metadata (module stack, fake value,
stack trace) so later passes and error messages still point at the user's
code. Reads only ``node.meta[DECISION_KEY]``; every rewrite bumps
``counters["fp8graph"]["sites_rewritten"]``. It removes no node but the
sites it replaces: nothing else, dead or not (``side_effects``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Callable

import torch.fx
from torch._dynamo.utils import counters

from fp8graph.targets.cache_hash import mark_cacheable
from fp8graph.targets.gathered import gathered_fp8_target
from fp8graph.targets.grouped import fuses_neighbours, grouped_fp8_target, takes_swiglu_source
from fp8graph.targets.linear_tensorwise import linear_fp8_target, linears_fp8_target
from fp8graph.targets.linear_tiled import linear_tiled_target, linears_tiled_target
from fp8graph.targets.matmul import matmul_fp8_target

from fp8graph.buffers.snapshots import CONTEXT_FN_KEY, checkpoint_context_fn
from fp8graph.buffers.weight_cache import COPY_KEYWORDS

from .annotate import DECISION_KEY, Decision
from .sites import GatheredExpertSite, GroupedExpertSite, LinearSite, MatmulSite, Site
from .subgraphs import Subgraphs

__all__ = ["rewrite_sites"]

# The keyword a group of linears takes its members' copies under, a list each (per-tensor recipes: one copy and
# its scale; tiled ones also the transposed pair, but for square tiles).
_GROUP_KEYWORDS = {"cached_weight": "cached_weights", "cached_weight_scale": "cached_weight_scales",
                   "cached_weight_t": "cached_weights_t", "cached_weight_t_scale": "cached_weight_t_scales"}


def _weight_nk(graph: torch.fx.Graph, decision: Decision) -> torch.fx.Node:
    """The weight as (N, K) (experts: (E, N, K)), transposing a (K, N) parameter in the graph."""
    weight = decision.site.weight_node
    if not decision.site.weight_is_kn:
        return weight
    weight_t = graph.call_method("transpose", (weight, -2, -1))
    weight_value = weight.meta.get("example_value")
    if weight_value is not None:
        weight_t.meta["example_value"] = weight_value.transpose(-2, -1)
    return weight_t


def rewrite_sites(
    gm: torch.fx.GraphModule,
    stats_nodes: Callable[[Site], torch.fx.Node | None] = lambda site: None,
    state_nodes: Callable[[Site], tuple[torch.fx.Node, ...] | None] = lambda site: None,
    updates_state: Callable[[Site], bool] = lambda site: True,
    cache_nodes: Callable[[Decision], tuple[torch.fx.Node, ...] | None] = lambda decision: None,
    cache_mode: Callable[[Decision], str | None] = lambda decision: None,
    groups: list[list[Decision]] = (),
) -> int:
    """Rewrite every site whose decision carries a recipe; returns how many.

    Each FP8 site gets the stats buffer placeholder ``stats_nodes(site)``
    (see ``anchored_inputs``), when there is one.
    Delayed-scaling sites get their ``(history, scale, grad_history, grad_scale)`` placeholders from
    ``state_nodes(site)`` and update them where ``updates_state(site)``, else only read the scales.
    Sites whose weight has FP8 copies kept for their recipe get the copies'
    placeholders from ``cache_nodes(decision)``, and ``cache_mode(decision)`` (``"fill"``
    or ``"reuse"``) says what they do with them (see ``fp8graph.buffers.weight_cache``).
    The sites of each group of ``groups`` (``group_sites``) with more than one
    become one call; every other site a call of its own.
    """
    subgraphs = Subgraphs(gm)
    buffers = _Buffers(subgraphs, stats_nodes, state_nodes, cache_nodes, updates_state, cache_mode)
    grouped = {id(d.site.node): group for group in groups if len(group) > 1 for d in group}
    rewritten = 0
    # A site's operands were read before any rewrite: one may be an earlier
    # site's node (x @ w1 @ w2), replaced since. Look operands up here.
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}
    for graph_module in subgraphs:
        for node in list(graph_module.graph.nodes):
            decision = node.meta.get(DECISION_KEY)
            if decision is None or not decision.rewritten or node in replaced:
                continue
            group = grouped.get(id(node), [decision])
            _rewrite(graph_module, [_with_replaced_operands(d, replaced) for d in group], buffers, replaced)
            rewritten += len(group)
            counters["fp8graph"]["sites_rewritten"] += len(group)
    # No dead-code elimination here: Dynamo's graph is not functional, and FX's
    # counts an in-place method call whose result nobody reads as dead (see
    # ``side_effects``). What the rewrite leaves unused (a weight's ``.t()``)
    # AOTAutograd removes after functionalization.
    subgraphs.recompile()
    return rewritten


def _with_replaced_operands(decision: Decision, replaced: dict) -> Decision:
    return dataclasses.replace(decision, site=decision.site.with_operands(replaced))


class _Buffers:
    """The buffer operands a site's call takes, lifted into the graph module it lives in."""

    def __init__(self, subgraphs, stats_nodes, state_nodes, cache_nodes, updates_state, cache_mode):
        self.subgraphs, self.updates_state, self.cache_mode = subgraphs, updates_state, cache_mode
        self._stats_nodes, self._state_nodes, self._cache_nodes = stats_nodes, state_nodes, cache_nodes

    def _lift(self, nodes, gm):
        return None if nodes is None else tuple(self.subgraphs.lift(n, gm) for n in nodes)

    def _lift_by_keyword(self, nodes: dict | None, gm) -> dict | None:
        """Prefixed buffers' nodes lifted into ``gm``, by the keyword the targets take each under."""
        return None if nodes is None else {COPY_KEYWORDS[prefix]: self.subgraphs.lift(node, gm)
                                           for prefix, node in nodes.items()}

    def stats(self, decision: Decision, gm) -> torch.fx.Node | None:
        stats = self._stats_nodes(decision.site)
        return None if stats is None else self.subgraphs.lift(stats, gm)

    def state(self, decision: Decision, gm) -> tuple[torch.fx.Node, ...] | None:
        """``(history, scale, grad_history, grad_scale)`` of a delayed-scaling linear or expert site."""
        if not (decision.site.has_weight and decision.recipe.stateful):
            return None
        return self._lift(self._state_nodes(decision.site), gm)

    def cache(self, decision: Decision, gm) -> dict[str, torch.fx.Node] | None:
        """The FP8 copies of the site's weight kept for its recipe (``fp8graph.buffers.weight_cache.copy_layout``),
        by the keyword its target takes each under (``COPY_KEYWORDS``)."""
        if not (decision.site.has_weight and decision.recipe.caches_weights):
            return None
        return self._lift_by_keyword(self._cache_nodes(decision), gm)


def _linear_target(decision: Decision, state, cache, buffers: _Buffers, group: bool):
    """The target of a linear site's call, or of its group's (``group``), by its recipe's kind."""
    weight_cache = buffers.cache_mode(decision) if cache is not None else None
    if decision.recipe.tiled:  # no delayed-scaling state: nothing to update or snapshot
        make_tiled = linears_tiled_target if group else linear_tiled_target
        return make_tiled(decision.recipe, decision.lowering, weight_cache)
    updates = state is not None and buffers.updates_state(decision.site)
    in_checkpoint = updates and _prepare_checkpoint_region(decision.site)
    make = linears_fp8_target if group else linear_fp8_target
    return make(decision.recipe, decision.lowering, updates or state is None, in_checkpoint, weight_cache)


def _rewrite(gm: torch.fx.GraphModule, group: list[Decision], buffers: _Buffers, replaced: dict) -> None:
    """Replace the sites of ``group`` (one input, or a single site) by one call, inserted before the first."""
    graph = gm.graph
    first = group[0]
    site = first.site
    with graph.inserting_before(site.node):
        stats = [buffers.stats(d, gm) for d in group]
        states = [buffers.state(d, gm) for d in group]
        caches = [buffers.cache(d, gm) for d in group]
        if len(group) > 1:
            target = _linear_target(first, states[0], caches[0], buffers, group=True)
            args = (site.input_node, [_weight_nk(graph, d) for d in group], [d.site.bias_node for d in group])
            kwargs = {"stats": stats if any(n is not None for n in stats) else None}
            if states[0] is not None:
                kwargs.update(zip(("histories", "scales", "grad_histories", "grad_scales"),
                                  (list(buffers) for buffers in zip(*states))))
            if caches[0] is not None:  # a list a keyword: cached_weight -> cached_weights
                kwargs.update({_GROUP_KEYWORDS[keyword]: [cache[keyword] for cache in caches]
                               for keyword in caches[0]})
            call = graph.call_function(target, args, {k: v for k, v in kwargs.items() if v is not None})
            # The call is no site (its outputs are): it keeps the first site's module stack and trace.
            call.meta.update({k: v for k, v in site.node.meta.items() if k not in ("example_value", DECISION_KEY)})
            outputs = []
            for index, decision in enumerate(group):
                with graph.inserting_after(call if not outputs else outputs[-1]):
                    output = graph.call_function(operator.getitem, (call, index))
                output.meta.update(decision.site.node.meta)
                outputs.append(output)
            mark_cacheable(call, target)
        else:
            state, cache = states[0], caches[0]
            target, args, kwargs = _single_call(site, first, graph, state, cache, buffers)
            if cache is not None:
                kwargs.update(cache)
            if stats[0] is not None or state is not None:
                args = args + (stats[0],)
            if state is not None:
                args = args + state
            # A call that takes the combine reads its routing weights, made after the GEMM: it goes where the
            # combine's product was (read_combine: nothing between has side effects).
            with graph.inserting_before(site.combine_nodes[0] if _fuses_combine(first) else site.node):
                call = graph.call_function(target, args, kwargs)
            call.meta.update(site.node.meta)
            mark_cacheable(call, target)
            outputs = [call]
            if _fuses_swiglu(first):  # (silu(gate) * up, the GEMM's output): the SwiGLU in its place, the output in
                # the GEMM's, for the next site to cast SwiGLU from (fp8graph.targets.grouped.takes_swiglu_source)
                with graph.inserting_after(call):
                    gemm_output = graph.call_function(operator.getitem, (call, 1))
                    swiglu = graph.call_function(operator.getitem, (call, 0))
                gemm_output.meta.update(site.node.meta)
                gemm_output.meta.pop(DECISION_KEY, None)
                call.meta.pop("example_value", None)
                call.meta.pop("val", None)
                replaced[site.node] = gemm_output
                outputs = [swiglu]
    for decision, output in zip(group, outputs):
        replaced.setdefault(decision.site.node, output)
        node = decision.site.node
        fused = (decision.site.swiglu_nodes if _fuses_swiglu(decision)
                 else decision.site.combine_nodes if _fuses_combine(decision) else ())
        if fused:  # the call returns the last fused node's value: the nodes that computed it go
            *computed, last = fused
            output.meta.update({key: last.meta[key] for key in ("example_value", "val") if key in last.meta})
            last.replace_all_uses_with(output)
            replaced[last] = output
            for computed_node in (last, *reversed(computed)):  # pure ops, each read only by the next
                graph.erase_node(computed_node)
        node.replace_all_uses_with(replaced[node])
        graph.erase_node(node)


def _fuses_swiglu(decision: Decision) -> bool:
    """Whether the site's call takes the SwiGLU its output feeds (``fp8graph.targets.grouped.fuses_neighbours``)."""
    site = decision.site
    return isinstance(site, GroupedExpertSite) and bool(site.swiglu_nodes) \
        and fuses_neighbours(decision.recipe, decision.lowering)


def _fuses_combine(decision: Decision) -> bool:
    """Whether the site's call takes the experts' combine its output feeds (``fuses_neighbours``)."""
    site = decision.site
    return isinstance(site, GroupedExpertSite) and bool(site.combine_nodes) \
        and fuses_neighbours(decision.recipe, decision.lowering)


@functools.singledispatch
def _single_call(site: LinearSite, decision: Decision, graph: torch.fx.Graph, state, cache, buffers: _Buffers):
    """``(target, args, kwargs)`` of the FP8 call replacing one site of its kind, before its buffer operands."""
    weight = _weight_nk(graph, decision)
    target = _linear_target(decision, state, cache, buffers, group=False)
    return target, (site.input_node, weight, site.bias_node), {}


@_single_call.register
def _matmul_call(site: MatmulSite, decision: Decision, graph, state, cache, buffers):
    return matmul_fp8_target(decision.recipe), (site.input_node, site.other_node, site.bias_node), {}


@_single_call.register
def _grouped_call(site: GroupedExpertSite, decision: Decision, graph, state, cache, buffers):
    combine = _fuses_combine(decision)
    target = grouped_fp8_target(decision.recipe, decision.lowering, state is None or buffers.updates_state(site),
                                buffers.cache_mode(decision) if cache is not None else None, _fuses_swiglu(decision),
                                site.combine_top_k if combine else 0, site.pooled_weight_copy)
    kwargs = {"row_weights": site.combine_weights, "permutation": site.combine_permutation} if combine else {}
    # SwiGLU read by this site alone: cast from the first call's output, SwiGLU's value never stored (read again, it
    # is stored anyway, and casting it as given reads fewer bytes than the output it came from).
    source = _swiglu_source(site.input_node)
    if source is not None and site.gather_source is None and set(site.input_node.users) == {site.node} \
            and takes_swiglu_source(decision.recipe, decision.lowering):
        kwargs["swiglu_source"] = source
    if site.gather_source is None:
        return target, (site.input_node, _weight_nk(graph, decision), site.offsets_node), kwargs
    # Sorted tokens gathered from the hidden states: the call casts the source rows, then gathers.
    return (target, (site.gather_source, _weight_nk(graph, decision), site.offsets_node),
            {"gather_index": site.gather_index, **kwargs})


def _swiglu_source(input_node) -> torch.fx.Node | None:
    """The GEMM's output whose SwiGLU ``input_node`` is, where an expert call that took SwiGLU returned both
    (:func:`_rewrite`): ``getitem(call, 0)``'s ``getitem(call, 1)``; else None."""
    if not (isinstance(input_node, torch.fx.Node) and input_node.op == "call_function"
            and input_node.target is operator.getitem and input_node.args[1] == 0):
        return None
    call = input_node.args[0]
    if not getattr(call.target, "swiglu", False):
        return None
    return next((user for user in call.users if user.target is operator.getitem and user.args[1] == 1), None)


@_single_call.register
def _gathered_call(site: GatheredExpertSite, decision: Decision, graph, state, cache, buffers):
    """Decode: each row's expert weight picked by ``expert_ids``."""
    if cache is not None:
        raise AssertionError(f"{site.path}: the decode form is rewritten only where Inductor freezes the weights, "
                             "and frozen weights keep no FP8 copy between calls")
    return (gathered_fp8_target(decision.recipe, decision.lowering),
            (site.input_node, _weight_nk(graph, decision), site.expert_ids_node), {})


def _prepare_checkpoint_region(site: Site) -> bool:
    """Give the checkpoint region around a delayed-scaling site the policy that saves
    its state snapshots (see ``fp8graph.buffers.snapshots``); True when there is such a region."""
    region = site.checkpoint_region
    if region is None:
        return False
    if region.meta.get(CONTEXT_FN_KEY, checkpoint_context_fn) is not checkpoint_context_fn:
        raise AssertionError("annotate keeps delayed scaling out of regions with their own context_fn")
    region.meta[CONTEXT_FN_KEY] = checkpoint_context_fn
    return True
