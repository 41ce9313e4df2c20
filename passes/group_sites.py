"""Group the FP8 linear sites that read one input, so that the input is cast once for all of them.

    before:  q = fp8 linear(x, w_q)     k = fp8 linear(x, w_k)     v = fp8 linear(x, w_v)
    after:   q, k, v = fp8 linears(x, [w_q, w_k, w_v])          one cast of x (and of its transpose),
                                                                  one amax, one scale; three GEMMs

A decoder layer has two such groups: the attention's q, k and v projections,
and the MLP's gate and up projections. Apart, each site casts the input
itself: with current scaling Inductor then stores the same FP8 tensor once per
GEMM, with delayed scaling each site has its own scale and every cast is a
pass of its own. Linears group (not expert GEMMs), with per-tensor recipes (their GEMMs share one input
scale) and tiled ones (one cast of the input in each layout, forward and backward); sites group when they are
rewritten linears of the same graph and checkpoint region with the same recipe, lowering and ``compatible`` key
(which buffers they carry), read the same input node through distinct
weights, and have every operand defined before the first of them, where the
group's call goes. The call computes the later members earlier than the user's
code did, so a member joins only if nothing between the first member and it
writes what it reads (``y.add_(1)`` on its input, ``w.copy_(...)`` on its
weight, an opaque call that may write anything): Dynamo's graph keeps such
writes in place (``side_effects``). Reads only decisions; the rewrite applies
the groups.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from .annotate import Decision
from .side_effects import UNKNOWN, written_nodes
from .sites import LinearSite

__all__ = ["group_sites"]


def _operands(decision: Decision) -> list[torch.fx.Node]:
    site = decision.site
    return [node for node in (site.input_node, site.weight_node, site.bias_node) if node is not None]


def group_sites(decisions: list[Decision],
                compatible: Callable[[Decision], Hashable] = lambda decision: None) -> list[list[Decision]]:
    """The rewritten linear sites in groups (in graph order), each group's sites reading one input.

    Sites that share nothing are groups of one. ``compatible(decision)`` must be equal for the sites of
    a group (the backend keys it on the buffers a site carries: delayed-scaling state, a cached weight).
    """
    groups: dict[tuple, list[Decision]] = {}
    for decision in decisions:
        site = decision.site
        if not decision.rewritten or type(site) is not LinearSite:
            continue
        key = (id(site.graph_module), site.input_node, id(site.checkpoint_region), decision.recipe,
               decision.lowering, compatible(decision))
        groups.setdefault(key, []).append(decision)
    positions: dict[torch.fx.Node, int] = {}
    writes: dict[int, list[tuple[int, object]]] = {}  # id(graph) -> [(position, storages written or UNKNOWN)]
    for graph in {id(d.site.node.graph): d.site.node.graph for d in decisions}.values():
        positions.update((node, index) for index, node in enumerate(graph.nodes))
        writes[id(graph)] = _writes(graph)
    result = []
    for members in groups.values():
        graph_writes = writes[id(members[0].site.node.graph)]
        result += _split_by_order(sorted(members, key=lambda d: positions[d.site.node]), positions, graph_writes)
    return sorted(result, key=lambda group: (id(group[0].site.node.graph), positions[group[0].site.node]))


def _storage(node: torch.fx.Node):
    """The storage ``node``'s value lives in (views share it), or None when the graph does not say."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        try:
            return StorageWeakRef(value.untyped_storage())
        except (NotImplementedError, RuntimeError):  # a tensor subclass without storage
            return None
    return None


def _writes(graph: torch.fx.Graph) -> list[tuple[int, object]]:
    """``(position, storages written)`` of every node that writes, ``UNKNOWN`` for one that may write anything."""
    result = []
    for index, node in enumerate(graph.nodes):
        written = written_nodes(node)
        if written is UNKNOWN:
            result.append((index, UNKNOWN))
        elif written:
            storages = {_storage(target) for target in written}
            result.append((index, UNKNOWN if None in storages else storages))
    return result


def _written_between(member: Decision, start: int, end: int, writes: list[tuple[int, object]]) -> bool:
    """True when a node strictly between ``start`` and ``end`` may write what ``member`` reads."""
    read = {_storage(node) for node in _operands(member)}
    for position, written in writes:
        if start < position < end and (written is UNKNOWN or None in read or read & written):
            return True
    return False


def _split_by_order(members: list[Decision], positions: dict[torch.fx.Node, int],
                    writes: list[tuple[int, object]]) -> list[list[Decision]]:
    """``members`` (same input, in graph order) as one group where the call can go before the first of
    them: each other member's operands are defined by then, nothing between changes them, and its weight is
    not another member's. The rest stay alone."""
    first = members[0]
    start = positions[first.site.node]
    group, alone, weights = [first], [], {first.site.weight_node}
    for member in members[1:]:
        defined_before = all(positions[node] < start for node in _operands(member))
        if member.site.weight_node in weights or not defined_before \
                or _written_between(member, start, positions[member.site.node], writes):
            alone.append([member])
            continue
        group.append(member)
        weights.add(member.site.weight_node)
    return [group] + alone
