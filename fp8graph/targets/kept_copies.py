"""FP8 copies kept between calls, written by the kernel that casts them (Inductor's post-grad graph).

A call that fills the weights' FP8 copies (``fp8graph.buffers.weight_cache``) casts each weight, lets its
GEMMs read the cast and copies it into the module's buffers. AOTAutograd moves a graph input's mutation to
the end of the graph (``buffer.copy_(cast)`` after the GEMMs), and by then Inductor has realized the cast in
a buffer of its own for the GEMMs: the cast kernel stores every FP8 value twice, to that buffer and to the
copy (on Qwen3-30B-A3B's MoE block, 1.21 GB of expert weights stored twice a fill).

:class:`KeptCopiesWrittenWhereCast` moves such a ``copy_`` to just after the value it copies and lets the
value's readers read the buffer, so Inductor realizes the cast into the buffer itself (``copy_`` of a value
not yet realized writes it in place) and the GEMMs read the copy. It only moves a copy into an FP8 graph
input that nothing else in the graph reads: the input's old contents are never read, so writing it earlier
changes no value.
"""

from __future__ import annotations

import torch
import torch.fx

from fp8graph.numerics.formats import is_fp8
from fp8graph.targets.inductor_passes import ChainedGraphPass, composed

__all__ = ["KeptCopiesWrittenWhereCast", "post_grad_post_pass"]


def _overwritten_fp8_input(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """For ``copy_(input, value)`` into an FP8 graph input whose old contents no node reads: ``(value, source)``,
    the value it copies and what that value is a copy of (``aten.copy(input, source)``, a copy laid out as the
    input, reads only the input's layout); else ``None``."""
    if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
        return None
    destination, value = node.args[:2]
    meta = destination.meta.get("val") if isinstance(destination, torch.fx.Node) else None
    if destination.op != "placeholder" or meta is None or not is_fp8(meta.dtype):
        return None
    if not isinstance(value, torch.fx.Node) or value.op != "call_function":
        return None
    source = value
    if value.target is torch.ops.aten.copy.default and value.args[0] is destination:
        source = value.args[1]
    old_contents_read = [user for user in destination.users if user not in (node, value)]
    if old_contents_read or not isinstance(source, torch.fx.Node) or source.op != "call_function":
        return None
    return (value, source) if getattr(source.meta.get("val"), "shape", None) == meta.shape else None


class KeptCopiesWrittenWhereCast(ChainedGraphPass):
    """Post-grad pass (Inductor's ``post_grad_custom_post_pass``): see the module's doc."""

    def run(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            found = _overwritten_fp8_input(node)
            if found is None:
                continue
            value, source = found
            readers = [user for user in value.users if user is not node]
            node.args = (node.args[0], source, *node.args[2:])
            source.append(node)  # right after what it copies, before any reader of the copy
            for reader in readers:
                reader.replace_input_with(value, node)
            if value is not source and not value.users:
                graph.erase_node(value)


def post_grad_post_pass(configured) -> object:
    """The ``post_grad_custom_post_pass`` to compile with, given the one configured
    (``inductor_passes.composed``)."""
    return composed(KeptCopiesWrittenWhereCast, configured, "fills store their casts twice")
