"""What every ``python -m bench`` command checks of its arguments before it measures anything."""

from __future__ import annotations

import argparse

__all__ = ["contestants_of", "positive", "require_cuda"]


def positive(kind):
    """An argparse type: a number of ``kind`` above 0 (``--repeats -5`` would otherwise measure nothing)."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def contestants_of(requested: list[str] | None, default: list[str], parse_contestant) -> list[str]:
    """bf16 first (every ratio needs it), then the others, each name checked by the workload's
    ``parse_contestant`` (a ``ValueError`` naming what is wrong becomes the command's exit)."""
    wanted = ["bf16", *(c for c in (requested or default) if c != "bf16")]
    for name in wanted:
        try:
            parse_contestant(name)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    return wanted


def require_cuda(workload: str, args: argparse.Namespace) -> None:
    """Refuse a GPU measurement on a machine without CUDA, saying what runs instead."""
    import torch  # here: the cost model's commands run without importing it

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(
            f"python -m bench {workload} measures on a CUDA GPU, and torch sees none: add --smoke for the small "
            f"CPU check of the machinery, or run `python -m bench model {workload}` for the device-free cost "
            "model of the GPU step")
