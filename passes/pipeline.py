"""The fp8 backend's passes over one Dynamo graph: the ordered list :data:`PASSES`, run by :func:`run_passes`.

    anchored_inputs         the buffers the model's hooks anchored become known graph inputs; anchors removed
    expand_attention        F.multi_head_attention_forward calls opened into the ops they run, GEMMs visible
    find_sites              every linear and matmul node, read into linear form
    annotate                each site's decision (a recipe and its GEMM lowering, or why it stays) in node.meta
    group_sites             decided sites that read one input, one cast of it
    expert_weight_copies    expert MLPs whose FP8 inputs together pay for weights' copies for grad_input
    rewrite                 decided sites replaced by fp8graph's targets, their buffers threaded in
    unpermute               in graphs with FP8 expert GEMMs, the tokens' order restored by a gather whose
                            backward gathers too (not index_put into zeros)
    check_gathered_weights  FSDP2's FP8-gathered weights are read only by FP8 sites of their recipe

Every pass has one signature, ``pass(state: PassState) -> None``: it rewrites ``state.gm`` in place and
writes what later passes read into ``state``. ``python -m fp8graph passes`` prints the list. Dynamo's graph
is not functional: after every pass the driver checks that each node with side effects (in-place writes,
RNG, opaque calls; ``side_effects``) is still there, once and in order, and refuses the graph otherwise.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Callable, Sequence

import torch
import torch.fx

from fp8graph.buffers.anchors import fill_anchor, reuse_anchor, state_anchor, state_read_anchor, stats_anchor
from fp8graph.buffers.delayed_state import DelayedState
from fp8graph.buffers.weight_cache import WeightCache
from fp8graph.fsdp.graph_check import check_gathered_weights
from fp8graph.gemm.scaled_gemm import choose_lowering
from fp8graph.recipes.plan import Plan
from fp8graph.recipes.policy import Policy

from .anchored_inputs import take_anchored_inputs
from .expand_attention import expand_attention
from .expert_sites import pool_weight_copies
from .annotate import annotate_sites
from .find_sites import find_sites
from .group_sites import group_sites
from .rewrite import rewrite_sites
from .side_effects import REPLACES_KEY, side_effect_nodes
from .sites import GroupedExpertSite
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
    plan: Plan | None = None  # every weight's plan (fp8graph.recipes.plan); None for a function
    # The graph is run by fp8graph's "eager" compiler (no AOTAutograd), not traced again: annotate's business.
    run_eagerly: bool = False


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


@dataclasses.dataclass
class PassState:
    """One graph on its way through the passes: what each pass reads from the ones before it and writes.

    Each field is written by one pass (named beside it) and only read after.
    """

    gm: torch.fx.GraphModule
    example_inputs: Sequence[object]
    context: PassContext
    device: torch.device = torch.device("cpu")
    value_of: dict = dataclasses.field(default_factory=dict)  # placeholder -> its real tensor
    buffers: "AnchoredBuffers | None" = None  # anchored_inputs
    sites: list = dataclasses.field(default_factory=list)  # find_sites
    decisions: list = dataclasses.field(default_factory=list)  # annotate
    groups: list = dataclasses.field(default_factory=list)  # group_sites
    copies_written: list = dataclasses.field(default_factory=list)  # rewrite: input positions of the copies filled


@dataclasses.dataclass
class AnchoredBuffers:
    """The graph inputs the model's hooks anchored, by kind, and the lookups of each site's buffers."""

    stats: dict  # id(stats buffer) -> placeholder
    state: dict  # id(delayed-state buffer) -> placeholder
    state_updated: set  # placeholders of the state a call updates (a training call of a training module)
    cache: dict  # id(FP8 weight copy) -> placeholder
    cache_filled: set  # the placeholders of the copies this call fills; it reads the others
    state_by_weight: dict
    cache_by_weight: dict
    value_of: dict
    stats_collector: object | None
    # In a graph that fills the copies, the one call of each tiled-recipe weight (by id of its value) that writes
    # and reads them (noted by ``annotate``); the weight's other calls there cast it themselves.
    tiled_writer: dict = dataclasses.field(default_factory=dict)
    # The one FP8 site that writes each stats buffer (by id of the buffer), noted by ``annotate``.
    stats_writer: dict = dataclasses.field(default_factory=dict)

    def note_stats_writers(self, decisions) -> None:
        """Choose the site that writes each module's stats (:attr:`stats_writer`): its last FP8 site in the graph.
        A module with two sites (an experts module's gate_up and down GEMMs, a module called twice) has one buffer
        of three rows; its forward rows come from the last site to run forward, but its grad_output row would come
        from the last to run backward, the first site. One writer keeps the three rows of one GEMM."""
        for decision in decisions:
            buffer = self._stats_buffer(decision.site)
            if decision.rewritten and id(buffer) in self.stats:
                self.stats_writer[id(buffer)] = decision.site.node

    def note_tiled_writers(self, decisions) -> None:
        """Choose the call that fills each tiled weight's copies (:attr:`tiled_writer`): a filling call reads the
        copies it wrote and saves them for its backward, so a second writer would change what the first saved
        (a layer called three times: autograd refuses the graph), and a reader could run before the writer (a
        call inside a checkpoint body, traced after the graph around it). One writes; the others cast the weight
        as without copies."""
        for decision in decisions:
            if not (decision.rewritten and decision.recipe.tiled and decision.site.has_weight):
                continue
            nodes = self._copies(decision)
            if nodes is not None and self._fills(nodes):
                self.tiled_writer.setdefault(self._weight_id(decision), decision.site.node)

    def _weight_id(self, decision) -> int:
        return id(self.value_of.get(decision.site.weight_input))

    def _fills(self, nodes: dict) -> bool:
        """Whether this graph's call writes the copies at ``nodes`` (the declaration's fill has not yet)."""
        return any(node in self.cache_filled for node in nodes.values())

    def _copies(self, decision):
        """The placeholders of the FP8 copies of the decision's weight by prefix, if they serve its recipe, else
        None."""
        recipe, buffers = self.cache_by_weight.get(self._weight_id(decision), (None, {}))
        nodes = {prefix: self.cache.get(id(buffer)) for prefix, buffer in buffers.items()}
        return nodes if nodes and None not in nodes.values() and recipe == decision.recipe else None

    def cache_nodes(self, decision):
        """The copies the decision's call takes (:meth:`_copies`): none for a tiled call of a filling graph that
        another call of its weight writes them in (:meth:`note_tiled_writers`)."""
        nodes = self._copies(decision)
        if nodes is None or not decision.recipe.tiled or not self._fills(nodes):
            return nodes
        return nodes if self.tiled_writer.get(self._weight_id(decision)) is decision.site.node else None

    def cache_mode(self, decision) -> str | None:
        """``"fill"`` or ``"reuse"``: what the call does with the decision's FP8 copies (a module's copies that the
        declaration's fill did not write are filled by a call that reads the others); None without copies."""
        nodes = self.cache_nodes(decision)
        if nodes is None:
            return None
        return "fill" if self._fills(nodes) else "reuse"

    def state_nodes(self, site):
        entry = self.state_by_weight.get(id(self.value_of.get(site.weight_input)))
        if entry is None:
            return None
        nodes = tuple(self.state.get(id(buffer)) for buffer in entry.buffers())
        return None if None in nodes else nodes

    def updates_state(self, site) -> bool:
        nodes = self.state_nodes(site)
        return nodes is not None and nodes[0] in self.state_updated

    def _stats_buffer(self, site):
        return self.stats_collector.buffer_of(site.path) if self.stats_collector is not None else None

    def stats_node(self, site):
        """The stats placeholder ``site`` writes: its module's, if it is the module's writer (:meth:`note_stats_writers`)."""
        buffer = self._stats_buffer(site)
        return self.stats.get(id(buffer)) if self.stats_writer.get(id(buffer)) is site.node else None

    def compatibility(self, decision) -> tuple:
        """Sites that share one cast of their input must carry the same kinds of buffers."""
        return (self.state_nodes(decision.site) is not None, self.updates_state(decision.site),
                self.cache_mode(decision))


def take_anchors(state: PassState) -> None:
    """The buffers the model's hooks anchored become known graph inputs; the anchors go."""
    gm, value_of = state.gm, state.value_of
    stats = {id(value_of[n]): n for n in take_anchored_inputs(gm, stats_anchor)}
    # Delayed state a call updates (its module trains) or only reads (eval mode); without gradients, only reads.
    updating = take_anchored_inputs(gm, state_anchor)
    delayed = {id(value_of[n]): n for n in take_anchored_inputs(gm, state_read_anchor) + updating}
    # Each module's FP8 weight copies are filled or read by the call (fp8graph.buffers.weight_cache's hooks).
    fill, reuse = take_anchored_inputs(gm, fill_anchor), take_anchored_inputs(gm, reuse_anchor)
    context = state.context
    state.buffers = AnchoredBuffers(
        stats=stats, state=delayed, state_updated=set(updating) if torch.is_grad_enabled() else set(),
        cache={id(value_of[n]): n for n in fill + reuse}, cache_filled=set(fill),
        state_by_weight=context.state.by_weight(), cache_by_weight=context.weight_cache.by_weight(),
        value_of=value_of, stats_collector=context.stats)


def open_attention(state: PassState) -> None:
    """``F.multi_head_attention_forward`` calls opened into the ops they run, their GEMMs visible."""
    for graph_module in Subgraphs(state.gm):
        expand_attention(graph_module)


def find(state: PassState) -> None:
    """Every linear and matmul node, read into linear form."""
    context = state.context
    state.sites = find_sites(state.gm, state.example_inputs, context.paths_by_id,
                             parameter_owners(context.modules_by_path))


def annotate(state: PassState) -> None:
    """Each site's decision (a recipe and its GEMM lowering, or why it stays) in ``node.meta``."""
    context, device, buffers = state.context, state.device, state.buffers
    state.decisions = annotate_sites(
        state.sites, context.policy,
        lambda recipe, site: choose_lowering(device, context.lowering, recipe, form=site.form),
        context.modules_by_path, has_state=lambda site: buffers.state_nodes(site) is not None,
        planned=lambda site: planned_entry(context.plan, site, state.value_of), run_eagerly=context.run_eagerly)
    buffers.note_tiled_writers(state.decisions)
    buffers.note_stats_writers(state.decisions)


def planned_entry(plan: Plan | None, site, value_of: dict):
    """The plan's entry of the weight ``site`` reads: the parameter behind its top-level placeholder."""
    if plan is None or not site.has_weight or site.weight_input is None:
        return None
    return plan.entry(value_of.get(site.weight_input))


def group(state: PassState) -> None:
    """Decided sites that read one input: one cast of it."""
    state.groups = group_sites(state.decisions, state.buffers.compatibility)


def pool_copies(state: PassState) -> None:
    """Expert MLPs whose FP8 inputs together pay for weights' copies for grad_input: noted on the sites."""
    trained = torch.is_grad_enabled()
    pool_weight_copies(state.decisions, lambda site: trained and getattr(
        state.value_of.get(site.weight_input), "requires_grad", False))


def rewrite(state: PassState) -> None:
    """Decided sites replaced by fp8graph's targets, their buffers threaded in."""
    buffers = state.buffers
    rewrite_sites(state.gm, buffers.stats_node, buffers.state_nodes, updates_state=buffers.updates_state,
                  cache_nodes=buffers.cache_nodes, cache_mode=buffers.cache_mode, groups=state.groups)
    # The copies this graph writes: its FP8 sites took them (a copy no site took stays unwritten).
    position = {node: index for index, node in enumerate(state.gm.graph.find_nodes(op="placeholder"))}
    state.copies_written = [position[node] for node in buffers.cache_filled if node.users and node in position]


def unpermute(state: PassState) -> None:
    """In graphs with FP8 expert GEMMs, the tokens' order restored by a gather whose backward gathers too."""
    for graph_module in {id(d.site.graph_module): d.site.graph_module for d in state.decisions
                         if d.rewritten and isinstance(d.site, GroupedExpertSite)}.values():
        unpermute_expert_outputs(graph_module)


def check_gathers(state: PassState) -> None:
    """FSDP2's FP8-gathered weights are read only by FP8 sites of their recipe (a check; changes nothing)."""
    for graph_module in Subgraphs(state.gm):
        check_gathered_weights(graph_module, state.value_of, state.decisions)


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """One pass: a name, and a function of the :class:`PassState` that rewrites ``state.gm`` in place."""

    name: str
    run: Callable[[PassState], None]

    @property
    def summary(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]


# The passes, in order. Each reads only what the ones before it wrote; the driver checks after each one that
# the graph's side effects are all still there, in order.
PASSES: tuple[GraphPass, ...] = (
    GraphPass("anchored_inputs", take_anchors),
    GraphPass("expand_attention", open_attention),
    GraphPass("find_sites", find),
    GraphPass("annotate", annotate),
    GraphPass("group_sites", group),
    GraphPass("expert_weight_copies", pool_copies),
    GraphPass("rewrite", rewrite),
    GraphPass("unpermute", unpermute),
    GraphPass("check_gathered_weights", check_gathers),
)


def describe_passes() -> str:
    """The pass list as ``python -m fp8graph passes`` prints it."""
    width = max(len(graph_pass.name) for graph_pass in PASSES)
    return "\n".join(f"{index}. {graph_pass.name:<{width}}  {graph_pass.summary}"
                     for index, graph_pass in enumerate(PASSES, 1))


def _side_effects_by_graph(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """Each graph's side-effect nodes, in order, each stamped in its meta: a copy of one (``node_copy``, or a
    copied ``meta``) carries the stamp too, which is how the check finds duplicates."""
    nodes_by_graph = [side_effect_nodes(graph_module) for graph_module in Subgraphs(gm)]
    for nodes in nodes_by_graph:
        for node in nodes:
            node.meta[_STAMP_KEY] = node
    return nodes_by_graph


_STAMP_KEY = "fp8graph_side_effect"


def _check_side_effects_kept(gm: torch.fx.GraphModule, before: list[list[torch.fx.Node]],
                             pass_name: str = "a pass") -> None:
    """Raise if ``pass_name`` deleted, duplicated or reordered a node with side effects that was in ``gm`` before.

    A node a pass replaced by the ops it runs (``expand_attention``) is kept where its replacements stand:
    they name it in ``node.meta[REPLACES_KEY]``.
    """
    after = {id(graph_module.graph): graph_module for graph_module in Subgraphs(gm)}
    for nodes in before:
        if not nodes:
            continue
        graph = nodes[0].graph
        kept = list(graph.nodes) if id(graph) in after else []
        order: dict = {}
        for index, node in enumerate(kept):
            order[node] = index
            if REPLACES_KEY in node.meta:
                order.setdefault(node.meta[REPLACES_KEY], index)
        stamps = collections.Counter(node.meta.get(_STAMP_KEY) for node in kept)
        lost = [node for node in nodes if node not in order]
        duplicated = [node for node in nodes if stamps[node] > 1]
        positions = [order[node] for node in nodes if node in order]
        if lost or duplicated or positions != sorted(positions):
            node = lost[0] if lost else duplicated[0] if duplicated else nodes[0]
            where = (node.meta.get("stack_trace") or "").strip().splitlines()[-1:] or ["<no user code>"]
            what = ("deleted" if lost else "duplicated" if duplicated else "reordered the graph's writes, e.g.")
            raise AssertionError(f"fp8graph: pass {pass_name} {what} {node.name} ({node.target}, {where[0].strip()}); "
                                 "Dynamo's graph keeps in-place writes and RNG as nodes nobody reads, and no pass may "
                                 "remove, copy or move them")


def run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[object], context: PassContext):
    """Run :data:`PASSES` over ``gm`` in place; returns ``(decisions, stats buffers written, copies written)``:
    every site's decision, ``[(module path, buffer)]`` of the stats buffers the rewritten sites write, and the
    positions among the graph's inputs of the FP8 weight copies its sites fill."""
    state = PassState(gm, example_inputs, context, device=graph_device(example_inputs),
                      value_of=placeholder_values(gm, example_inputs))
    for graph_pass in PASSES:
        before = _side_effects_by_graph(gm)
        graph_pass.run(state)
        _check_side_effects_kept(gm, before, graph_pass.name)
    stats_written = [(d.site.path, state.value_of[node]) for d in state.decisions
                     if d.rewritten and (node := state.buffers.stats_node(d.site)) is not None]
    return state.decisions, stats_written, state.copies_written
