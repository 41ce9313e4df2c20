"""Restore the tokens' order after the expert GEMMs with a gather whose backward is a gather.

    before:  inverse = empty_like(perm); inverse[perm] = arange(S); out = rows[inverse]     perm: sort's indices
    after:   inverse = empty_like(perm); inverse[perm] = arange(S); out = fp8graph_unpermute_rows(rows, perm, inverse)

The forward is the same gather; the backward reads ``grad[perm]`` instead of accumulating into zeros
(``fp8graph.targets.unpermute``), so the sorted gradient the down projection's grad_output cast reads is
never stored in BF16. Applied only in graphs with an expert GEMM in FP8, whose casts it feeds (with every
site in high precision the graph stays plain ``torch.compile``'s). The pattern is proven, not guessed:
``perm`` is the index output of ``sort`` / ``argsort`` of a 1-D tensor (a permutation), ``inverse`` is made
by ``empty_like(perm)`` and written once, by ``inverse[perm] = arange(len(perm))``, before the gather reads
it, and nothing writes ``perm`` in place. The write stays where it is (``side_effects``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fp8graph.targets.cache_hash import mark_cacheable
from fp8graph.targets.unpermute import unpermute_rows

from .node_values import tensor_value

__all__ = ["unpermute_expert_outputs", "unpermuting"]

_SORTS = {torch.sort, "sort"}
_ARGSORTS = {torch.argsort, "argsort"}


def _is_permutation(node) -> bool:
    """``sort(x)[1]`` or ``argsort(x)`` of a 1-D ``x``, along its only dimension."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    if node.target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], torch.fx.Node):
        sort = node.args[0]
        ok = sort.target in _SORTS and sort.op in ("call_function", "call_method")
    else:
        sort, ok = node, node.target in _ARGSORTS
    value = tensor_value(node)
    return ok and value is not None and value.dim() == 1 and not value.is_floating_point() \
        and all(tensor_value(arg) is None or tensor_value(arg).dim() == 1 for arg in sort.args[:1])


def _writes_in_place(node: torch.fx.Node) -> bool:
    return any(user.op == "call_method" and str(user.target).endswith("_") and user.args[0] is node
               for user in node.users)


def _is_arange_of(node, permutation: torch.fx.Node) -> bool:
    """``arange(n)`` with ``n`` the permutation's length (an int, or the same symbol)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is torch.arange):
        return False
    if len(node.args) != 1 or set(node.kwargs) - {"device", "dtype"}:
        return False
    end, length = node.args[0], tensor_value(permutation).shape[0]
    end_value = end.meta.get("example_value") if isinstance(end, torch.fx.Node) else end
    # Compared as text: comparing symbols would guard the graph on them.
    return end_value is not None and str(end_value) == str(length)


def _rows_match(rows: torch.fx.Node, permutation: torch.fx.Node) -> bool:
    """Whether ``rows`` has one row per entry of ``permutation`` (compared as text, as ``_is_arange_of``): the
    backward scatters the gradient back through it, a row for each."""
    rows_value, length = tensor_value(rows), tensor_value(permutation).shape[0]
    return rows_value is not None and rows_value.dim() >= 1 and str(rows_value.shape[0]) == str(length)


def _unpermutes(graph: torch.fx.Graph):
    """``(gather, permutation, inverse)`` of each gather by the inverse of a permutation (see the module's doc)."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    for write in graph.find_nodes(op="call_function", target=operator.setitem):
        inverse, permutation, values = write.args
        if not (isinstance(inverse, torch.fx.Node) and inverse.op == "call_function"
                and inverse.target is torch.empty_like and inverse.args[:1] == (permutation,)
                and _is_permutation(permutation) and _is_arange_of(values, permutation)
                and not _writes_in_place(permutation)):
            continue
        readers = [user for user in inverse.users if user is not write]
        if any(not (user.op == "call_function" and user.target is operator.getitem and user.args[1] is inverse
                    and order[user] > order[write] and _rows_match(user.args[0], permutation))
               for user in readers):
            continue  # read some other way, before it is written, or of rows the permutation does not order
        for gather in readers:
            yield gather, permutation, inverse


def unpermuting(gather: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(permutation, inverse)`` where ``gather`` is ``rows[inverse]`` by the inverse of a permutation (see the
    module's doc), else None."""
    return next(((permutation, inverse) for found, permutation, inverse in _unpermutes(gather.graph)
                 if found is gather), None)


def unpermute_expert_outputs(gm: torch.fx.GraphModule) -> int:
    """Rewrite each such gather of ``gm``'s graph; returns how many."""
    graph = gm.graph
    rewritten = 0
    for gather, permutation, inverse in list(_unpermutes(graph)):
        with graph.inserting_before(gather):
            call = graph.call_function(unpermute_rows, (gather.args[0], permutation, inverse))
        call.meta.update(gather.meta)
        mark_cacheable(call, unpermute_rows)
        gather.replace_all_uses_with(call)
        graph.erase_node(gather)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
