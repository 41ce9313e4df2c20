"""Which FP8 copies AOTAutograd's partitioner keeps from the forward for the backward.

The backward's GEMMs read a transposed FP8 copy of each input and weight
(``fp8graph.targets.linear_tensorwise``). Both layouts cost least written together in the
forward, from one read of the high-precision tensor. Left to itself, the
min-cut partitioner instead moves any op that only the backward uses into the
backward, and recomputes it there from what it saves anyway: each weight's
transposed copy from the parameter (a third read of every weight a step), an
activation's from the high-precision tensor or from its producer's inputs.

Two marks keep a copy in the forward:

- :func:`keep_for_backward` ties the copy to a value the forward needs (the
  dequantization factor its GEMM reads), so the copy is a forward node. The
  op behind it, ``fp8graph::depends_on``, costs nothing under Inductor (its
  lowering returns the value itself); elsewhere it is a small copy.
- :func:`saved_not_recomputed` marks the copy ``MUST_SAVE``
  (``node.meta["recompute"]``, which tracing copies from
  ``torch.fx.traceback.current_meta``), so the partitioner saves it rather than
  recomputing it from its inputs.

The tiled recipes' kernel (``fp8graph::quantize_tiles``) casts each input
along its rows in the forward and again along its columns in the backward
(``fp8graph.targets.linear_tiled``). The partitioner never makes again a tensor
that an opaque op reads in the backward: it would save the input in high
precision, twice the bytes of its FP8 copy. :class:`JointGraphMarks` settles
each such input: where an elementwise op made it (an RMSNorm's output,
SwiGLU's), it is marked ``PREFER_RECOMPUTE``, so the backward makes it again
from what it keeps anyway (the norm's input and its reciprocal root; the gate
and up projections' output); where another op made it (attention's output),
the two casts become one ``fp8graph::quantize_tiles_and_transpose`` in the
forward, which writes both layouts from one read, and the transposed copy is
kept. A graph input is left to the partitioner, which saves it: a weight is kept
anyway; an activation handed to the graph (a linear first in its region) is
saved in high precision.

The other way round, the delayed-scaling state a backward reads and updates
(``fp8graph.buffers.delayed_state``) must be read when the backward runs, as the module
holds it then: backwards of other calls may have recorded since this call's
forward (a module called twice, micro-batches summed into one loss).
:func:`read_in_backward` ties each buffer to the backward's gradient, so no
op on it can move into the forward and be saved from there; and
:class:`JointGraphMarks` tells the partitioner to save the buffers
without the version check, as eager autograd keeps what a function stores
on its context.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.utils.checkpoint import CheckpointPolicy

from fp8graph.targets.inductor_passes import ChainedGraphPass, composed

__all__ = ["JointGraphMarks", "joint_pre_pass", "keep_for_backward", "partition_min_cut", "read_in_backward",
           "saved_not_recomputed"]


@torch.library.custom_op("fp8graph::depends_on", mutates_args=())
def _depends_on(value: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """``value``, computed after ``others`` (a dependency for the partitioner, nothing else)."""
    return value.clone()


@_depends_on.register_fake
def _(value, others):
    return torch.empty_like(value)


def _register_inductor_lowering() -> None:
    from torch._inductor.lowering import register_lowering

    # An identity: no kernel, no copy. The op only exists for the partitioner.
    register_lowering(torch.ops.fp8graph.depends_on.default, type_promotion_kind=None)(
        lambda value, others: value)


_register_inductor_lowering()


def keep_for_backward(value: torch.Tensor, *kept: torch.Tensor | None) -> torch.Tensor:
    """``value``, made to depend on the tensors ``kept`` that are not ``None``: the forward computes
    them (see the module's doc)."""
    kept = [tensor for tensor in kept if tensor is not None]
    return torch.ops.fp8graph.depends_on(value, kept) if kept else value


def read_in_backward(buffer: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``buffer`` as it is when the backward that computes ``grad`` runs (see the module's doc)."""
    return torch.ops.fp8graph.depends_on(buffer, [grad])


_UNSET = object()


@contextlib.contextmanager
def saved_not_recomputed():
    """Ops traced in this context are saved for the backward, never recomputed there; outside tracing,
    nothing. Enter it around the op that makes the copy alone, so that its inputs stay free to fuse."""
    if not fx_traceback.has_preserved_node_meta():
        yield
        return
    meta = fx_traceback.current_meta
    before = meta.get("recompute", _UNSET)
    meta["recompute"] = CheckpointPolicy.MUST_SAVE
    try:
        yield
    finally:
        if before is _UNSET:
            del meta["recompute"]
        else:
            meta["recompute"] = before


def _state_updates(graph: torch.fx.Graph):
    """The functionalized ``fp8graph::record_delayed_`` calls of a joint graph."""
    record = torch.ops.fp8graph.record_delayed_.default
    for node in graph.nodes:
        if (node.op == "call_function" and getattr(node.target, "__name__", "").startswith("auto_functionalized")
                and node.args and node.args[0] is record):
            yield node


def _mark_state_buffers_unchecked(graph: torch.fx.Graph) -> None:
    """The graph inputs that ``fp8graph::record_delayed_`` updates are saved for the backward without the
    version check, as eager autograd keeps them (see the module's doc)."""
    for update in _state_updates(graph):
        for base in update.kwargs.get("_all_bases", ()):
            if isinstance(base, torch.fx.Node) and base.op == "placeholder":
                base.meta["saved_tensor_with_no_vc_check"] = True


def _is_view(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def _through_views(node) -> object:
    """The tensor ``node`` is a view of (``node`` itself if it is none)."""
    while _is_view(node):
        node = node.args[0]
    return node


def _mark_kernel_cast_inputs_made_again(graph: torch.fx.Graph) -> None:
    """Each input that fp8graph's tile kernel casts again in the backward (read through ``read_in_backward``):
    made again there where an elementwise op made it (marked ``PREFER_RECOMPUTE``), else cast in the forward in
    both layouts by one kernel and its transposed copy kept (see the module's doc)."""
    cast, tie = torch.ops.fp8graph.quantize_tiles.default, torch.ops.fp8graph.depends_on.default
    backward = None  # the backward's nodes, walked only for a graph that casts such an input
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not cast:
            continue
        tied = _through_views(node.args[0])
        if not (isinstance(tied, torch.fx.Node) and tied.target is tie):  # read_in_backward: cast in the backward
            continue
        source = tied.args[0]
        made = _through_views(source)
        if _pointwise(made):
            if made.meta.get("recompute") is None:
                made.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            continue
        if not isinstance(made, torch.fx.Node) or made.op == "placeholder":
            continue  # a weight, kept anyway, or an activation the graph is handed, which the partitioner saves
        backward = _backward_nodes(graph) if backward is None else backward
        if _read_in_backward_otherwise(made, tied, backward):
            continue  # saved anyway (attention's output, which its backward reads): cast again at no memory
        forward = next((user for user in source.users if user.target is cast and user.args[0] is source
                        and user.args[1:] == node.args[1:]), None)
        if forward is not None:
            _cast_both_ways_in_forward(graph, source, forward, node)


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a joint graph that the backward's gradients (its ``tangents_*`` inputs) flow into."""
    reached = [node for node in graph.nodes if node.op == "placeholder" and node.name.startswith("tangents")]
    seen = set(reached)
    while reached:
        for user in reached.pop().users:
            if user not in seen:
                seen.add(user)
                reached.append(user)
    return seen


def _read_in_backward_otherwise(made: torch.fx.Node, tied: torch.fx.Node, backward: set[torch.fx.Node]) -> bool:
    """Whether a backward node other than the tie ``tied`` reads ``made`` (or a view of it)."""
    readers = list(made.users)
    while readers:
        reader = readers.pop()
        if reader is tied:
            continue
        if _is_view(reader):
            readers.extend(reader.users)
        elif reader in backward:
            return True
    return False


def _cast_both_ways_in_forward(graph: torch.fx.Graph, source: torch.fx.Node, forward: torch.fx.Node,
                               backward: torch.fx.Node) -> None:
    """The forward's cast of ``source`` along its rows and the backward's along its columns become one
    ``fp8graph::quantize_tiles_and_transpose`` where the forward's is, which writes the same bytes from one read
    (its transposed copy then kept for the backward, one byte an element where ``source`` would be saved in
    two). Left alone where its outputs would not be what the two casts' were."""
    both_op = torch.ops.fp8graph.quantize_tiles_and_transpose.default
    values = (*forward.meta.get("val", ()), *backward.meta.get("val", ()))
    source_value = source.meta.get("val")
    fake_mode = getattr(source_value, "fake_mode", None)
    if len(values) != 4 or fake_mode is None:
        return
    with fake_mode:
        both_values = both_op(source_value, *forward.args[1:])
    if any((a.shape, a.stride(), a.dtype) != (b.shape, b.stride(), b.dtype) for a, b in zip(values, both_values)):
        return
    readers = [(user, index) for node, offset in ((forward, 0), (backward, 2)) for user in node.users
               if user.target is operator.getitem for index in [user.args[1] + offset]]
    if len(readers) != len(forward.users) + len(backward.users):
        return
    with graph.inserting_before(forward):
        both = graph.call_function(both_op, (source, *forward.args[1:]))
    both.meta.update(forward.meta)
    both.meta["val"] = tuple(both_values)
    for user, index in readers:
        user.args = (both, index)
    tied = backward.args[0]
    graph.erase_node(forward)
    graph.erase_node(backward)
    while isinstance(tied, torch.fx.Node) and not tied.users and tied.op == "call_function":
        following = tied.args[0]  # a view of what read_in_backward tied, then the tie itself
        graph.erase_node(tied)
        tied = following if following is not source else None


_COPIES = (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)


def _pointwise(node) -> bool:
    """A node an elementwise ATen op makes (no reduction, no randomness), which Inductor fuses into its reader."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)):
        return False
    tags = node.target.tags
    return (torch.Tag.pointwise in tags or node.target in _COPIES) and torch.Tag.nondeterministic_seeded not in tags


class JointGraphMarks(ChainedGraphPass):
    """Joint-graph pass (Inductor's ``joint_custom_pre_pass``) that prepares the graph for the partitioner:
    delayed scaling's state saved without the version check, and each activation fp8graph's tile kernel casts
    again in the backward made again there, or cast both ways in the forward (see the module's doc)."""

    def run(self, graph: torch.fx.Graph) -> None:
        _mark_state_buffers_unchecked(graph)
        _mark_kernel_cast_inputs_made_again(graph)


def joint_pre_pass(configured) -> object:
    """The ``joint_custom_pre_pass`` to compile with, given the one configured (``inductor_passes.composed``)."""
    return composed(JointGraphMarks, configured, "delayed-scaling state is saved with the version check, so a "
                                                 "second forward before the backward fails it; an activation "
                                                 "fp8graph's tile kernel casts again in the backward is saved in "
                                                 "high precision")


def partition_min_cut(joint_module: torch.fx.GraphModule, joint_inputs, **kwargs):
    """AOTAutograd's min-cut partitioner after :class:`JointGraphMarks`, for compilers that run no Inductor
    joint passes (``compiler="aot_eager"``)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    JointGraphMarks()(joint_module.graph)
    return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
