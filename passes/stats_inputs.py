"""Find the stats buffer among the graph inputs and drop its anchor.

With ``fp8graph.compile(model, stats=True)`` a forward pre-hook passes the
root module's ``fp8graph_stats_buffer`` to ``stats_anchor`` so that Dynamo
lifts the buffer as a graph input:

    before:  stats = placeholder(L_self_buffers_fp8graph_stats_buffer_);  stats_anchor(stats);  ...
    after:   stats = placeholder(L_self_buffers_fp8graph_stats_buffer_);  ...

The anchor has done its job once the graph exists; the rewrite then passes
the placeholder to each FP8 site. Without stats there is no anchor and this
pass changes nothing.
"""

from __future__ import annotations

import torch.fx

from fp8graph.stats import stats_anchor

__all__ = ["take_stats_input"]


def take_stats_input(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """Remove the stats anchors of ``gm``; return the stats buffer's node, if any."""
    stats_node = None
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is stats_anchor:
            stats_node = node.args[0]
            node.replace_all_uses_with(stats_node)
            gm.graph.erase_node(node)
    return stats_node
