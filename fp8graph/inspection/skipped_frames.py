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
import re

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


# Dynamo's reason when a frame's code was compiled as often as a limit lets it (torch 2.13's and its earlier
# name: "Dynamo recompile limit exceeded", "Dynamo cache limit exceeded"; older: "recompile_limit reached").
_RECOMPILE_LIMIT = re.compile(r"(recompile|cache) limit exceeded|recompile_limit reached", re.IGNORECASE)


def _is_recompile_limit(reason: str) -> bool:
    """Dynamo compiled the frame's code as often as a limit lets it (each new model of one class, or each
    instance a policy tells apart, is a compile of the same code) and runs it eagerly from then on."""
    return bool(_RECOMPILE_LIMIT.search(reason))


def _recompile_limit_why(reason: str) -> str:
    """Which limit, at what value (as the reason says, else as the config holds it now), and what to do."""
    limit_type = re.search(r"Limit type: (\w+)", reason)
    limit_type = limit_type.group(1) if limit_type else "recompile_limit"
    value = re.search(r"currently set to (\d+)", reason)
    value = value.group(1) if value else getattr(torch._dynamo.config, limit_type, "?")
    return (f"Dynamo's {limit_type} ({value}) reached: each model of one class compiled in this process, or each "
            "instance a policy tells apart, compiles the same code again; torch._dynamo.reset() between models, "
            f"or a higher torch._dynamo.config.{limit_type}")


@dataclasses.dataclass(frozen=True)
class SkippedFrame:
    """A function Dynamo ran eagerly: ``where`` it is (``forward (model.py line 9)``, where Dynamo names it) and
    ``why``."""

    where: str
    why: str
    recompile_limit: bool = False  # skipped for a recompile limit: the compiled call's own frame, if it got no graph

    def __str__(self) -> str:
        return f"{self.where} ({self.why})"


def _skipped_frame(reason: str) -> SkippedFrame:
    if _is_recompile_limit(reason):
        return SkippedFrame("a function", _recompile_limit_why(reason), recompile_limit=True)
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    where = next((line.split("frame skipped:", 1)[1].strip() for line in lines if "frame skipped:" in line),
                 "a function")
    why = next((line for line in lines if _is_frame_skip(line) and "frame skipped:" not in line), lines[0])
    return SkippedFrame(where, why.removeprefix("Explanation:").strip().rstrip("."))


def frames_skipped_since(before: collections.Counter) -> list[SkippedFrame]:
    """Each frame Dynamo skipped since ``before`` (:func:`unimplemented_now`)."""
    new = collections.Counter(counters["unimplemented"]) - before
    return [_skipped_frame(reason) for reason in new.elements() if _is_frame_skip(reason)]
