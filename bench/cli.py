"""What every ``python -m bench`` command checks of its arguments before it measures anything."""

from __future__ import annotations

import argparse

__all__ = ["positive", "require_cuda"]


def positive(kind):
    """An argparse type: a number of ``kind`` above 0 (``--repeats -5`` would otherwise measure nothing)."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def require_cuda(workload: str, args: argparse.Namespace) -> None:
    """Refuse a GPU measurement on a machine without CUDA, saying what runs instead."""
    import torch  # here: the cost model's commands run without importing it

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(
            f"python -m bench {workload} measures on a CUDA GPU, and torch sees none: add --smoke for the small "
            f"CPU check of the machinery, or run `python -m bench model {workload}` for the device-free cost "
            "model of the GPU step")
