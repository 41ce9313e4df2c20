"""Map a graph node to the path of the module that ran it.

This is the only code that reads ``node.meta["nn_module_stack"]``. Dynamo keys
each stack entry by ``str(id(module))`` (with ``@N`` for repeated calls) and
stores a source-like path whose root varies (``L['self'].model.layers.0.mlp``,
``L['fn']...``). When the caller knows the model, identities give the exact
``named_modules()`` spelling; otherwise the source path is normalized.

A GEMM can run inside its parent's call without its own module's ``forward``
(``nn.MultiheadAttention`` multiplies ``out_proj.weight`` in
``F.multi_head_attention_forward``). :func:`with_child_module` gives such a
node a stack entry for the child, keyed ``<parent id>.<attribute>`` (an id has
no dot), which :func:`module_path` spells as the parent's path and the attribute.
"""

from __future__ import annotations

import re

import torch.fx

__all__ = ["module_path", "module_paths_by_id", "module_type", "with_child_module"]

_ROOT = re.compile(r"^[A-Za-z_]+\[['\"][^'\"]+['\"]\]")  # L['self'], G['model'], ...
_MODULES_ITEM = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")  # ._modules['mlp'] -> .mlp
_INDEX = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")  # [3] or ['3'] -> .3


def module_paths_by_id(model: torch.nn.Module) -> dict[str, str]:
    """``{str(id(module)): path}`` for every module of ``model``.

    A module reachable by two paths (``model.b = model.a``) is named by the
    first, as ``named_modules()`` names it: policies, state and statistics
    all use that spelling.
    """
    return {str(id(module)): path for path, module in model.named_modules()}


def _normalize_source_path(source_path: str) -> str:
    path = _ROOT.sub("", source_path, count=1)
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _INDEX.sub(r".\1", path)
    return path.lstrip(".")


def module_path(node: torch.fx.Node, paths_by_id: dict[str, str] | None = None) -> str:
    """Path of the innermost module whose forward ran ``node``; ``""`` for the root."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    key, (source_path, _module_type) = list(stack.items())[-1]
    module_id, _, child = key.split("@")[0].partition(".")
    if paths_by_id is not None and module_id in paths_by_id:
        return ".".join(part for part in (paths_by_id[module_id], child) if part)
    return _normalize_source_path(source_path)


def with_child_module(stack: dict, attribute: str, child_type: type) -> dict:
    """``stack`` (a node's ``nn_module_stack``) with the innermost module's child ``attribute`` added
    innermost, for a GEMM of that child run by its parent's code."""
    key, (source_path, _owner_type) = list(stack.items())[-1]
    child_key = f"{key.split('@')[0]}.{attribute}"
    return {**stack, child_key: (f"{source_path}.{attribute}", child_type)}


def module_type(node: torch.fx.Node) -> type | None:
    """Class of the innermost module whose forward ran ``node``; ``None`` outside any module."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    _source_path, owner_type = list(stack.values())[-1]
    return owner_type if isinstance(owner_type, type) else None
