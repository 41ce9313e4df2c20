"""When a weight's FP8 cast kept from an earlier call may serve another call: only where the user said so.

A weight can change by routes fp8graph never sees: a write through ``param.data`` (``p.data.add_(...)``,
``p.data.copy_(master)``, foreach ops over ``.data``) has a version counter of its own, and an optimizer of
another library may write the weight's memory from its own kernels. Checking the values before each call
would cost a read of every weight and a host synchronisation. So a cast is reused across calls only where
the user declares the weights unchanged, as Transformer Engine's ``is_first_microbatch`` does::

    for micro_batches in loader:
        with fp8graph.weights_unchanged(compiled):   # the first call casts, the others reuse its casts
            for batch in micro_batches:
                compiled(batch).loss.backward()
        optimizer.step()

Outside a scope every call casts its weights (bit for bit ``cache_weights=False``). Inside one, a cast
made by an earlier call of the same scope is reused unless something fp8graph does see happened since:
any ``torch.optim.Optimizer`` step in the process (fused ones write without moving version counters;
:func:`optimizer_steps`), an in-place change seen by the weight's version counter (``load_state_dict``,
autograd-visible writes), a new tensor behind the parameter (``param.data = ...``, ``model.to(...)``). A
write fp8graph cannot see inside a scope breaks the declaration.

Each compiled model has one :class:`ReuseScope`; the casts it governs (``fp8graph.buffers.weight_cache``'s
copies, ``fp8graph.fsdp.shard_casts``' gathered shards) stamp what they were cast under
(:class:`CastStamp`) and ask :meth:`CastStamp.still_serves` before a reuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["CastStamp", "ReuseScope", "optimizer_steps", "reuse_scope_of", "watch_optimizer_steps",
           "weights_unchanged"]

_STEP_HOOK: list = []
_OPTIMIZER_STEPS = [0]  # steps any torch.optim.Optimizer took in this process since the hook was registered


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


def watch_optimizer_steps() -> None:
    """Count every ``torch.optim.Optimizer``'s steps (subclasses too: their ``step`` runs the global hooks) from
    now on; once a process."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))


def optimizer_steps() -> int:
    """How many optimizer steps this process took since :func:`watch_optimizer_steps` first ran. Any step ends
    every reuse: a frozen weight's delayed-scaling scale moves with each step too (its history does), and a
    model's weights may be stepped by an optimizer that holds them under other tensors."""
    return _OPTIMIZER_STEPS[0]


class ReuseScope:
    """Whether a compiled model's weights are declared unchanged now (:func:`weights_unchanged`), and which
    declaration: casts made in one serve only calls of the same one."""

    def __init__(self) -> None:
        self._depth = 0
        self._serial = 0
        # Called when the outermost declaration opens and when it closes (the weight copies are held only
        # inside: fp8graph.buffers.weight_cache).
        self.on_open: list[Callable[[], None]] = []
        self.on_close: list[Callable[[], None]] = []

    @property
    def open(self) -> bool:
        return self._depth > 0

    @property
    def token(self) -> int | None:
        """The open declaration's number, or None outside every declaration."""
        return self._serial if self._depth else None

    @contextlib.contextmanager
    def declared(self):
        self._depth += 1
        try:
            if self._depth == 1:
                self._serial += 1
                for callback in self.on_open:  # may fail (out of memory for the copies): the block never opened
                    callback()
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for callback in self.on_close:
                    callback()

    def __getstate__(self) -> dict:
        # A copy of the model (copy.deepcopy, torch.save) taken inside a block is outside every block: the block
        # that is open belongs to the original, and the copy's would otherwise never close.
        return {**self.__dict__, "_depth": 0}


@dataclasses.dataclass(frozen=True)
class CastStamp:
    """What a kept cast was made under: the declaration it was made in (None: none), the optimizer steps taken
    then, and what identified each weight it casts (``fp8graph.buffers.weight_cache.WeightCache`` and FSDP2's
    shard casts say what: version counters, storages)."""

    token: int | None
    steps: int
    weights: tuple

    @classmethod
    def now(cls, scope: ReuseScope, weights: tuple) -> "CastStamp":
        return cls(scope.token, optimizer_steps(), weights)

    def still_serves(self, scope: ReuseScope, weights: tuple) -> bool:
        """Whether a call now may reuse the cast: inside the declaration it was made in, no optimizer step since,
        the weights as they were."""
        return (self.token is not None and self.token == scope.token and self.steps == optimizer_steps()
                and self.weights == weights)


_SCOPE_ATTRIBUTE = "_fp8graph_reuse_scope"


def reuse_scope_of(model: torch.nn.Module) -> ReuseScope:
    """The :class:`ReuseScope` of ``model`` (the user's module ``fp8graph.compile`` was given), made at its
    first compile and kept on it (a copied model gets its own)."""
    scope = model.__dict__.get(_SCOPE_ATTRIBUTE)
    if scope is None:
        scope = model.__dict__[_SCOPE_ATTRIBUTE] = ReuseScope()
        watch_optimizer_steps()
    return scope


def _user_model(model) -> torch.nn.Module:
    """The module ``fp8graph.compile`` registered its state on, from it, its compiled wrapper or a DDP wrapper."""
    seen = model
    while True:
        if _SCOPE_ATTRIBUTE in getattr(seen, "__dict__", {}):
            return seen
        inner = getattr(seen, "_orig_mod", None) or getattr(seen, "module", None)
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(f"fp8graph.weights_unchanged needs a model compiled by fp8graph.compile (or the module "
                            f"given to it), got {type(model).__name__}")
        seen = inner


@contextlib.contextmanager
def weights_unchanged(model):
    """Declare ``model``'s weights unchanged inside the ``with`` block: the first call in it casts each weight
    to FP8 and keeps the casts, the others read them (gradient accumulation's micro-batches, an evaluation
    loop). Transformer Engine's ``is_first_microbatch``, as a scope.

    Args:
        model: what ``fp8graph.compile`` returned, or the module it was given.

    Inside, a call still casts again after any change fp8graph sees (an optimizer step, an in-place change
    that moves a weight's version counter, a new tensor behind a parameter); a change it cannot see (a write
    through ``param.data``, or into the weights' memory by another library's code) must not happen inside.
    The kept casts take memory only inside the block (one byte a weight element, two for expert weights
    and the tiled recipes' matrices: ``fp8graph.buffers.weight_cache.copy_layout``). Blocks nest; a block
    opened again later casts anew. Delayed scaling's calls inside one block read the cast the first made,
    with its scale, and record no amax for the weight (as Transformer Engine's cached weights).

    Example:
        >>> with fp8graph.weights_unchanged(compiled):
        ...     for batch in micro_batches:
        ...         compiled(batch, labels=batch).loss.backward()
        >>> optimizer.step()
    """
    with reuse_scope_of(_user_model(model)).declared():
        yield
