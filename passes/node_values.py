"""What a node of a Dynamo graph holds, as the passes read it: its example tensor, its arguments."""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["argument", "tensor_value"]


def tensor_value(node) -> torch.Tensor | None:
    """The (fake) tensor Dynamo recorded for ``node``, or None when it is no tensor (or no node)."""
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def argument(node: torch.fx.Node, index: int, names: str | tuple[str, ...], default=None):
    """Argument ``index`` of a call, given by position or by one of its keyword ``names``."""
    if len(node.args) > index:
        return node.args[index]
    names = (names,) if isinstance(names, str) else names
    return next((node.kwargs[name] for name in names if name in node.kwargs), default)
