"""The stats buffers: where the compiled graphs write each site's FP8 health.

How they reach the graph: :func:`register_stats_buffers` registers on every module a
non-persistent buffer ``fp8graph_stats`` of shape (3 roles, 5 metrics), and
on every submodule a forward hook that passes the module's buffer (and the
root's, for sites in the root's own forward, whose hooks Dynamo runs outside
the graph) to :func:`stats_anchor`. Dynamo therefore lifts the buffers as
graph inputs; the backend removes the anchors and hands each FP8 site the
buffer of its module, whose forward writes the input and weight rows and
whose backward writes the grad_output row, in place (AOTAutograd keeps input
mutations, also from backward). A module with two sites in one graph (called
twice, an experts module's two GEMMs) reports its last site in all three rows
(``AnchoredBuffers.note_stats_writers``); one whose sites land in two training graphs is refused (see
``FP8Backend._claim_written_buffers``). A module reachable by two paths
reports under its first (``named_modules()``). Without ``stats=True`` none of this exists: no buffer, no
hook, no extra graph node.

Why a buffer per module and not one for the model: a buffer that backward
writes is saved for backward, and autograd refuses a saved tensor that
changed since. With one shared buffer, a model compiled into several graphs
(a graph break between layers, FSDP2's per-layer graphs) would have the
second graph's forward change what the first graph's backward saved. The
root's buffer is anchored in every graph but only written by sites in the
root's own forward; a model with no submodules has only the root's, and
Dynamo runs the root's hooks outside the graph, so its stats stay empty.
The hook runs after the module's forward, so DDP's graph split keeps it in
the same piece as the module's GEMM (see ``fp8graph.buffers.delayed_state``).
"""

from __future__ import annotations

import torch

from fp8graph.buffers.anchors import AnchorHook, NewBuffer, register_new_buffers, remove_buffer
from fp8graph.numerics.formats import ROLES
from fp8graph.numerics.health import HEALTH_METRICS

__all__ = ["STATS_BUFFER", "register_stats_buffers", "remove_stats_buffers"]

STATS_BUFFER = "fp8graph_stats"
_REGISTERED_ATTRIBUTE = "_fp8graph_stats_buffers"


def register_stats_buffers(model: torch.nn.Module):
    """Register the buffers (NaN: nothing recorded yet) and the hooks that anchor them; returns
    ``(modules by path, hook handles)``.

    A model that holds them already (compiled before with ``stats=True``, or a copy of one) keeps
    them: the new compile writes the same buffers.
    """
    earlier = model.__dict__.get(_REGISTERED_ATTRIBUTE)
    if earlier is not None:
        return earlier
    modules = dict(model.named_modules())  # a module reached by two paths: its first
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    register_new_buffers([NewBuffer(module, path, STATS_BUFFER, torch.full((len(ROLES), len(HEALTH_METRICS)),
                                                                            float("nan"), device=device),
                                    persistent=False) for path, module in modules.items()],
                         if_taken="a buffer of that name that is not fp8graph's: rename it, or build a fresh model")
    # Dynamo runs the root module's own hooks outside the graph, but inlines
    # those of the modules called inside it: hook every submodule, passing its
    # buffer and the root's. A bare module (no submodules) is its own only
    # hook: fp8graph.compile then traces its hooks.
    hook = AnchorHook("stats", [(None, (STATS_BUFFER,)), (model, (STATS_BUFFER,))])
    bare = next(model.children(), None) is None
    hooks = [module.register_forward_hook(hook) for module in model.modules() if module is not model or bare]
    model.__dict__[_REGISTERED_ATTRIBUTE] = modules, hooks
    return modules, hooks


def remove_stats_buffers(model: torch.nn.Module) -> None:
    """Undo :func:`register_stats_buffers`: the hooks and the buffers go (compiled graphs recompile); a model
    without them is left as it is."""
    modules, hooks = model.__dict__.pop(_REGISTERED_ATTRIBUTE, ({}, []))
    for hook in hooks:
        hook.remove()
    for module in modules.values():
        remove_buffer(module, STATS_BUFFER)
