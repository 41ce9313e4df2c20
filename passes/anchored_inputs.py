"""Find the buffers that anchors made graph inputs, and drop the anchors.

Statistics (``fp8graph.buffers.stats``) and delayed-scaling state (``fp8graph.buffers.delayed_state``)
live in buffers of the model. Forward hooks pass them to an anchor, an
identity Dynamo keeps as a graph node, so Dynamo lifts them as graph inputs:

    before:  s = placeholder(..._buffers_fp8graph_stats_);  root_s = placeholder(...);  stats_anchor(s, root_s);  ...
    after:   s = placeholder(..._buffers_fp8graph_stats_);  root_s = placeholder(...);  ...

(With ``freeze_weights`` they are ``get_attr`` nodes instead of placeholders.)

Once the graph exists the anchors have done their job; the rewrite passes the
placeholders to the FP8 sites. A hook that ran inside a ``torch.utils.checkpoint``
region anchors the body's placeholders; they are reported as the top-level
nodes they stand for. Without stats or delayed scaling there are no
anchors and this pass changes nothing.
"""

from __future__ import annotations

from typing import Callable

import torch.fx

from .subgraphs import Subgraphs

__all__ = ["take_anchored_inputs"]


def take_anchored_inputs(gm: torch.fx.GraphModule, anchor: Callable) -> list[torch.fx.Node]:
    """Remove every call of ``anchor`` from ``gm`` and its bodies; return the top-level
    nodes passed to it, first seen first."""
    anchored: dict[torch.fx.Node, None] = {}
    subgraphs = Subgraphs(gm)
    for graph_module in subgraphs:
        for node in list(graph_module.graph.nodes):
            if node.op == "call_function" and node.target is anchor:
                top_nodes = (subgraphs.top_node(arg, graph_module) for arg in node.args)
                anchored.update(dict.fromkeys(n for n in top_nodes if n is not None))
                for user in list(node.users):  # getitem nodes of the unused result
                    graph_module.graph.erase_node(user)
                graph_module.graph.erase_node(node)
    # Under Inductor's freezing Dynamo makes buffers graph attributes, read where
    # first used (after the module's forward, where the hook ran): move them to
    # the top so every site can take them.
    first = next(iter(gm.graph.nodes))
    for node in anchored:
        if node.op == "get_attr" and node is not first:
            first.prepend(node)
    return list(anchored)
