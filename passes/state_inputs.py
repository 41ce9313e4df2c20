"""Find the delayed-scaling state buffers among the graph inputs and drop their anchors.

    before:  h = placeholder(..._buffers_fp8graph_amax_history_weight_);  s = placeholder(...scale...)
             state_anchor(h, s);  y = linear(x, w)
    after:   h = placeholder(...);  s = placeholder(...);  y = linear(x, w)

Each site's state is then found by identity: the buffers registered for the
site's module and weight (``fp8graph.state``) are the example inputs of
these placeholders.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx

from fp8graph.state import state_anchor

__all__ = ["take_state_inputs"]


def take_state_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> dict[int, torch.fx.Node]:
    """Remove the state anchors; return ``{id(buffer): placeholder}`` of the anchored buffers."""
    anchored = set()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is state_anchor:
            anchored.update(node.args)
            for user in list(node.users):  # getitem nodes of the unused result
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {id(value): node for node, value in zip(placeholders, example_inputs) if node in anchored}
