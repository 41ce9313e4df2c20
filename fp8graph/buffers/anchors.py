"""How buffers on the user's modules become inputs of the graphs that use them.

A buffer a module holds reaches a Dynamo graph only if the traced code
touches it. fp8graph's buffers (delayed-scaling state, weight caches, stats)
are touched by forward hooks that pass them to an *anchor*: an identity
function Dynamo keeps in the graph as a node (``allow_in_graph``). The
backend finds each kind of buffer among the graph's inputs by its anchor and
removes the anchors (``fp8graph.passes.anchored_inputs``).

Every kind goes through the same two steps, written here once:
:func:`register_new_buffers` adds a kind's buffers to the user's modules, all
or none (a name already taken anywhere refuses the whole set, so a refused
compile leaves the model as it was), and :class:`AnchorHook` is the forward
hook that anchors them. The hook is a class, not a closure, and the anchors
are named at module level, so a model that holds them deep-copies, pickles
and saves with ``torch.save``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import torch

__all__ = ["ANCHORS", "AnchorHook", "NewBuffer", "converted_buffers", "fill_anchor", "is_fp8graph_buffer",
           "make_anchor", "register_new_buffers", "remove_buffer", "restore_buffer_dtypes", "reuse_anchor",
           "state_anchor", "state_read_anchor", "stats_anchor"]

# On each module that holds fp8graph buffers: {buffer name: the dtype it was registered with}. Module.to(dtype)
# (and .half(), .bfloat16(), .double()) converts every floating-point buffer, fp8graph's included.
_DTYPES_ATTRIBUTE = "_fp8graph_buffer_dtypes"


def make_anchor(kind: str, what: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The anchor of one kind of buffer, ``<kind>_anchor``; assign it to that name in this module."""
    def anchor(*buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return buffers

    anchor.__name__ = anchor.__qualname__ = f"{kind}_anchor"
    anchor.__doc__ = f"Identity kept as a graph node: {what}."
    anchor.__module__ = __name__
    # Read by fp8graph.passes.side_effects: an identity whose node has no side effect to keep.
    anchor._fp8graph_writes_nothing = True
    return torch._dynamo.allow_in_graph(anchor)


state_anchor = make_anchor("state", "these delayed-scaling histories and scales are graph inputs, and this call "
                                    "updates them")
state_read_anchor = make_anchor("state_read", "these delayed-scaling histories and scales are graph inputs, and this "
                                              "call only reads them (an eval-mode module)")
stats_anchor = make_anchor("stats", "these stats buffers are graph inputs")
fill_anchor = make_anchor("fill", "these FP8 weight copies are graph inputs, and this call fills them")
reuse_anchor = make_anchor("reuse", "these FP8 weight copies are graph inputs, and this call reads them")
ANCHORS = {"state": state_anchor, "state_read": state_read_anchor, "stats": stats_anchor, "fill": fill_anchor,
           "reuse": reuse_anchor}


class AnchorHook:
    """Forward hook: passes buffers to the anchor of their kind, so the graph Dynamo traces takes them as inputs.

    ``sources`` pairs a module with the names of its buffers to pass; ``None``
    stands for the hooked module itself (one hook object then serves many
    modules). Subclasses choose the anchor per call by overriding
    :meth:`anchor_kind` (delayed state: updated or read, by the hooked module's
    mode; the weight cache: fill or reuse). What it reads there, Dynamo guards on.
    """

    def __init__(self, kind: str, sources: Iterable[tuple[Optional[torch.nn.Module], Iterable[str]]]) -> None:
        if kind not in ANCHORS:
            raise ValueError(f"no anchor of kind {kind!r}; kinds: {sorted(ANCHORS)}")
        self.kind = kind
        self.sources = tuple((owner, tuple(names)) for owner, names in sources)

    def anchor_kind(self, module: torch.nn.Module) -> str:
        return self.kind

    def __call__(self, module: torch.nn.Module, args, output) -> None:
        buffers = [getattr(module if owner is None else owner, name) for owner, names in self.sources for name in names]
        ANCHORS[self.anchor_kind(module)](*buffers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r}, {sum(len(names) for _, names in self.sources)} buffers)"


@dataclasses.dataclass(frozen=True)
class NewBuffer:
    """A buffer to add: ``module.register_buffer(name, value, persistent=persistent)``; ``path`` names the module."""

    module: torch.nn.Module
    path: str
    name: str
    value: torch.Tensor
    persistent: bool


def register_new_buffers(new_buffers: list[NewBuffer], if_taken: str) -> None:
    """Register every buffer of ``new_buffers``, or none: a name already taken on its module (or twice in the
    list) is refused before anything is added, naming it; ``if_taken`` says what to do."""
    seen: set[tuple[int, str]] = set()
    for new in new_buffers:
        if new.name in new.module.__dict__.get(_DTYPES_ATTRIBUTE, {}):
            raise ValueError(f"{new.path or '<root>'}.{new.name} already exists: an fp8graph.compile of another "
                             "model that holds this module registered it; compile the model that holds the others, "
                             "or a fresh copy of this one")
        if hasattr(new.module, new.name) or (id(new.module), new.name) in seen:
            raise ValueError(f"{new.path or '<root>'}.{new.name} already exists: {if_taken}")
        seen.add((id(new.module), new.name))
    for new in new_buffers:
        new.module.register_buffer(new.name, new.value, persistent=new.persistent)
        new.module.__dict__.setdefault(_DTYPES_ATTRIBUTE, {})[new.name] = new.value.dtype


def remove_buffer(module: torch.nn.Module, name: str) -> None:
    """Undo :func:`register_new_buffers` for ``module``'s buffer ``name``: the buffer and fp8graph's record of it
    go, so that a later compile may register it again."""
    delattr(module, name)
    module.__dict__.get(_DTYPES_ATTRIBUTE, {}).pop(name, None)


def is_fp8graph_buffer(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s buffer ``name`` is one fp8graph registered (:func:`register_new_buffers`)."""
    return name in module.__dict__.get(_DTYPES_ATTRIBUTE, {})


def _converted(model: torch.nn.Module):
    """``(path, module, name, registered dtype)`` of each fp8graph buffer whose dtype changed since."""
    for path, module in model.named_modules():
        for name, dtype in module.__dict__.get(_DTYPES_ATTRIBUTE, {}).items():
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.dtype != dtype:
                yield path, module, name, dtype


def converted_buffers(model: torch.nn.Module) -> list[str]:
    """``path.name (dtype, registered as dtype)`` of each fp8graph buffer whose dtype changed since it was
    registered: fp32 amax histories in BF16 lose their precision, an FP8 weight copy in BF16 is not one."""
    return [f"{path or '<root>'}.{name} ({module._buffers[name].dtype}, registered as {dtype})"
            for path, module, name, dtype in _converted(model)]


def restore_buffer_dtypes(model: torch.nn.Module) -> None:
    """Give every fp8graph buffer its registered dtype back (values converted; an FP8 weight copy is then
    refilled before it is read, see ``fp8graph.buffers.weight_cache``)."""
    for _, module, name, dtype in list(_converted(model)):
        module._buffers[name] = module._buffers[name].to(dtype)
