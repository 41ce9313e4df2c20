"""Find the linear and matmul sites of a Dynamo graph.

Dynamo's IR is not normalized: one ``y = x W^T + b`` can reach the backend as

    torch._C._nn.linear(x, w, b)            nn.Linear, F.linear
    torch.addmm(b, x2d, w)                  GPT-2's Conv1D, weight stored (K, N)
    torch.matmul(x, w) / x @ w / x.matmul(w) / torch.mm(x, w) / x @ w.t()

This pass reads each such node into a site of its kind (``passes.sites``): which operand is the
activation, which is the weight parameter and how it is laid out, the bias,
and M/K/N. A site that can never run in FP8 (a computed weight, a parameter
on the left, a scaled ``addmm``) carries a ``blocker`` saying why. A matmul
of two activations (attention scores) carries none: it is no linear, so it
runs in FP8 only when a policy rule names it.

PyTorch's attention reaches the graph as one call that hides its GEMMs.
``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` and the
``nn.Transformer*Layer`` modules with gradients) is opened into the ops it
runs by the pass before this one (``expand_attention``): its input projection is then a linear
site of the attention module on ``in_proj_weight`` (or on ``q_proj_weight``,
``k_proj_weight``, ``v_proj_weight``), its output projection one of
``<attention>.out_proj``. The fused fast paths of inference
(``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``)
are ATen ops: each weight they multiply is listed as a site kept in high
precision, with the reason. The pass only reads the graph.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
from typing import Sequence

import torch
import torch.fx

from fp8graph.recipes.scaling import misaligned

from .expert_sites import (GROUPED_OP, is_grouped_gemm, mark_gates, pair_expert_stages, read_combine,
                           read_dense_experts, read_gather,
                           read_gathered_experts, read_grouped, read_swiglu)
from .sites import REPLACEABLE_DTYPES, FusedCallSite, GroupedExpertSite, LinearSite, MatmulSite, Site
from .expand_attention import MHA_ARGUMENTS, UNEXPANDED_KEY, attention_arguments, is_multi_head_attention
from .module_paths import module_path, module_type
from .node_values import argument, tensor_value
from .subgraphs import Subgraphs

__all__ = ["find_sites"]

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
# Ways a parameter is cut into row blocks (cross-attention splits MultiheadAttention's in_proj_weight).
_SPLIT_METHODS = {"split", "chunk", "tensor_split", "split_with_sizes", "unbind"}
_SPLIT_FUNCTIONS = {torch.split, torch.chunk, torch.tensor_split, torch.unbind}
_SLICE_BLOCKER = ("weight is a slice of a parameter{what}: FP8 sites multiply whole parameters, the unit "
                  "their delayed-scaling state and FP8 weight copies are kept for")


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
        if node.target in ("addmm", "bmm", "baddbmm"):
            return node.target
    return None


def _is_matrix(node) -> bool:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 2


def _swaps_last_two_dims(node: torch.fx.Node) -> bool:
    """``w.transpose(-2, -1)`` (or ``(1, 2)`` of a 3-D ``w``, ``(0, 1)`` of a 2-D one)."""
    value = node.args[0].meta.get("example_value") if isinstance(node.args[0], torch.fx.Node) else None
    dims = tuple(node.args[1:3]) if len(node.args) >= 3 else (node.kwargs.get("dim0"), node.kwargs.get("dim1"))
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or not all(isinstance(d, int) for d in dims):
        return False
    return sorted(d % value.dim() for d in dims) == [value.dim() - 2, value.dim() - 1]


def _is_transpose(node: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target == "t":
        return True
    if node.op == "call_function" and node.target in _TRANSPOSE_TARGETS:
        return True
    if (node.op == "call_method" and node.target == "transpose"
            or node.op == "call_function" and node.target is torch.transpose):
        return _swaps_last_two_dims(node)
    return node.op == "call_function" and node.target is getattr and (
        node.args[1] == "mT" or node.args[1] == "T" and _is_matrix(node.args[0]))


class _Parameters:
    """Which graph nodes are parameters: placeholders fed a Parameter, or get_attr of one."""

    def __init__(self, gm: torch.fx.GraphModule, parameter_placeholders: set[torch.fx.Node]):
        self._nodes = set(parameter_placeholders)
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = getattr(gm, str(node.target), None)
                if isinstance(value, torch.nn.Parameter):
                    self._nodes.add(node)

    @property
    def nodes(self) -> frozenset[torch.fx.Node]:
        """The parameter nodes."""
        return frozenset(self._nodes)

    def slice_of(self, node) -> torch.fx.Node | None:
        """The parameter ``node`` is a piece of (``w.split(...)[i]``, ``w.chunk(3)[i]``, ``w[a:b]``), else None."""
        if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is not operator.getitem:
            return None
        source = node.args[0]
        if source in self._nodes:
            return source  # w[a:b]
        if isinstance(source, torch.fx.Node) and source.args and source.args[0] in self._nodes and (
                source.op == "call_method" and source.target in _SPLIT_METHODS
                or source.op == "call_function" and source.target in _SPLIT_FUNCTIONS):
            return source.args[0]
        return None

    def resolve(self, node) -> tuple[torch.fx.Node | None, bool]:
        """``(parameter node, transposed)`` when ``node`` is a parameter or its ``.t()``."""
        if not isinstance(node, torch.fx.Node):
            return None, False
        if node in self._nodes:
            return node, False
        if _is_transpose(node) and node.args[0] in self._nodes:
            return node.args[0], True
        return None, False


def _rows(lead: Sequence) -> int | str:
    """M of a GEMM whose left operand has leading dims ``lead``; symbolic dims stay symbolic."""
    if all(isinstance(d, int) for d in lead) or 0 in lead:  # a zero-size dim empties it, symbolic or not
        return math.prod(d for d in lead if isinstance(d, int)) if 0 not in lead else 0
    return " * ".join(str(d) for d in lead)  # dynamic token dimension: never specialized


def _fill_linear_shapes(site: LinearSite) -> None:
    input_value, weight_value = tensor_value(site.input_node), tensor_value(site.weight_node)
    if input_value is None or weight_value is None:
        return
    site.dtype = input_value.dtype
    if weight_value.dim() != 2:
        site.blocker = f"parameter operand is {weight_value.dim()}-D, not 2-D"
        return
    rows, columns = weight_value.shape
    site.N, site.K = (columns, rows) if site.weight_is_kn else (rows, columns)
    site.M = _rows(input_value.shape[:-1])
    bias_value = tensor_value(site.bias_node) if site.bias_node is not None else None
    if bias_value is not None and tuple(bias_value.shape) != (site.N,):
        # addmm's added term, or F.linear's, may be any tensor that broadcasts (a residual (M, N)): the FP8
        # linear adds a bias of N values and sums its gradient over the rows.
        site.blocker = site.blocker or (f"added term of shape {tuple(bias_value.shape)} is not a bias of its "
                                        f"{site.N} outputs")


def _fill_operand_shapes(site: Site, left, right, right_is_nk: bool = False) -> None:
    """M/K/N of a GEMM that will not be rewritten, for the report."""
    left_value, right_value = tensor_value(left), tensor_value(right)
    if left_value is None:
        return
    site.dtype = left_value.dtype
    if right_value is None or left_value.dim() < 1 or right_value.dim() < 2:
        return
    site.M = _rows(left_value.shape[:-1])  # batch dims count as rows
    # K and N of two activations may be symbolic too (attention's sequence length): as text, as M is, never a
    # SymInt kept past the trace (the regional compiler hashes the shapes).
    site.K = _rows(left_value.shape[-1:])
    site.N = _rows(right_value.shape[-2:-1] if right_is_nk else right_value.shape[-1:])


def _read_linear(where: dict, node: torch.fx.Node, params: _Parameters) -> Site:
    """``F.linear(input, weight, bias)``: a linear site, or a kept matmul when the weight is no parameter."""
    input_node, weight_argument = argument(node, 0, "input"), argument(node, 1, "weight")
    weight, transposed = params.resolve(weight_argument)
    if weight is not None:
        site = LinearSite(**where, input_node=input_node, weight_node=weight, weight_is_kn=transposed,
                          bias_node=argument(node, 2, "bias"))
        _fill_linear_shapes(site)
        return site
    site = MatmulSite(**where, input_node=input_node, other_node=weight_argument, bias_node=argument(node, 2, "bias"))
    if params.slice_of(weight_argument) is not None:
        owner = site.module_type
        what = (" (MultiheadAttention's packed in_proj_weight, split because key or value is not the query)"
                if isinstance(owner, type) and issubclass(owner, torch.nn.MultiheadAttention) else "")
        site.blocker = _SLICE_BLOCKER.format(what=what)
    else:
        site.blocker = "weight is not a parameter (computed in the graph)"
    _fill_operand_shapes(site, input_node, weight_argument, right_is_nk=True)
    return site


def _read_matmul(where: dict, node: torch.fx.Node, params: _Parameters) -> Site:
    """matmul / mm / bmm / addmm / baddbmm: a linear when the right operand is a parameter.

    Otherwise a matmul of two activations, whose added term (addmm, baddbmm)
    is kept in ``bias_node``.
    """
    op = where["op"]
    has_addend = op in ("addmm", "baddbmm")
    offset = 1 if has_addend else 0
    left_name, right_name = _OPERAND_KWARGS[op]
    left = argument(node, offset, left_name)
    right = argument(node, offset + 1, right_name)
    addend = argument(node, 0, "input") if has_addend else None
    blocker = None
    if has_addend and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        blocker = f"{op} with alpha or beta other than 1"
    if op == "bmm" and (gathered := read_gathered_experts(where, left, right, params.nodes)) is not None:
        return gathered
    weight, transposed = params.resolve(right)
    if weight is not None and op == "bmm" and getattr(tensor_value(weight), "ndim", 0) == 3:
        return read_dense_experts(where, left, weight, transposed)
    if weight is not None and op != "baddbmm":
        # matmul(x, W) with W stored (K, N) is a linear with weight W^T.
        site = LinearSite(**where, input_node=left, weight_node=weight, weight_is_kn=not transposed,
                          bias_node=addend, blocker=blocker)
        _fill_linear_shapes(site)
        return site
    site = MatmulSite(**where, input_node=left, other_node=right, bias_node=addend, blocker=blocker)
    _fill_operand_shapes(site, left, right)
    left_value, right_value = tensor_value(left), tensor_value(right)
    if params.resolve(left)[0] is not None:
        site.blocker = site.blocker or "parameter is the left operand"
    elif left_value is None or right_value is None or left_value.dim() < 2 or right_value.dim() < 2:
        site.blocker = site.blocker or "matmul with a 1-D operand"
    return site


def _read_site(node: torch.fx.Node, op: str, params: _Parameters, path: str) -> Site:
    where = dict(node=node, op=op, path=path, module_type=module_type(node))
    site = _read_linear(where, node, params) if op == "linear" else _read_matmul(where, node, params)
    if node.kwargs.get("out") is not None:  # the rewrite would drop the write into a tensor the graph holds
        site.blocker = site.blocker or f"{op} writes its result into out="
    return site


@dataclasses.dataclass(frozen=True)
class _FusedCall:
    """A call that runs a module's GEMMs inside itself, kept with ``reason``: its arguments' names, and
    per GEMM ``(input argument, weight argument, bias argument, child)``; a GEMM of an activation computed
    inside the call has the rows of the first one's. The GEMM is a site of that child of the calling
    module when the caller is an ``owner`` (whose children have the types ``children``)."""

    reason: str
    arguments: tuple[str, ...]
    gemms: tuple[tuple[str | None, str, str | None, str], ...]
    owner: type
    children: dict[str, type]


_FAST_PATH_ADVICE = ("its GEMMs run inside one ATen op; torch.backends.mha.set_fastpath_enabled(False) before "
                     "compiling makes them linear sites")
_MHA_GEMMS = (("query", "qkv_weight", "qkv_bias", ""), (None, "proj_weight", "proj_bias", "out_proj"))
_FUSED_CALLS = {
    torch._native_multi_head_attention: _FusedCall(
        f"fused MultiheadAttention fast path (torch._native_multi_head_attention): {_FAST_PATH_ADVICE}",
        ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias",
         "mask", "need_weights", "average_attn_weights", "mask_type"),
        _MHA_GEMMS, torch.nn.MultiheadAttention,
        {"": torch.nn.MultiheadAttention, "out_proj": torch.nn.modules.linear.NonDynamicallyQuantizableLinear}),
    torch._transformer_encoder_layer_fwd: _FusedCall(
        f"fused TransformerEncoderLayer fast path (torch._transformer_encoder_layer_fwd): {_FAST_PATH_ADVICE}",
        ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "use_gelu",
         "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2", "norm_bias_2", "ffn_weight_1",
         "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask", "mask_type"),
        (("src", "qkv_weight", "qkv_bias", "self_attn"), (None, "proj_weight", "proj_bias", "self_attn.out_proj"),
         (None, "ffn_weight_1", "ffn_bias_1", "linear1"), (None, "ffn_weight_2", "ffn_bias_2", "linear2")),
        torch.nn.TransformerEncoderLayer,
        {"self_attn": torch.nn.MultiheadAttention,
         "self_attn.out_proj": torch.nn.modules.linear.NonDynamicallyQuantizableLinear,
         "linear1": torch.nn.Linear, "linear2": torch.nn.Linear}),
}


def _unexpanded_attention(node: torch.fx.Node, reason: str) -> _FusedCall:
    """An ``F.multi_head_attention_forward`` call ``expand_attention`` could not open, as a fused call."""
    separate = attention_arguments(node).get("use_separate_proj_weight", False)
    in_proj = ((("query", "q_proj_weight", None, ""), ("key", "k_proj_weight", None, ""),
                ("value", "v_proj_weight", None, "")) if separate else (("query", "in_proj_weight", "in_proj_bias", ""),))
    return _FusedCall(f"F.multi_head_attention_forward left as one call ({reason}): its GEMMs run inside it",
                      MHA_ARGUMENTS, in_proj + ((None, "out_proj_weight", "out_proj_bias", "out_proj"),),
                      torch.nn.MultiheadAttention,
                      {"": torch.nn.MultiheadAttention,
                       "out_proj": torch.nn.modules.linear.NonDynamicallyQuantizableLinear})


def _fused_sites(node: torch.fx.Node, fused: _FusedCall, params: _Parameters, path: str) -> list[Site]:
    """One kept site per weight ``fused`` multiplies, named by the child module that owns it."""
    arguments = dict(zip(fused.arguments, node.args), **node.kwargs)
    owner = module_type(node)
    is_owner = isinstance(owner, type) and issubclass(owner, fused.owner)
    rows = tensor_value(arguments.get(fused.gemms[0][0]))
    sites = []
    for input_name, weight_name, bias_name, child in fused.gemms:
        weight = arguments.get(weight_name)
        site = FusedCallSite(node=node, op="linear",
                             path=".".join(p for p in (path, child if is_owner else "") if p),
                             module_type=fused.children[child] if is_owner else owner,
                             input_node=arguments.get(input_name), weight_node=params.resolve(weight)[0],
                             bias_node=arguments.get(bias_name), blocker=fused.reason)
        input_value, weight_value = tensor_value(site.input_node) if input_name else rows, tensor_value(weight)
        if input_value is not None and weight_value is not None and weight_value.dim() == 2:
            site.dtype = input_value.dtype
            site.N, site.K = weight_value.shape
            site.M = _rows(input_value.shape[:-1])
        sites.append(site)
    return sites


def _owned_by_a_child(site: Site, top_parameter: torch.fx.Node | None, values: dict,
                      owner_paths: dict[int, tuple[str, type]]) -> None:
    """Name ``site`` after the module whose parameter it multiplies when that module is a child of the
    caller: Mamba's mixer computes ``self.dt_proj.weight @ x`` without calling ``dt_proj``, and a report
    that named only the mixer would not show the ``dt_proj`` linear at all."""
    owner = owner_paths.get(id(values.get(top_parameter)))
    if owner is None:
        return
    owner_path = owner[0]
    is_child = owner_path.startswith(f"{site.path}.") if site.path else bool(owner_path)
    if is_child:
        site.path, site.module_type = owner


def find_sites(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    paths_by_id: dict[str, str] | None = None,
    owner_paths: dict[int, tuple[str, type]] | None = None,
) -> list[Site]:
    """Every linear or matmul node of ``gm`` and of the subgraphs it calls, in graph order.

    Sites inside a subgraph (a ``torch.utils.checkpoint`` region) record
    their ``graph_module``; their parameters are found through the operands
    the outer graph passes in. ``owner_paths`` (``{id(parameter): (path, type) of the module holding it}``)
    names a site whose parameter belongs to a child of the calling module after that child.
    """
    top_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    top_values = dict(zip(top_placeholders, example_inputs))
    top_parameters = {n for n, v in top_values.items() if isinstance(v, torch.nn.Parameter)}
    subgraphs = Subgraphs(gm)
    sites = []
    for graph_module in subgraphs:
        body_parameters = {n for n in graph_module.graph.nodes if n.op == "placeholder"
                           and subgraphs.top_node(n, graph_module) in top_parameters}
        params = _Parameters(graph_module, body_parameters)
        for node in graph_module.graph.nodes:
            op = _op_name(node)
            if op is not None:
                found = [_read_site(node, op, params, module_path(node, paths_by_id))]
            elif is_grouped_gemm(node):
                found = [GroupedExpertSite(node=node, op=GROUPED_OP, path=module_path(node, paths_by_id),
                                           module_type=module_type(node))]
                read_grouped(found[0], node, params.resolve)
                read_gather(found[0])
                read_swiglu(found[0])
                read_combine(found[0])
            elif node.op == "call_function" and node.target in _FUSED_CALLS:
                found = _fused_sites(node, _FUSED_CALLS[node.target], params, module_path(node, paths_by_id))
            elif is_multi_head_attention(node):
                found = _fused_sites(node, _unexpanded_attention(node, node.meta.get(UNEXPANDED_KEY, "not opened")),
                                     params, module_path(node, paths_by_id))
            else:
                continue
            for site in found:
                site.graph_module = graph_module
                site.in_subgraph = graph_module is not gm
                site.checkpoint_region = subgraphs.checkpoint_region(graph_module)
                weight = site.weight_node if isinstance(site, LinearSite) else None
                if weight is not None:
                    site.weight_input = subgraphs.top_node(weight, graph_module)
                parameter = weight or params.resolve(site.input_node)[0]
                if owner_paths and parameter is not None:
                    _owned_by_a_child(site, subgraphs.top_node(parameter, graph_module), top_values, owner_paths)
                sites.append(site)
    mark_gates(sites)
    pair_expert_stages(sites)
    _count_input_readers(sites)
    return sites


def _count_input_readers(sites: list[Site]) -> None:
    """Each plain linear site's ``input_readers``: the plain linears of its graph and checkpoint region (the sites
    ``passes.group_sites`` may cast one input for) that read the same input node. Sites that cannot run in FP8
    whatever the recipe (a ``blocker``, a dimension no FP8 GEMM takes, a dtype fp8graph leaves alone) and gates
    (kept in high precision unless a rule names them) share no cast."""
    readers = collections.Counter(_input_key(site) for site in sites if _shares_input(site))
    for site in sites:
        if _shares_input(site):
            site.input_readers = readers[_input_key(site)]


def _shares_input(site: Site) -> bool:
    return (type(site) is LinearSite and site.blocker is None and site.gate is None and site.input_node is not None
            and site.dtype in REPLACEABLE_DTYPES and misaligned(None, K=site.K, N=site.N) is None)


def _input_key(site: Site) -> tuple:
    return id(site.graph_module), id(site.checkpoint_region), site.input_node
