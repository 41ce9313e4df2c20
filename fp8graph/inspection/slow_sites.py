"""FP8 sites that the cost model puts at several times their BF16 time on the GPU that runs them: reported.

A GEMM too small to pay for its quantization (a LoRA adapter's, a classifier head's, a toy model's) runs
slower in FP8: the amax, scale and cast kernels around it cost more than its faster GEMM saves, and launch
latency alone can make the FP8 site take three times as long as the BF16 one. A policy that gives every site
a recipe (the default) would take such sites quietly; fp8graph instead names them once, with their modelled
times, in a warning on the ``fp8graph`` logger, and ``policies.auto()`` keeps them in high precision.

Only sites lowered to the GPU's native FP8 GEMM are judged: the cost model speaks of GPUs, not of the CPU's
exact emulation, and a CUDA site without a native GEMM is refused before it gets here
(``fp8graph.gemm.scaled_gemm.choose_lowering``). A site whose token count is symbolic (``dynamic=True``) is
judged at :data:`fp8graph.costs.SYMBOLIC_TOKENS` tokens, as ``policies.auto()`` decides it: the more tokens,
the more the faster GEMM saves, so a site slow there is slow at most token counts.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch

from fp8graph.costs import SYMBOLIC_TOKENS, GPU, SiteTimes, site_times
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.passes.annotate import Decision
from fp8graph.recipes.policy import SiteInfo

__all__ = ["SLOWDOWN_REPORTED", "SlowSite", "cuda_device_of", "describe", "slow_sites"]

# A site modelled at this many times its BF16 kernel time or more is reported: the model's stated error (20%
# a class of kernels, docs/cost-model.md) cannot turn such a site into a gain.
SLOWDOWN_REPORTED = 2.0
_NAMED = 5  # paths a warning names before it counts the rest


@dataclasses.dataclass(frozen=True)
class SlowSite:
    """A site in FP8 and its modelled times per call."""

    path: str
    site: SiteInfo
    times: SiteTimes

    @property
    def slowdown(self) -> float:
        return self.times.fp8_us / self.times.bf16_us


def slow_sites(decisions: Iterable[Decision], gpu: GPU, training: bool) -> list[SlowSite]:
    """The sites of ``decisions`` in FP8 on the native GEMM whose modelled kernel time per call on ``gpu`` is at
    least :data:`SLOWDOWN_REPORTED` times BF16's (forward and backward when ``training``)."""
    slow = []
    for decision in decisions:
        site = decision.site.info
        if not decision.rewritten or decision.lowering is not Lowering.SCALED_MM \
                or not all(isinstance(size, int) and size > 0 for size in (site.K, site.N)) or site.M == 0:
            continue
        times = site_times(site, decision.recipe, gpu, training=training, tokens=SYMBOLIC_TOKENS)
        if times.fp8_us >= SLOWDOWN_REPORTED * times.bf16_us:
            slow.append(SlowSite(decision.site.path or "<root>", site, times))
    return slow


def describe(slow: Sequence[SlowSite]) -> str:
    """One warning's text for ``slow``: each site (the first few) with its modelled times, and what to do."""
    named = "; ".join(f"{s.path} ({_shape(s)}: {s.times.describe()})" for s in slow[:_NAMED])
    more = f"; and {len(slow) - _NAMED} more" if len(slow) > _NAMED else ""
    return (f"fp8graph: {len(slow)} site(s) in FP8 are modelled at {SLOWDOWN_REPORTED:g}x their BF16 time or more, "
            f"too small to pay for their casts: {named}{more}. policies.auto() keeps such sites in high "
            "precision, or a policy rule can name them; fp8graph.explain(model, ...) shows every site's times")


def _shape(slow: SlowSite) -> str:
    tokens = slow.site.M if isinstance(slow.site.M, int) else f"{slow.site.M}, modelled at {slow.times.M}"
    return f"M, K, N = {tokens}, {slow.site.K}, {slow.site.N}"


def cuda_device_of(example_inputs: Sequence[object]) -> torch.device | None:
    """The CUDA device a graph's tensors are on, None for a graph with none there."""
    return next((value.device for value in example_inputs
                 if isinstance(value, torch.Tensor) and value.device.type == "cuda"), None)
