"""The graph modules of one Dynamo graph: the top graph and the bodies of its higher-order ops.

A ``torch.utils.checkpoint`` region reaches the backend as a call
``tag_activation_checkpoint(body, *operands)`` whose body graph receives the
operands placeholder by placeholder (``wrap`` likewise). Everything a body
uses from outside, parameters and model buffers included, is an operand::

    top:   out = tag_activation_checkpoint(wrap_body_0, x, w_q, history_q, ...)
    body:  def forward(self, x, w_q, history_q, ...)

The passes find sites in bodies and pass them buffers that live at the top
(stats, delayed-scaling state). :class:`Subgraphs` maps a body placeholder
to the top-level node it stands for, and threads a top-level node into a
body as a new operand, appended so existing operands keep their places.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.fx

__all__ = ["Subgraphs"]

# Higher-order ops called as op(body, *operands): their bodies run on the operands in order.
_BODY_FIRST_HOPS = {torch.ops.higher_order.tag_activation_checkpoint, torch.ops.higher_order.wrap}


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _body_calls(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.Node, torch.fx.GraphModule]]:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _BODY_FIRST_HOPS and node.args \
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr":
            body = getattr(gm, str(node.args[0].target))
            if isinstance(body, torch.fx.GraphModule):
                yield node, body


class Subgraphs:
    """``gm`` and every body nested in it, outermost first.

    A body called from more than one place has no single outside: its
    placeholders map to no top-level node (sites there get no state or stats).
    """

    def __init__(self, gm: torch.fx.GraphModule):
        self.top = gm
        self.modules: list[torch.fx.GraphModule] = []
        self._caller: dict[torch.fx.GraphModule, tuple[torch.fx.GraphModule, torch.fx.Node] | None] = {}
        pending = [gm]
        while pending:
            graph_module = pending.pop(0)
            self.modules.append(graph_module)
            for call, body in _body_calls(graph_module):
                if body in self._caller:
                    self._caller[body] = None  # shared body: ambiguous outside
                    continue
                self._caller[body] = (graph_module, call)
                pending.append(body)

    def __iter__(self) -> Iterator[torch.fx.GraphModule]:
        return iter(self.modules)

    def checkpoint_region(self, graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
        """The body of the innermost ``torch.utils.checkpoint`` region ``graph_module`` runs in, if any."""
        while graph_module is not self.top:
            caller = self._caller.get(graph_module)
            if caller is None:
                return None
            if caller[1].target is torch.ops.higher_order.tag_activation_checkpoint:
                return graph_module
            graph_module = caller[0]
        return None

    def top_node(self, node: torch.fx.Node, graph_module: torch.fx.GraphModule) -> torch.fx.Node | None:
        """The top-level node ``node`` of ``graph_module`` stands for, or ``None`` when it is computed inside a body."""
        while graph_module is not self.top:
            caller = self._caller.get(graph_module)
            if caller is None or node.op != "placeholder":
                return None
            graph_module, call = caller
            node = call.args[1 + _placeholders(self._body_of(call)).index(node)]
            if not isinstance(node, torch.fx.Node):
                return None
        return node

    def lift(self, top_node: torch.fx.Node, graph_module: torch.fx.GraphModule) -> torch.fx.Node:
        """The node of ``graph_module`` that carries ``top_node``, threading it in as an operand if needed."""
        if graph_module is self.top:
            return top_node
        caller = self._caller.get(graph_module)
        if caller is None:
            raise ValueError("a body called from several places cannot take an operand from outside")
        parent, call = caller
        outer = self.lift(top_node, parent)
        placeholders = _placeholders(graph_module)
        for placeholder, operand in zip(placeholders, call.args[1:]):
            if operand is outer:
                return placeholder
        graph = graph_module.graph
        with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None):
            placeholder = graph.placeholder(outer.name)
        placeholder.meta.update({k: v for k, v in outer.meta.items() if k in ("example_value", "val", "tensor_meta")})
        call.args = (*call.args, outer)
        return placeholder

    def recompile(self) -> None:
        for graph_module in self.modules:
            graph_module.graph.lint()
            graph_module.recompile()

    @staticmethod
    def _body_of(call: torch.fx.Node) -> torch.fx.GraphModule:
        return getattr(call.graph.owning_module, str(call.args[0].target))
