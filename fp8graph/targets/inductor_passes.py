"""fp8graph's passes inside Inductor's compile, each run before the pass a user configured in the same slot.

Inductor takes one pass per slot (``joint_custom_pre_pass``, ``post_grad_custom_post_pass``) and keys its FX
graph cache by the pass's ``uuid``. fp8graph's pass takes the slot and runs the user's after its own, and the
uuid names both. A user's pass that is a plain function cannot be keyed, so it keeps the slot and fp8graph's
pass does not run: :func:`composed` logs what that costs.
"""

from __future__ import annotations

import logging

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from fp8graph.targets.cache_hash import source_hash

__all__ = ["ChainedGraphPass", "composed"]

log = logging.getLogger("fp8graph")


class ChainedGraphPass(CustomGraphPass):
    """A pass of fp8graph's (:meth:`run`), then ``then``, the pass the user configured in the same slot."""

    def __init__(self, then: CustomGraphPass | None = None) -> None:
        self.then = then

    def run(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.run(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> str:
        return source_hash() + ("" if self.then is None else str(self.then.uuid()))


def composed(pass_class: type[ChainedGraphPass], configured, lost: str) -> object:
    """The pass to compile with in a slot where ``configured`` is the user's: ``pass_class`` running before it,
    or ``configured`` alone when it is a plain function (logged with ``lost``, what fp8graph's pass not running
    costs)."""
    if configured is None or isinstance(configured, CustomGraphPass):
        return pass_class(configured)
    log.info("fp8graph: %r is not a CustomGraphPass, so %s does not run: %s", configured, pass_class.__name__, lost)
    return configured
