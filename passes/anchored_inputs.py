"""Find the buffers that anchors made graph inputs, and drop the anchors.

Statistics (``fp8graph.stats``) and delayed-scaling state (``fp8graph.state``)
live in buffers of the model. Forward pre-hooks pass them to an anchor, an
identity Dynamo keeps as a graph node, so Dynamo lifts them as graph inputs:

    before:  s = placeholder(..._buffers_fp8graph_stats_buffer_);  stats_anchor(s);  ...
    after:   s = placeholder(..._buffers_fp8graph_stats_buffer_);  ...

Once the graph exists the anchors have done their job; the rewrite passes the
placeholders to the FP8 sites. Without stats or delayed scaling there are no
anchors and this pass changes nothing.
"""

from __future__ import annotations

from typing import Callable

import torch.fx

__all__ = ["take_anchored_inputs"]


def take_anchored_inputs(gm: torch.fx.GraphModule, anchor: Callable) -> list[torch.fx.Node]:
    """Remove every call of ``anchor`` from ``gm``; return the nodes passed to it, first seen first."""
    anchored: dict[torch.fx.Node, None] = {}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is anchor:
            anchored.update(dict.fromkeys(node.args))
            for user in list(node.users):  # getitem nodes of the unused result
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
    return list(anchored)
