"""The ``auto`` contestants of ``bench decoder`` and ``bench moe``: ``fp8graph.policies.auto()`` of a recipe, FP8
only on the sites the cost model says gain, each site timed at a named GPU's rates (the cost model's children name
the ``--gpu`` they model) or at the rates of the GPU the benchmark runs on."""

from __future__ import annotations

import inspect

__all__ = ["AUTO", "auto_policy"]

# policies.auto() with current and with delayed scaling.
AUTO = ("auto", "auto delayed")


def auto_policy(contestant: str, policy_gpu: str | None = None):
    """The policy of ``contestant`` (one of :data:`AUTO`), its sites timed on ``policy_gpu`` (``None``: the GPU
    this runs on)."""
    import fp8graph

    recipe = contestant.removeprefix("auto").strip() or "current"
    # An earlier commit's auto() (the calibration and --fp8graph-at model one) may take no gpu at all: it decided at
    # the H100's rates, and so it is modelled.
    takes_gpu = "gpu" in inspect.signature(fp8graph.policies.auto).parameters
    return fp8graph.policies.auto(recipe=recipe, **({"gpu": policy_gpu} if policy_gpu and takes_gpu else {}))
