"""Open ``F.multi_head_attention_forward`` calls into the torch ops they run.

Dynamo keeps PyTorch's multi-head attention as one opaque call (torch 2.13 lists
``torch.nn.functional.multi_head_attention_forward`` among the functions it puts
in the graph as they are), so the GEMMs of every ``nn.MultiheadAttention`` and
``nn.Transformer*Layer`` reach the backend hidden inside it::

    before:  out = multi_head_attention_forward(q, q, q, 64, 4, in_proj_weight, in_proj_bias, ...,
                                                out_proj_weight, out_proj_bias, training=True, ...)
             attn = out[0]

    after:   proj = linear(q, in_proj_weight, in_proj_bias)          site of self_attn
             proj = proj.unflatten(-1, (3, 64)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
             ...view / transpose / scaled_dot_product_attention ...
             attn = linear(o, out_proj_weight, out_proj_bias)        site of self_attn.out_proj

The ops are PyTorch's own: the function runs once on the call's fake values
under a ``TorchFunctionMode`` that records every torch call it makes, at the
level Dynamo records them (``F.linear``, ``F.softmax``, tensor methods), as
graph nodes in place of the call. Its branches (packed or separate
projection weights, self- or cross-attention, masks, ``need_weights``) are
therefore taken exactly as at run time; AOTAutograd traced the opaque call
into the same ops. The output projection's linear gets a module-stack entry
for ``out_proj``, whose own ``forward`` never runs.

A call is left as it is, with the reason in ``node.meta[UNEXPANDED_KEY]``,
when its shapes are dynamic (sizes would be baked in), a value of it is
used other than through ``out[i]``, or the function does something the
recording cannot replay; ``find_sites`` then lists its GEMMs as kept.
Removes no node but the calls it replaces (``side_effects``).
"""

from __future__ import annotations

import inspect
import operator
import types

import torch
import torch.fx
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .module_paths import with_child_module
from .side_effects import REPLACES_KEY

__all__ = ["MHA_ARGUMENTS", "UNEXPANDED_KEY", "attention_arguments", "expand_attention", "is_multi_head_attention"]

UNEXPANDED_KEY = "fp8graph_attention_unexpanded"
MHA_ARGUMENTS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)
# Tensor methods Dynamo records as operator calls, not method calls.
_OPERATORS = {"__getitem__": operator.getitem, "__add__": operator.add, "__sub__": operator.sub,
              "__mul__": operator.mul, "__truediv__": operator.truediv, "__neg__": operator.neg}


def is_multi_head_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.multi_head_attention_forward


def attention_arguments(call: torch.fx.Node) -> dict:
    """An ``F.multi_head_attention_forward`` call's arguments by name, positional or keyword."""
    return dict(zip(MHA_ARGUMENTS, call.args), **call.kwargs)


class _CannotExpand(Exception):
    pass


def _unchecked_multi_head_attention_forward():
    """``F.multi_head_attention_forward`` without its first step, the hand-off to ``__torch_function__``:
    under the recording mode that step would hand the whole call back to the mode, unopened."""
    function = F.multi_head_attention_forward
    namespace = dict(function.__globals__, has_torch_function=lambda operands: False)
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


class _Recorder(TorchFunctionMode):
    """Runs torch calls on fake values and appends each one that returns tensors to ``graph`` as a node."""

    def __init__(self, graph: torch.fx.Graph, nodes_by_value: dict[int, torch.fx.Node], meta: dict):
        super().__init__()
        self.graph, self.nodes_by_value, self.meta = graph, nodes_by_value, meta
        self.values: list[torch.Tensor] = []  # keeps every recorded value alive: its id stays its own
        self.created: list[torch.fx.Node] = []

    def node_of(self, value):
        if isinstance(value, torch.Tensor):
            node = self.nodes_by_value.get(id(value))
            if node is None:
                raise _CannotExpand("a tensor that does not come from the graph")
            return node
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _CannotExpand("dynamic shapes")
        return value

    def _add(self, op: str, target, args, kwargs, value) -> torch.fx.Node:
        node = self.graph.create_node(op, target, args, kwargs)
        node.meta.update(self.meta)
        node.meta["example_value"] = value
        self.created.append(node)
        if isinstance(value, torch.Tensor):
            self.values.append(value)
            self.nodes_by_value[id(value)] = node  # an in-place method returns its operand: read it here on
        return node

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        tensors = [v for v in tree_flatten(result)[0] if isinstance(v, torch.Tensor)]
        if not tensors:
            return result  # a size, dtype or flag: a constant of this graph (shapes are static)
        node_args, node_kwargs = tree_map(self.node_of, args), tree_map(self.node_of, kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a tensor property (x.T, x.mT)
            node = self._add("call_function", getattr, (node_args[0], func.__self__.__name__), {}, result)
        elif name in _OPERATORS and getattr(torch.Tensor, name, None) is func:
            node = self._add("call_function", _OPERATORS[name], node_args, node_kwargs, result)
        elif getattr(torch.Tensor, name, None) is func:
            node = self._add("call_method", name, node_args, node_kwargs, result)
        else:
            node = self._add("call_function", func, node_args, node_kwargs, result)
        if isinstance(result, (tuple, list)):
            for index, item in enumerate(result):
                if isinstance(item, torch.Tensor):
                    self._add("call_function", operator.getitem, (node, index), {}, item)
                elif item is not None:
                    raise _CannotExpand(f"{name} returned a {type(item).__name__} among its tensors")
        return result


def _fake_value(arg):
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("example_value", arg.meta.get("val"))
        if not isinstance(value, torch.Tensor):
            raise _CannotExpand(f"no fake value for {arg.name}")
        if any(not isinstance(size, int) for size in value.shape):
            raise _CannotExpand("dynamic shapes")
        return value
    return arg


def _expand(graph_module: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    users = list(call.users)
    if not all(user.target is operator.getitem and isinstance(user.args[1], int) for user in users):
        raise _CannotExpand("its result is used other than as out[0], out[1]")
    args, kwargs = tree_map(_fake_value, (call.args, call.kwargs))
    fake_modes = {id(v.fake_mode): v.fake_mode for v in tree_flatten((args, kwargs))[0]
                  if isinstance(v, torch._subclasses.FakeTensor)}
    if len(fake_modes) != 1:
        raise _CannotExpand("its values are not fake tensors of one mode")
    [fake_mode] = fake_modes.values()
    nodes_by_value = {id(value): node for node, value in zip(tree_flatten((call.args, call.kwargs))[0],
                                                               tree_flatten((args, kwargs))[0])
                      if isinstance(node, torch.fx.Node)}
    # The ops stand for the call (the side-effect check keeps it where they are); what was read of the call
    # itself (its value, its effects, its stamp) is not theirs.
    meta = {key: value for key, value in call.meta.items()
            if key not in ("example_value", "val") and not key.startswith("fp8graph_")}
    meta[REPLACES_KEY] = call
    graph = graph_module.graph
    recorder = _Recorder(graph, nodes_by_value, meta)
    try:
        with graph.inserting_before(call), fake_mode, recorder:
            outputs = _unchecked_multi_head_attention_forward()(*args, **kwargs)
        replacements = [None if value is None else recorder.node_of(value) for value in outputs]
        for user in users:
            if replacements[user.args[1]] is None and user.users:
                raise _CannotExpand("its attention weights are None but read")
    except Exception as error:
        for node in reversed(recorder.created):
            graph.erase_node(node)
        if isinstance(error, _CannotExpand):
            raise
        raise _CannotExpand(f"{type(error).__name__}: {error}") from None
    _name_out_proj(recorder.created, call)
    for user in users:
        replacement = replacements[user.args[1]]
        if replacement is not None:
            user.replace_all_uses_with(replacement)
        graph.erase_node(user)
    graph.erase_node(call)


def _name_out_proj(created: list[torch.fx.Node], call: torch.fx.Node) -> None:
    """The output projection is ``nn.MultiheadAttention``'s ``out_proj``: its linear gets that module's path."""
    owner = (call.meta.get("nn_module_stack") or {}).values()
    owner_type = list(owner)[-1][1] if owner else None
    if not (isinstance(owner_type, type) and issubclass(owner_type, torch.nn.MultiheadAttention)):
        return  # a direct call of the function: no out_proj module to name
    weight = attention_arguments(call).get("out_proj_weight")
    for node in created:
        if node.target is torch._C._nn.linear and len(node.args) > 1 and node.args[1] is weight:
            node.meta["nn_module_stack"] = with_child_module(
                node.meta["nn_module_stack"], "out_proj", torch.nn.modules.linear.NonDynamicallyQuantizableLinear)


def expand_attention(graph_module: torch.fx.GraphModule) -> int:
    """Replace each ``F.multi_head_attention_forward`` call of ``graph_module`` by the ops it runs;
    returns how many. A call that cannot be opened stays, its reason in ``node.meta[UNEXPANDED_KEY]``."""
    expanded = 0
    for call in list(graph_module.graph.nodes):
        if not is_multi_head_attention(call):
            continue
        try:
            _expand(graph_module, call)
        except _CannotExpand as error:
            call.meta[UNEXPANDED_KEY] = str(error)
            continue
        expanded += 1
        counters["fp8graph"]["attention_expanded"] += 1
    if expanded:
        graph_module.recompile()
    return expanded
