"""The fp8 backend's passes over one Dynamo graph, in order: :func:`run_passes`.

    anchored_inputs   the buffers the model's hooks anchored become known graph inputs; anchors removed
    expand_attention  F.multi_head_attention_forward calls opened into the ops they run, their GEMMs visible
    find_sites        every linear and matmul node, read into linear form
    annotate          each site's decision (a recipe and its GEMM lowering, or why it stays) in node.meta
    group_sites       decided sites that read one input, one cast of it
    rewrite           decided sites replaced by fp8graph's targets, their buffers threaded in
    unpermute         in graphs with FP8 expert GEMMs, the tokens' order restored by a gather whose backward
                      gathers too (not index_put into zeros)

Each pass reads only what the ones before it wrote; the report is built from the same decisions.
Dynamo's graph is not functional: the driver checks that the passes left every node with side effects
(in-place writes, RNG; ``side_effects``) in place and in order, and refuses the graph otherwise.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import torch
import torch.fx

from fp8graph.buffers.anchors import fill_anchor, reuse_anchor, state_anchor, state_read_anchor, stats_anchor
from fp8graph.buffers.delayed_state import DelayedState
from fp8graph.buffers.weight_cache import WeightCache
from fp8graph.fsdp.graph_check import check_gathered_weights
from fp8graph.gemm.scaled_gemm import choose_lowering
from fp8graph.recipes.policy import Policy

from .anchored_inputs import take_anchored_inputs
from .expand_attention import expand_attention
from .annotate import Decision, annotate_sites
from .find_sites import find_sites
from .group_sites import group_sites
from .rewrite import rewrite_sites
from .side_effects import side_effect_nodes
from .unpermute import unpermute_expert_outputs
from .subgraphs import Subgraphs

__all__ = ["PassContext", "run_passes"]


@dataclasses.dataclass
class PassContext:
    """What the passes need besides the graph: the policy, the requested lowering, the model's modules
    (``None`` for a function), and the buffers registered on it."""

    policy: Policy
    lowering: str
    paths_by_id: dict | None
    modules_by_path: dict | None
    state: DelayedState
    weight_cache: WeightCache
    stats: object | None  # an FP8Stats: its buffer_of(path)


def graph_device(example_inputs: Sequence[object]) -> torch.device:
    """Where the graph's GEMMs run: the device of its parameters (else of any tensor input)."""
    tensors = [value for value in example_inputs if isinstance(value, torch.Tensor)]
    parameters = [value for value in tensors if isinstance(value, torch.nn.Parameter)]
    for value in parameters or tensors:
        return value.device
    return torch.device("cpu")


def placeholder_values(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> dict:
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


def parameter_owners(modules_by_path: dict | None) -> dict[int, tuple[str, type]]:
    """``{id(parameter): (path, type)}`` of the module holding each parameter (a shared one: the first)."""
    owners: dict[int, tuple[str, type]] = {}
    for path, module in (modules_by_path or {}).items():
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), (path, type(module)))
    return owners


def _side_effects_by_graph(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    return [side_effect_nodes(graph_module) for graph_module in Subgraphs(gm)]


def _check_side_effects_kept(gm: torch.fx.GraphModule, before: list[list[torch.fx.Node]]) -> None:
    """Raise if a pass deleted or reordered a node with side effects that was in ``gm`` before."""
    after = {id(graph_module.graph): graph_module for graph_module in Subgraphs(gm)}
    for nodes in before:
        if not nodes:
            continue
        graph = nodes[0].graph
        kept = set(graph.nodes) if id(graph) in after else set()
        order = {node: index for index, node in enumerate(graph.nodes)}
        lost = [node for node in nodes if node not in kept]
        positions = [order[node] for node in nodes if node in kept]
        if lost or positions != sorted(positions):
            node = lost[0] if lost else nodes[0]
            where = (node.meta.get("stack_trace") or "").strip().splitlines()[-1:] or ["<no user code>"]
            what = f"deleted {node.name} ({node.target}, {where[0].strip()})" if lost else "reordered the graph's writes"
            raise AssertionError(f"fp8graph: a pass {what}; Dynamo's graph keeps in-place writes and RNG as "
                                 "nodes nobody reads, and no pass may remove or move them")


def run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[object], context: PassContext):
    """Rewrite ``gm`` in place; returns ``(decisions, stats buffers written)``: every site's decision, and
    ``[(module path, buffer)]`` of the stats buffers the rewritten sites write."""
    side_effects_before = _side_effects_by_graph(gm)
    device = graph_device(example_inputs)
    value_of = placeholder_values(gm, example_inputs)
    stats_placeholders = {id(value_of[n]): n for n in take_anchored_inputs(gm, stats_anchor)}
    # Delayed state a call updates (its module trains) or only reads (eval mode); without gradients, only reads.
    updating = take_anchored_inputs(gm, state_anchor)
    state_placeholders = {id(value_of[n]): n for n in take_anchored_inputs(gm, state_read_anchor) + updating}
    state_updated = set(updating) if torch.is_grad_enabled() else set()
    # A call fills the weights' FP8 copies or reuses them, never both: one kind of anchor per graph.
    fill, reuse = take_anchored_inputs(gm, fill_anchor), take_anchored_inputs(gm, reuse_anchor)
    cache_placeholders = {id(value_of[n]): n for n in fill + reuse}
    for graph_module in Subgraphs(gm):
        expand_attention(graph_module)
    sites = find_sites(gm, example_inputs, context.paths_by_id, parameter_owners(context.modules_by_path))
    state_by_weight = context.state.by_weight()
    cache_by_weight = context.weight_cache.by_weight()

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

    def updates_state(site):
        nodes = state_nodes(site)
        return nodes is not None and nodes[0] in state_updated

    def stats_nodes(site):
        buffer = context.stats.buffer_of(site.path) if context.stats is not None else None
        return stats_placeholders.get(id(buffer))

    decisions: list[Decision] = annotate_sites(
        sites, context.policy,
        lambda recipe, site: choose_lowering(device, context.lowering, recipe, batched=not site.is_linear,
                                             grouped=site.is_experts, gathered=site.is_gathered_experts),
        context.modules_by_path, has_state=lambda site: state_nodes(site) is not None)
    # Sites that read one input share its cast; they must carry the same kinds of buffers.
    groups = group_sites(decisions, lambda d: (state_nodes(d.site) is not None, updates_state(d.site),
                                               cache_nodes(d.site) is not None))
    rewrite_sites(gm, stats_nodes, state_nodes, updates_state=updates_state, cache_nodes=cache_nodes,
                  weight_cache="reuse" if reuse else "fill", groups=groups)
    for graph_module in {id(d.site.graph_module): d.site.graph_module for d in decisions
                         if d.rewritten and d.site.is_experts and not d.site.is_gathered_experts}.values():
        unpermute_expert_outputs(graph_module)
    _check_side_effects_kept(gm, side_effects_before)
    for graph_module in Subgraphs(gm):
        check_gathered_weights(graph_module, value_of, decisions)
    stats_written = [(d.site.path, value_of[node]) for d in decisions
                     if d.rewritten and (node := stats_nodes(d.site)) is not None]
    return decisions, stats_written
