"""Find the linear and matmul sites of a Dynamo graph.

Dynamo's IR is not normalized: one ``y = x W^T + b`` can reach the backend as

    torch._C._nn.linear(x, w, b)            nn.Linear, F.linear
    torch.addmm(b, x2d, w)                  GPT-2's Conv1D, weight stored (K, N)
    torch.matmul(x, w) / x @ w / x.matmul(w) / torch.mm(x, w) / x @ w.t()

This pass reads each such node into a :class:`Site`: which operand is the
activation, which is the weight parameter and how it is laid out, the bias,
and M/K/N. A site that can never run in FP8 (a computed weight, a parameter
on the left, a scaled ``addmm``) carries a ``blocker`` saying why. A matmul
of two activations (attention scores) carries none: it is no linear, so it
runs in FP8 only when a policy rule names it. The pass only reads the graph.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Sequence

import torch
import torch.fx

from .module_paths import module_path, module_type
from .subgraphs import Subgraphs

__all__ = ["Site", "find_sites"]

_LINEAR_TARGETS = {torch._C._nn.linear, torch.nn.functional.linear}
_MATMUL_TARGETS = {torch.matmul, operator.matmul, torch.mm}
_ADDMM_TARGETS = {torch.addmm}
_BATCHED_TARGETS = {torch.bmm, torch.baddbmm}  # named by __name__
_MATMUL_METHODS = {"matmul", "__matmul__", "mm"}
# Keyword names of the two GEMM operands, per op (the added term of addmm/baddbmm is "input").
_OPERAND_KWARGS = {
    "matmul": ("input", "other"),
    "mm": ("input", "mat2"),
    "bmm": ("input", "mat2"),
    "addmm": ("mat1", "mat2"),
    "baddbmm": ("batch1", "batch2"),
}
_TRANSPOSE_TARGETS = {torch.t}


@dataclasses.dataclass
class Site:
    """One GEMM of the graph, read into linear form ``input @ weight^T + bias``.

    ``weight_is_kn`` is True when the parameter is stored (K, N), as GPT-2's
    Conv1D stores it; the rewrite then feeds ``weight.t()`` to the FP8 linear.
    An activation-by-activation matmul (attention scores) has no weight: its
    right operand is ``other_node``, and only an explicit policy rule moves
    it to FP8.
    """

    @property
    def is_linear(self) -> bool:
        return self.weight_node is not None

    node: torch.fx.Node
    op: str
    path: str
    module_type: type | None = None
    input_node: torch.fx.Node | None = None
    weight_node: torch.fx.Node | None = None
    other_node: torch.fx.Node | None = None
    weight_is_kn: bool = False
    bias_node: torch.fx.Node | None = None
    M: int | str | None = None
    K: int | None = None
    N: int | None = None
    dtype: torch.dtype | None = None
    blocker: str | None = None
    graph_module: torch.fx.GraphModule | None = None
    in_subgraph: bool = False
    weight_input: torch.fx.Node | None = None  # the top-level placeholder the weight arrives through
    checkpoint_region: torch.fx.GraphModule | None = None  # body of the enclosing torch.utils.checkpoint


def _value(node) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            return value
    return None


def _op_name(node: torch.fx.Node) -> str | None:
    if node.op == "call_function":
        if node.target in _LINEAR_TARGETS:
            return "linear"
        if node.target in _ADDMM_TARGETS:
            return "addmm"
        if node.target in _MATMUL_TARGETS:
            return "mm" if node.target is torch.mm else "matmul"
        if node.target in _BATCHED_TARGETS:
            return node.target.__name__
    if node.op == "call_method":
        if node.target in _MATMUL_METHODS:
            return "mm" if node.target == "mm" else "matmul"
        if node.target == "addmm":
            return "addmm"
    return None


def _is_transpose(node: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target == "t":
        return True
    if node.op == "call_function" and node.target in _TRANSPOSE_TARGETS:
        return True
    return node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT")


class _Parameters:
    """Which graph nodes are parameters: placeholders fed a Parameter, or get_attr of one."""

    def __init__(self, gm: torch.fx.GraphModule, parameter_placeholders: set[torch.fx.Node]):
        self._nodes = set(parameter_placeholders)
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = getattr(gm, str(node.target), None)
                if isinstance(value, torch.nn.Parameter):
                    self._nodes.add(node)

    def resolve(self, node) -> tuple[torch.fx.Node | None, bool]:
        """``(parameter node, transposed)`` when ``node`` is a parameter or its ``.t()``."""
        if not isinstance(node, torch.fx.Node):
            return None, False
        if node in self._nodes:
            return node, False
        if _is_transpose(node) and node.args[0] in self._nodes:
            return node.args[0], True
        return None, False


def _arg(node: torch.fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _rows(lead: Sequence) -> int | str:
    """M of a GEMM whose left operand has leading dims ``lead``; symbolic dims stay symbolic."""
    if all(isinstance(d, int) for d in lead) or 0 in lead:  # a zero-size dim empties it, symbolic or not
        return math.prod(d for d in lead if isinstance(d, int)) if 0 not in lead else 0
    return " * ".join(str(d) for d in lead)  # dynamic token dimension: never specialized


def _fill_linear_shapes(site: Site) -> None:
    input_value, weight_value = _value(site.input_node), _value(site.weight_node)
    if input_value is None or weight_value is None:
        return
    site.dtype = input_value.dtype
    if weight_value.dim() != 2:
        site.blocker = f"parameter operand is {weight_value.dim()}-D, not 2-D"
        return
    rows, columns = weight_value.shape
    site.N, site.K = (columns, rows) if site.weight_is_kn else (rows, columns)
    site.M = _rows(input_value.shape[:-1])


def _fill_operand_shapes(site: Site, left, right, right_is_nk: bool = False) -> None:
    """M/K/N of a GEMM that will not be rewritten, for the report."""
    left_value, right_value = _value(left), _value(right)
    if left_value is None:
        return
    site.dtype = left_value.dtype
    if right_value is None or left_value.dim() < 1 or right_value.dim() < 2:
        return
    site.M = _rows(left_value.shape[:-1])  # batch dims count as rows
    site.K = left_value.shape[-1]
    site.N = right_value.shape[-2] if right_is_nk else right_value.shape[-1]


def _read_linear(site: Site, node: torch.fx.Node, params: _Parameters) -> None:
    site.input_node = _arg(node, 0, "input")
    weight, transposed = params.resolve(_arg(node, 1, "weight"))
    site.bias_node = _arg(node, 2, "bias")
    site.weight_node, site.weight_is_kn = weight, transposed
    if weight is None:
        site.blocker = "weight is not a parameter (computed in the graph)"
        _fill_operand_shapes(site, site.input_node, _arg(node, 1, "weight"), right_is_nk=True)
    else:
        _fill_linear_shapes(site)


def _read_matmul(site: Site, node: torch.fx.Node, params: _Parameters) -> None:
    """matmul / mm / bmm / addmm / baddbmm: a linear when the right operand is a parameter.

    Otherwise a matmul of two activations, whose added term (addmm, baddbmm)
    is kept in ``bias_node``.
    """
    has_addend = site.op in ("addmm", "baddbmm")
    offset = 1 if has_addend else 0
    left_name, right_name = _OPERAND_KWARGS[site.op]
    left = _arg(node, offset, left_name)
    right = _arg(node, offset + 1, right_name)
    if has_addend:
        site.bias_node = _arg(node, 0, "input")
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            site.blocker = f"{site.op} with alpha or beta other than 1"
    weight, transposed = params.resolve(right)
    site.input_node = left
    if weight is not None and site.op != "baddbmm":
        # matmul(x, W) with W stored (K, N) is a linear with weight W^T.
        site.weight_node, site.weight_is_kn = weight, not transposed
        _fill_linear_shapes(site)
        return
    _fill_operand_shapes(site, left, right)
    site.other_node = right
    left_value, right_value = _value(left), _value(right)
    if params.resolve(left)[0] is not None:
        site.blocker = site.blocker or "parameter is the left operand"
    elif left_value is None or right_value is None or left_value.dim() < 2 or right_value.dim() < 2:
        site.blocker = site.blocker or "matmul with a 1-D operand"


def _read_site(node: torch.fx.Node, op: str, params: _Parameters, path: str) -> Site:
    site = Site(node=node, op=op, path=path, module_type=module_type(node))
    if op == "linear":
        _read_linear(site, node, params)
    else:
        _read_matmul(site, node, params)
    return site


def find_sites(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    paths_by_id: dict[str, str] | None = None,
) -> list[Site]:
    """Every linear or matmul node of ``gm`` and of the subgraphs it calls, in graph order.

    Sites inside a subgraph (a ``torch.utils.checkpoint`` region) record
    their ``graph_module``; their parameters are found through the operands
    the outer graph passes in.
    """
    top_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    top_parameters = {n for n, v in zip(top_placeholders, example_inputs) if isinstance(v, torch.nn.Parameter)}
    subgraphs = Subgraphs(gm)
    sites = []
    for graph_module in subgraphs:
        body_parameters = {n for n in graph_module.graph.nodes if n.op == "placeholder"
                           and subgraphs.top_node(n, graph_module) in top_parameters}
        params = _Parameters(graph_module, body_parameters)
        for node in graph_module.graph.nodes:
            op = _op_name(node)
            if op is not None:
                site = _read_site(node, op, params, module_path(node, paths_by_id))
                site.graph_module = graph_module
                site.in_subgraph = graph_module is not gm
                site.checkpoint_region = subgraphs.checkpoint_region(graph_module)
                if site.weight_node is not None:
                    site.weight_input = subgraphs.top_node(site.weight_node, graph_module)
                sites.append(site)
    return sites
