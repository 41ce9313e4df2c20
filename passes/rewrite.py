"""Replace each site annotated with a recipe by an FP8 linear.

    before:  y = linear(x, w, b)          | y = addmm(b, x2d, w_kn)   | y = matmul(x, w_kn)
    after:   y = fp8graph_linear_<recipe>(x, w, b)                    | weight fed as w_kn.t()

    before:  s = matmul(q, k_t)           | s = baddbmm(c, q, k_t)   (two activations, opted in by a rule)
    after:   s = fp8graph_matmul_<recipe>(q, k_t, None)  | s = fp8graph_matmul_<recipe>(q, k_t, c)

With stats on, every FP8 call also takes its module's stats buffer:
``fp8graph_linear_<recipe>(x, w, b, stats)``, likewise for matmuls.

Sites inside ``torch.utils.checkpoint`` bodies get the top-level stats and
state placeholders threaded in as extra operands of the region (see
``subgraphs``). Recomputation in backward then replays the casts on the
same functional inputs: the scales the first forward used, and one update.

The replacement keeps the original node's metadata (module stack, fake value,
stack trace) so later passes and error messages still point at the user's
code. Reads only ``node.meta[DECISION_KEY]``; every rewrite bumps
``counters["fp8graph"]["sites_rewritten"]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch.fx
from torch._dynamo.utils import counters

from fp8graph.cache_hash import mark_cacheable
from fp8graph.linear_fp8 import linear_fp8_target
from fp8graph.linear_tiled import linear_tiled_target
from fp8graph.matmul_fp8 import matmul_fp8_target

from fp8graph.recipes import DelayedScaling, Float8CurrentScaling, TiledRecipe
from fp8graph.recompute import CONTEXT_FN_KEY, checkpoint_context_fn

from .annotate import DECISION_KEY, Decision
from .find_sites import Site
from .subgraphs import Subgraphs

__all__ = ["rewrite_sites"]


def _weight_nk(graph: torch.fx.Graph, decision: Decision) -> torch.fx.Node:
    """The weight as (N, K), transposing a (K, N) parameter in the graph."""
    weight = decision.site.weight_node
    if not decision.site.weight_is_kn:
        return weight
    weight_t = graph.call_method("t", (weight,))
    weight_value = weight.meta.get("example_value")
    if weight_value is not None:
        weight_t.meta["example_value"] = weight_value.t()
    return weight_t


def rewrite_sites(
    gm: torch.fx.GraphModule,
    stats_nodes: Callable[[Site], torch.fx.Node | None] = lambda site: None,
    state_nodes: Callable[[Site], tuple[torch.fx.Node, torch.fx.Node] | None] = lambda site: None,
    update_state: bool = True,
    cache_nodes: Callable[[Site], tuple[torch.fx.Node, torch.fx.Node] | None] = lambda site: None,
    weight_cache: str | None = None,
) -> int:
    """Rewrite every site whose decision carries a recipe; returns how many.

    Each FP8 site gets the stats buffer placeholder ``stats_nodes(site)``
    (see ``anchored_inputs``), when there is one.
    Delayed-scaling sites get their ``(history, scale)`` placeholders from
    ``state_nodes(site)`` and update them unless ``update_state`` is False.
    Current-scaling sites whose weight has an FP8 copy get its ``(copy, scale)``
    placeholders from ``cache_nodes(site)`` and ``weight_cache`` (``"fill"``
    or ``"reuse"``) says what they do with it (see ``fp8graph.weight_cache``).
    """
    subgraphs = Subgraphs(gm)
    rewrite = functools.partial(_rewrite_graph, subgraphs, stats_nodes=stats_nodes, state_nodes=state_nodes,
                                update_state=update_state, cache_nodes=cache_nodes, weight_cache=weight_cache)
    rewritten = sum(rewrite(graph_module) for graph_module in subgraphs)
    subgraphs.recompile()
    return rewritten


def _prepare_checkpoint_region(site: Site) -> bool:
    """Give the checkpoint region around a delayed-scaling site the policy that saves
    its state snapshots (see ``fp8graph.recompute``); True when there is such a region."""
    region = site.checkpoint_region
    if region is None:
        return False
    if region.meta.get(CONTEXT_FN_KEY, checkpoint_context_fn) is not checkpoint_context_fn:
        raise AssertionError("annotate keeps delayed scaling out of regions with their own context_fn")
    region.meta[CONTEXT_FN_KEY] = checkpoint_context_fn
    return True


def _rewrite_graph(subgraphs: Subgraphs, gm, stats_nodes, state_nodes, update_state, cache_nodes,
                   weight_cache) -> int:
    """The rewrite of one graph module; top-level buffers are threaded into bodies that need them."""
    graph = gm.graph
    rewritten = 0
    # A site's operands were read before any rewrite: one may be an earlier
    # site's node (x @ w1 @ w2), replaced since. Look operands up here.
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        decision = node.meta.get(DECISION_KEY)
        if decision is None or not decision.rewritten:
            continue
        site = dataclasses.replace(decision.site, **{
            field: replaced.get(getattr(decision.site, field), getattr(decision.site, field))
            for field in ("input_node", "other_node", "bias_node")})
        decision = dataclasses.replace(decision, site=site)
        state = state_nodes(site) if site.is_linear and isinstance(decision.recipe, DelayedScaling) else None
        state = None if state is None else tuple(subgraphs.lift(n, gm) for n in state)
        stats = stats_nodes(site)
        stats = None if stats is None else subgraphs.lift(stats, gm)
        cache = cache_nodes(site) if site.is_linear and type(decision.recipe) is Float8CurrentScaling else None
        cache = None if cache is None else tuple(subgraphs.lift(n, gm) for n in cache)
        kwargs = {} if cache is None else dict(zip(("cached_weight", "cached_weight_scale"), cache))
        with graph.inserting_before(node):
            if isinstance(decision.recipe, TiledRecipe):
                target = linear_tiled_target(decision.recipe, decision.lowering)
                args = (site.input_node, _weight_nk(graph, decision), site.bias_node)
            elif site.is_linear:
                in_checkpoint = state is not None and update_state and _prepare_checkpoint_region(site)
                target = linear_fp8_target(decision.recipe, decision.lowering, update_state or state is None,
                                           in_checkpoint, weight_cache if cache is not None else None)
                args = (site.input_node, _weight_nk(graph, decision), site.bias_node)
            else:
                target = matmul_fp8_target(decision.recipe)
                args = (site.input_node, site.other_node, site.bias_node)
            if stats is not None or state is not None:
                args = args + (stats,)
            if state is not None:
                args = args + state
            fp8_node = graph.call_function(target, args, kwargs)
        fp8_node.meta.update(node.meta)
        mark_cacheable(fp8_node, target)
        replaced[node] = fp8_node
        node.replace_all_uses_with(fp8_node)
        graph.erase_node(node)
        rewritten += 1
        counters["fp8graph"]["sites_rewritten"] += 1
    graph.eliminate_dead_code()
    return rewritten
