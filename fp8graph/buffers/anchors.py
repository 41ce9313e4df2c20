"""How buffers on the user's modules become inputs of the graphs that use them.

A buffer a module holds reaches a Dynamo graph only if the traced code
touches it. fp8graph's buffers (delayed-scaling state, weight caches, stats)
are touched by forward hooks that pass them to an *anchor*: an identity
function Dynamo keeps in the graph as a node (``allow_in_graph``). The
backend finds each kind of buffer among the graph's inputs by its anchor and
removes the anchors (``fp8graph.passes.anchored_inputs``). One anchor per
kind, made here by :func:`make_anchor` and named at module level, so hooks
that call it pickle with the model. :func:`register_new_buffer` is the
one place a buffer is added to a user's module.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["fill_anchor", "make_anchor", "register_new_buffer", "reuse_anchor", "state_anchor", "stats_anchor"]


def make_anchor(kind: str, what: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The anchor of one kind of buffer, ``<kind>_anchor``; assign it to that name in this module."""
    def anchor(*buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return buffers

    anchor.__name__ = anchor.__qualname__ = f"{kind}_anchor"
    anchor.__doc__ = f"Identity kept as a graph node: {what}."
    anchor.__module__ = __name__
    return torch._dynamo.allow_in_graph(anchor)


state_anchor = make_anchor("state", "these delayed-scaling histories and scales are graph inputs")
stats_anchor = make_anchor("stats", "these stats buffers are graph inputs")
fill_anchor = make_anchor("fill", "these FP8 weight copies are graph inputs, and this call fills them")
reuse_anchor = make_anchor("reuse", "these FP8 weight copies are graph inputs, and this call reads them")


def register_new_buffer(module: torch.nn.Module, path: str, name: str, value: torch.Tensor, persistent: bool,
                        if_taken: str) -> None:
    """``module.register_buffer(name, value)``, refused when ``name`` is taken (``if_taken`` says what to do)."""
    if hasattr(module, name):
        raise ValueError(f"{path or '<root>'}.{name} already exists: {if_taken}")
    module.register_buffer(name, value, persistent=persistent)
