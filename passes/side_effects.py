"""Which nodes of a Dynamo graph have side effects, and what they write.

Dynamo's graph is not functional: it keeps the user's in-place writes as
nodes whose results nobody reads::

    key_states = kv.new_empty(...)
    key_states[..., :16].copy_(k_nope)        call_method copy_ on a view: writes key_states' storage
    out.index_add_(0, index, expert_out)      call_method index_add_
    x[mask] = 0                               operator.setitem
    y += b                                    operator.iadd
    torch.rand(...), F.dropout(...)           draw from the RNG

FX's ``Node.is_impure()`` counts a ``call_method`` as pure, so FX's dead-code
elimination deletes the first three. fp8graph's passes therefore remove no
node but the sites they replace and their own anchors, and move a site only
when no side effect between its old and new place can change what it reads
(``group_sites``). :func:`side_effect_nodes` lists the nodes the pipeline
checks are still there, in order, after every pass.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

__all__ = ["has_side_effects", "side_effect_nodes", "written_nodes", "UNKNOWN"]

# The in-place operators of Python's data model: ``y += x`` reaches the graph as operator.iadd.
_INPLACE_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift,
}
# Name fragments of the ops that draw from the random number generator: moving or deleting one changes
# every random number drawn after it.
_RANDOM_FRAGMENTS = ("rand", "dropout", "bernoulli", "multinomial", "poisson", "rrelu")
_RANDOM_NAMES = {"normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
                 "seed", "manual_seed"}
_IN_PLACE_DUNDERS = {f"__{name.__name__}__" for name in _INPLACE_OPERATORS}


class _Unknown:
    """What :func:`written_nodes` returns for a node that may write anything."""

    def __repr__(self):
        return "UNKNOWN"


UNKNOWN = _Unknown()


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _is_in_place_name(name: str) -> bool:
    """``add_``, ``copy_``, ``index_add_``: PyTorch's spelling of an in-place op; ``__iadd__``, ``__setitem__``."""
    return name.endswith("_") and not name.startswith("__") or name in _IN_PLACE_DUNDERS


def _draws_random(node: torch.fx.Node) -> bool:
    name = _name(node).lower()
    return name in _RANDOM_NAMES or any(fragment in name for fragment in _RANDOM_FRAGMENTS)


def _mutated_schema_args(node: torch.fx.Node) -> list | None:
    """The arguments an OpOverload's schema marks written, or None when the target has no schema."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            written.append(value)
    return written


def written_nodes(node: torch.fx.Node):
    """The graph nodes whose storage ``node`` writes, or :data:`UNKNOWN` when it may write anything.

    ``[]`` for a node that writes nothing. Higher-order ops and modules are
    opaque: :data:`UNKNOWN`.
    """
    if node.op in ("placeholder", "get_attr", "output"):
        return []
    if node.op == "call_module":
        return UNKNOWN
    out = node.kwargs.get("out")
    written = [out] if out is not None else []
    if node.op == "call_method":
        if _is_in_place_name(str(node.target)):
            written.append(node.args[0])
    elif node.target in _INPLACE_OPERATORS:
        written.append(node.args[0])
    elif isinstance(node.target, torch._ops.HigherOrderOperator):
        return UNKNOWN
    else:
        schema_written = _mutated_schema_args(node)
        if schema_written is not None:
            written += schema_written
        elif _is_in_place_name(_name(node)) and node.args:
            written.append(node.args[0])  # torch.relu_(x), torch.index_add_(x, ...)
        elif node.is_impure() and not _draws_random(node):  # FX counts torch.rand impure: it writes no tensor
            return UNKNOWN  # FX's own list: autograd state, profiler ranges, asserts, ...
    values = [value for value in _flatten(written) if value is not None]
    if not all(isinstance(value, torch.fx.Node) for value in values):
        return UNKNOWN  # writes something that is not a graph value
    return values


def _flatten(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    else:
        yield value


def has_side_effects(node: torch.fx.Node) -> bool:
    """True when deleting, duplicating or moving ``node`` could change what the graph computes:
    it writes a tensor, draws random numbers, or does something FX cannot see into."""
    if node.op in ("placeholder", "output"):
        return True
    written = written_nodes(node)
    return written is UNKNOWN or bool(written) or (node.op in ("call_function", "call_method") and _draws_random(node))


def side_effect_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of ``gm`` with side effects, in graph order (placeholders and output left out)."""
    return [node for node in gm.graph.nodes if node.op not in ("placeholder", "output") and has_side_effects(node)]
