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

The other way round, the delayed-scaling state a backward reads and updates
(``fp8graph.buffers.delayed_state``) must be read when the backward runs, as the module
holds it then: backwards of other calls may have recorded since this call's
forward (a module called twice, micro-batches summed into one loss).
:func:`read_in_backward` ties each buffer to the backward's gradient, so no
op on it can move into the forward and be saved from there; and
:class:`StateBuffersUnchecked` tells the partitioner to save the buffers
without the version check, as eager autograd keeps what a function stores
on its context.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.utils.checkpoint import CheckpointPolicy

from fp8graph.targets.inductor_passes import ChainedGraphPass, composed

__all__ = ["StateBuffersUnchecked", "joint_pre_pass", "keep_for_backward", "partition_min_cut", "read_in_backward",
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


class StateBuffersUnchecked(ChainedGraphPass):
    """Joint-graph pass (Inductor's ``joint_custom_pre_pass``): the graph inputs that
    ``fp8graph::record_delayed_`` updates are saved for the backward without the version check, as
    eager autograd keeps them (see the module's doc)."""

    def run(self, graph: torch.fx.Graph) -> None:
        for update in _state_updates(graph):
            for base in update.kwargs.get("_all_bases", ()):
                if isinstance(base, torch.fx.Node) and base.op == "placeholder":
                    base.meta["saved_tensor_with_no_vc_check"] = True


def joint_pre_pass(configured) -> object:
    """The ``joint_custom_pre_pass`` to compile with, given the one configured (``inductor_passes.composed``)."""
    return composed(StateBuffersUnchecked, configured, "delayed-scaling state is saved with the version check, "
                                                       "so a second forward before the backward fails it")


def partition_min_cut(joint_module: torch.fx.GraphModule, joint_inputs, **kwargs):
    """AOTAutograd's min-cut partitioner after :class:`StateBuffersUnchecked`, for compilers that run no
    Inductor joint passes (``compiler="aot_eager"``)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    StateBuffersUnchecked()(joint_module.graph)
    return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
