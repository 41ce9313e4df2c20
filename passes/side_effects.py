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

import dataclasses
import inspect
import operator
import types

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EFFECTS_KEY", "Effects", "REPLACES_KEY", "UNKNOWN", "effects_of", "has_side_effects", "side_effect_nodes",
           "written_nodes"]

# The in-place operators of Python's data model: ``y += x`` reaches the graph as operator.iadd.
_INPLACE_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift,
}
# Name fragments of the ops that draw from the random number generator, for a node the probe cannot run:
# moving or deleting one changes every random number drawn after it.
_RANDOM_FRAGMENTS = ("rand", "dropout", "bernoulli", "multinomial", "poisson", "rrelu")
_RANDOM_NAMES = {"normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
                 "seed", "manual_seed"}
# Functions that change the generator itself rather than draw from it: never run by the probe (they would
# reseed the process's real generator), always a side effect.
_GENERATOR_STATE_NAMES = {"seed", "manual_seed", "set_rng_state", "get_rng_state", "fork_rng"}
# Their method spellings (``y.__iadd__(x)`` reaches the graph as call_method __iadd__), and ``__idiv__``: Python 2's
# name for ``/=``, which torch.Tensor still defines.
_IN_PLACE_DUNDERS = {f"__{name.__name__}__" for name in _INPLACE_OPERATORS} | {"__idiv__"}
# Where a target the probe may run comes from: torch's ops (their effects go through the dispatcher, where
# the probe sees them), Python's operators on tensors and the builtins Dynamo leaves in graphs.
_PROBED_MODULES = ("torch", "operator", "_operator", "builtins", "math")
EFFECTS_KEY = "fp8graph_effects"
# On a node a pass made to stand for one it removed (the ops of an opened call): the node it replaces.
REPLACES_KEY = "fp8graph_replaces"


class _Unknown:
    """What :func:`written_nodes` returns for a node that may write anything."""

    def __repr__(self):
        return "UNKNOWN"


UNKNOWN = _Unknown()


@dataclasses.dataclass(frozen=True)
class Effects:
    """What one node does besides computing its result.

    ``written``: the graph nodes whose storage it writes (``()`` for none), or :data:`UNKNOWN` when it may
    write anything it can reach; ``draws_random``: it draws from the random number generator (or changes it).
    """

    written: tuple | _Unknown
    draws_random: bool

    @property
    def any(self) -> bool:
        return self.written is UNKNOWN or bool(self.written) or self.draws_random


_OPAQUE = Effects(UNKNOWN, False)
_NONE = Effects((), False)


def effects_of(node: torch.fx.Node) -> Effects:
    """What ``node`` does, known by running it, not by how it is spelled.

    A call of a torch op, a tensor method or a Python operator runs once on fresh fake tensors shaped as
    its arguments (their values are never touched) under a dispatch mode that records every ATen op it
    reaches: an argument is written where an op's schema marks a write into its storage (``relu_`` behind
    ``F.relu(h, inplace=True)``, ``copy_`` behind ``x[i] = v``, ``out=``), and a draw is an op tagged
    ``nondeterministic_seeded`` (``bernoulli_`` behind ``F.dropout``). A write into storage that is neither an
    argument's nor made during the call is a write to something else the graph holds: :data:`UNKNOWN`.
    Modules, higher-order ops, FX's impure calls (grad mode, autocast, profiler ranges, asserts) and code
    from outside torch are opaque: :data:`UNKNOWN`. A call the probe cannot run (no example values, or a
    data-dependent op) is read from its spelling instead. Never raises: a schema or probe that fails on a
    call torch did not foresee leaves the call to its spelling, and a spelling that cannot be read either
    leaves :data:`UNKNOWN`. Remembered in ``node.meta``.
    """
    # Remembered with the call it was read from: a pass that copies a node's meta onto another call, or gives
    # the node other arguments, does not carry the answer over.
    call = (node.op, node.target, node.args, node.kwargs)
    cached = node.meta.get(EFFECTS_KEY)
    if cached is None or not _same_call(cached[0], call):
        cached = node.meta[EFFECTS_KEY] = (call, _effects(node))
    return cached[1]


def _same_call(a: tuple, b: tuple) -> bool:
    try:
        return a[0] == b[0] and a[1] is b[1] and a[2] == b[2] and a[3] == b[3]
    except Exception:  # arguments whose comparison is not a bool (tensors as constants)
        return False


def _effects(node: torch.fx.Node) -> Effects:
    # A reader that raises must not stop the compile (the schema reader did, on ``h.__eq__(0)``): it only means
    # that reader cannot answer. The next one does, and "may write anything" is the answer of last resort.
    try:
        known = _effects_by_kind(node)
    except Exception:
        return _OPAQUE
    if known is not None:
        return known
    try:
        read = _effects_by_schema(node)
        if read is None:
            read = _probe(node)
    except Exception:
        read = None
    if read is not None:
        return read
    try:
        return _effects_by_spelling(node)
    except Exception:
        return _OPAQUE


def _effects_by_kind(node: torch.fx.Node) -> Effects | None:
    """The effects of the nodes known without reading the call: graph inputs and outputs, fp8graph's markers,
    and the calls never run (modules, higher-order ops, generator state, code from outside torch); None for a
    call to read."""
    if node.op in ("placeholder", "get_attr", "output"):
        return _NONE
    if getattr(node.target, "_fp8graph_writes_nothing", False):
        return _NONE  # fp8graph's own markers (the buffers' anchors): identities that only mark their inputs
    if node.op == "call_module" or isinstance(node.target, torch._ops.HigherOrderOperator):
        return _OPAQUE
    if _name(node) in _GENERATOR_STATE_NAMES:
        return Effects(UNKNOWN, True)
    if node.op == "call_function" and _has_global_effects(node.target):
        return _OPAQUE  # never run: grad mode, autocast, profiler ranges, asserts
    if node.op == "call_function" and not _from_probed_module(node.target):
        return _OPAQUE
    return None


# Where torch's C-bound functions live; each calls the ATen op of its own name.
_BINDING_MODULES = {"torch", "torch._C._nn", "torch._C._VariableFunctions", "torch._C._linalg", "torch._C._special",
                    "torch._C._fft"}
_C_METHOD_TYPES = (types.MethodDescriptorType, types.WrapperDescriptorType, types.BuiltinFunctionType)


def _effects_by_schema(node: torch.fx.Node) -> Effects | None:
    """No effects, read from the schemas, for a C-bound torch function or tensor method whose ATen op of
    the same name has no overload that writes a positional argument (or a keyword one the node passes) or
    draws random numbers; None where the probe must decide. An ATen op that writes its input says so in its
    schema; a C binding calls the op of its name, so no overload of it writing means the call writes
    nothing. This answers most of a graph's nodes (matmul, view, add) without running them.

    Only a real ATen op is read: ``torch.ops.aten`` is a Python object, and for a name it has as an attribute
    of its own (``__eq__``, ``__lt__``: every Python object's comparisons) it gives that method, which has no
    schema. A dunder may also call an op of another name (``__eq__`` calls ``eq``, ``__invert__``
    ``bitwise_not``); the probe runs those."""
    if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator") \
            and node.target not in _INPLACE_OPERATORS:
        return _NONE  # Python's out-of-place operators (a * b, x[i]): the data model keeps them out of place
    if node.op == "call_method":
        name = str(node.target)
        if not isinstance(getattr(torch.Tensor, name, None), _C_METHOD_TYPES):
            return None  # a method written in Python (torch/_tensor.py): the probe runs it
    elif isinstance(node.target, types.BuiltinFunctionType) and node.target.__module__ in _BINDING_MODULES:
        name = node.target.__name__
    else:
        return None
    if _is_in_place_name(name):
        return None  # spelled as a write: whatever its namesake's schema says, the probe decides
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if torch.Tag.nondeterministic_seeded in op.tags:
            return None
        for argument in op._schema.arguments:
            if _writes(argument) and (not argument.kwarg_only or argument.name in node.kwargs):
                return None
    return _NONE


def _has_global_effects(target) -> bool:
    """FX's list of calls whose effects are not on tensors (it also lists setitem, a tensor write the probe
    sees)."""
    try:
        return target in torch.fx.node._side_effectful_functions and target not in _INPLACE_OPERATORS
    except TypeError:  # an unhashable target
        return True


def _from_probed_module(target) -> bool:
    module = getattr(target, "__module__", None) or type(target).__module__ or ""
    return module.split(".")[0] in _PROBED_MODULES or isinstance(target, (torch._ops.OpOverload,
                                                                          torch._ops.OpOverloadPacket))


def _value(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


class _Recorder(TorchDispatchMode):
    """Records the storages each ATen op writes and whether one draws random numbers."""

    def __init__(self):
        super().__init__()
        self.written: list = []
        self.made: set = set()
        self.draws_random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.draws_random = True
        self.written += [_storage_of(t) for t in pytree.tree_leaves(_written_arguments(func._schema, args, kwargs))
                         if isinstance(t, torch.Tensor)]
        result = func(*args, **kwargs)
        self.made.update(_storage_of(t) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor))
        return result


def _storage_of(tensor: torch.Tensor):
    return StorageWeakRef(tensor.untyped_storage())


def _probe(node: torch.fx.Node) -> Effects | None:
    """Run ``node`` on fresh fake arguments and see what it writes and draws; None when it cannot run."""
    values = {n: _value(n) for n in node.all_input_nodes}
    if any(isinstance(v, torch.fx.Node) for v in values.values()):
        return None
    tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
    output = _value(node)
    fake_mode = detect_fake_mode(tensors + [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)])
    if fake_mode is None:
        if tensors or isinstance(output, torch.Tensor) or any(v is None for v in values.values()):
            return None  # real tensors (a frozen graph's constants) or no example values: not run
        return Effects((), _draws_random(node))  # no tensor in or out (arithmetic on sizes): none to write
    recorder = _Recorder()
    try:
        with fake_mode, torch.no_grad():
            fresh = {n: _fresh_like(v) for n, v in values.items()}
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: fresh[n])
            target = getattr(args[0], node.target) if node.op == "call_method" else node.target
            call_args = args[1:] if node.op == "call_method" else args
            with recorder:
                target(*call_args, **kwargs)
    except Exception:  # data-dependent outputs, ops fake tensors do not implement, ...
        return None
    storage_of_argument = {_storage_of(v): n for n, v in fresh.items() if isinstance(v, torch.Tensor)}
    written = []
    for storage in recorder.written:
        if storage in storage_of_argument:
            written.append(storage_of_argument[storage])
        elif storage not in recorder.made:
            return Effects(UNKNOWN, recorder.draws_random)
    return Effects(tuple(dict.fromkeys(written)), recorder.draws_random)


def _fresh_like(value):
    """A fake tensor of ``value``'s layout in a storage of its own, so nothing the probe runs touches the
    graph's example values; other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _is_in_place_name(name: str) -> bool:
    """``add_``, ``copy_``, ``index_add_``: PyTorch's spelling of an in-place op; ``__iadd__``, ``__setitem__``."""
    return name.endswith("_") and not name.startswith("__") or name in _IN_PLACE_DUNDERS


def _draws_random(node: torch.fx.Node) -> bool:
    name = _name(node).lower()
    if name.startswith("__") and name.endswith("__"):
        return False  # Python's operators draw nothing (``__rand__`` is a reflected ``&``)
    return name in _RANDOM_NAMES or any(fragment in name for fragment in _RANDOM_FRAGMENTS)


def _writes(argument) -> bool:
    """Whether a schema argument is written (``Tensor(a!)``)."""
    return argument.alias_info is not None and argument.alias_info.is_write


def _written_arguments(schema, args, kwargs) -> list:
    """The values passed (positionally or by keyword) for the arguments ``schema`` marks written."""
    return [args[index] if index < len(args) else kwargs.get(argument.name)
            for index, argument in enumerate(schema.arguments) if _writes(argument)]


def _mutated_schema_args(node: torch.fx.Node) -> list | None:
    """The arguments an OpOverload's schema marks written, or None when the target has no schema."""
    schema = getattr(node.target, "_schema", None)
    return None if schema is None else _written_arguments(schema, node.args, node.kwargs)


def _in_place_keyword(node: torch.fx.Node) -> bool:
    """``F.relu(x, inplace=True)``, ``F.dropout(x, 0.1, True, True)``: the ``inplace`` parameter, however passed."""
    if node.op != "call_function":
        return False
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("inplace") is True


def _effects_by_spelling(node: torch.fx.Node) -> Effects:
    """What a node the probe could not run writes, read from its name, schema and keywords."""
    out = node.kwargs.get("out")
    written = [out] if out is not None else []
    if node.op == "call_method":
        if _is_in_place_name(str(node.target)):
            written.append(node.args[0])
    elif node.target in _INPLACE_OPERATORS or _in_place_keyword(node):
        written.append(node.args[0])
    else:
        schema_written = _mutated_schema_args(node)
        if schema_written is not None:
            written += schema_written
        elif _is_in_place_name(_name(node)) and node.args:
            written.append(node.args[0])  # torch.relu_(x), torch.index_add_(x, ...)
    values = [value for value in _flatten(written) if value is not None]
    if not all(isinstance(value, torch.fx.Node) for value in values):
        return Effects(UNKNOWN, _draws_random(node))  # writes something that is not a graph value
    return Effects(tuple(values), _draws_random(node))


def written_nodes(node: torch.fx.Node):
    """The graph nodes whose storage ``node`` writes, or :data:`UNKNOWN` when it may write anything
    (``[]`` for a node that writes nothing)."""
    written = effects_of(node).written
    return written if written is UNKNOWN else list(written)


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
    return effects_of(node).any


def side_effect_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of ``gm`` with side effects, in graph order (placeholders and output left out)."""
    return [node for node in gm.graph.nodes if node.op not in ("placeholder", "output") and has_side_effects(node)]
