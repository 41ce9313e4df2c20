"""Frames Dynamo gave up on and ran eagerly, found in its counters.

A graph break Dynamo cannot resume after (one inside a ``for`` or ``while``
loop) makes it skip the whole function: nothing of that function's own code
is traced, so a GEMM written there (``x @ self.embed.weight.T``) never
reaches fp8graph and runs in high precision, while the modules it calls are
compiled as frames of their own. Dynamo counts such a skip among its
``unimplemented`` features, not its graph breaks: :func:`frames_skipped_since`
reads it there, so that ``fp8graph.explain`` lists it and a compiled model's
first call warns of it.
"""

from __future__ import annotations

import collections
import dataclasses

import torch._dynamo
from torch._dynamo.utils import counters

__all__ = ["SkippedFrame", "frames_skipped_since", "unimplemented_now"]


def unimplemented_now() -> collections.Counter:
    """A copy of Dynamo's count of what it could not trace, to compare with later."""
    return collections.Counter(counters["unimplemented"])


def _is_frame_skip(reason: str) -> bool:
    lowered = reason.lower()
    return "skipping the frame" in lowered or "skipping frame" in lowered or "frame skipped" in lowered \
        or _is_recompile_limit(reason)


def _is_recompile_limit(reason: str) -> bool:
    """Dynamo compiled the frame's code as often as ``torch._dynamo.config.recompile_limit`` lets it (each new
    model of one class, or each instance a policy tells apart, is a compile of the same code) and runs it
    eagerly from then on: the whole call, every site in high precision."""
    return "recompile limit exceeded" in reason.lower()


@dataclasses.dataclass(frozen=True)
class SkippedFrame:
    """A function Dynamo ran eagerly: ``where`` it is (``forward (model.py line 9)``, where Dynamo names it) and
    ``why``."""

    where: str
    why: str
    whole_call: bool = False  # the frame of the compiled call itself (the recompile limit): nothing compiled

    def __str__(self) -> str:
        return f"{self.where} ({self.why})"


def _skipped_frame(reason: str) -> SkippedFrame:
    if _is_recompile_limit(reason):
        limit = torch._dynamo.config.recompile_limit
        return SkippedFrame("the call", f"Dynamo's recompile_limit ({limit}) reached: each model of one class "
                            "compiled in this process, or each instance a policy tells apart, compiles the same "
                            "code again; torch._dynamo.reset() between models, or a higher "
                            "torch._dynamo.config.recompile_limit", whole_call=True)
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    where = next((line.split("frame skipped:", 1)[1].strip() for line in lines if "frame skipped:" in line),
                 "a function")
    why = next((line for line in lines if _is_frame_skip(line) and "frame skipped:" not in line), lines[0])
    return SkippedFrame(where, why.removeprefix("Explanation:").strip().rstrip("."))


def frames_skipped_since(before: collections.Counter) -> list[SkippedFrame]:
    """Each frame Dynamo skipped since ``before`` (:func:`unimplemented_now`)."""
    new = collections.Counter(counters["unimplemented"]) - before
    return [_skipped_frame(reason) for reason in new.elements() if _is_frame_skip(reason)]
