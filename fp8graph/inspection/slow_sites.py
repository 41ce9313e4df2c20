"""FP8 sites that the cost model puts at several times their BF16 time on the GPU that runs them: reported.

A GEMM too small to pay for its quantization (a LoRA adapter's, a classifier head's, a toy model's) runs
slower in FP8: the amax, scale and cast kernels around it cost more than its faster GEMM saves, and launch
latency alone can make the FP8 site take three times as long as the BF16 one. A policy that gives every site
a recipe (the default) would take such sites quietly; fp8graph instead names them, with their modelled times,
in a warning on the ``fp8graph`` logger, once a process for each site, shape and recipe, and
``policies.auto()`` keeps them in high precision.

Judged: sites lowered to the GPU's native FP8 GEMM (the cost model speaks of GPUs, not of the CPU's exact
emulation; a CUDA site without a native GEMM is refused before it gets here,
``fp8graph.gemm.scaled_gemm.choose_lowering``), in graphs that cast their weights at every call, as the site
model prices them: not a graph that reads the weights' kept copies (``fp8graph.weights_unchanged``'s reusing
calls: the filling call's graph is judged) nor an inference graph whose weights Inductor's freezing folded
(``freeze_weights``). A site whose token count is symbolic (``dynamic=True``) is judged at
:data:`fp8graph.costs.SYMBOLIC_TOKENS` tokens, as ``policies.auto()`` decides it: the more tokens, the more the
faster GEMM saves, so a site slow there is slow at most token counts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Sequence

from fp8graph.buffers.weight_cache import REUSE
from fp8graph.costs import SYMBOLIC_TOKENS, GPU, SiteTimes, site_times
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.passes.annotate import Decision
from fp8graph.recipes.policy import SiteInfo

__all__ = ["SLOWDOWN_REPORTED", "SlowSite", "casts_weights_per_call", "slow_sites", "warn_once", "warning_text"]

# A site modelled at this many times its BF16 kernel time or more is reported: the model's stated error (20%
# a class of kernels, docs/cost-model.md) cannot turn such a site into a gain.
SLOWDOWN_REPORTED = 2.0
_NAMED = 5  # sites a warning names before it counts the rest
_warned: set[tuple] = set()  # (path, shape, recipe, GPU) of every site warned of in this process


@dataclasses.dataclass(frozen=True)
class SlowSite:
    """A site in FP8 and its modelled times per call."""

    path: str
    site: SiteInfo
    times: SiteTimes

    @property
    def key(self) -> tuple:
        return self.path, self.site.M, self.site.K, self.site.N, self.site.experts, self.times.recipe, self.times.gpu


def casts_weights_per_call(weight_cache_mode: str, grad_enabled: bool, freezing: bool) -> bool:
    """Whether a graph compiled now casts its weights at every call, as the site model prices a site: not one
    that reads the kept copies, nor an inference graph compiled under Inductor's freezing (weights folded)."""
    return weight_cache_mode != REUSE and (grad_enabled or not freezing)


def slow_sites(decisions: Iterable[Decision], gpu: GPU, training: bool) -> list[SlowSite]:
    """The sites of ``decisions`` in FP8 on the native GEMM whose modelled kernel time per call on ``gpu`` is at
    least :data:`SLOWDOWN_REPORTED` times BF16's (forward and backward when ``training``), each path once."""
    slow = {}
    for decision in decisions:
        site = decision.site.info
        if not decision.rewritten or decision.lowering is not Lowering.SCALED_MM \
                or not all(isinstance(size, int) and size > 0 for size in (site.K, site.N)) or site.M == 0:
            continue
        times = site_times(site, decision.recipe, gpu, training=training, tokens=SYMBOLIC_TOKENS)
        # A GPU the model knows no FP8 GEMM on, where the graph has one (a GPU it has no rates for): not judged.
        if not times.emulated and times.fp8_us >= SLOWDOWN_REPORTED * times.bf16_us:
            path = decision.site.path or "<root>"
            slow.setdefault(path, SlowSite(path, site, times))
    return list(slow.values())


def warn_once(slow: Sequence[SlowSite], log: logging.Logger) -> list[SlowSite]:
    """Warn on ``log`` of the sites of ``slow`` not warned of before in this process; returns them."""
    new = [site for site in slow if site.key not in _warned]
    if new:
        _warned.update(site.key for site in new)
        log.warning(warning_text(new))
    return new


def warning_text(slow: Sequence[SlowSite]) -> str:
    """One warning's text for ``slow``: each site (the first few) with its modelled times, and what to do."""
    named = "; ".join(f"{s.path} ({_shape(s)}: {s.times.describe()})" for s in slow[:_NAMED])
    more = f"; and {len(slow) - _NAMED} more" if len(slow) > _NAMED else ""
    return (f"fp8graph: {len(slow)} site(s) in FP8 are modelled at {SLOWDOWN_REPORTED:g}x their BF16 time or more, "
            f"too small to pay for their casts: {named}{more}. policies.auto() keeps such sites in high "
            "precision, or a policy rule can name them; fp8graph.explain(model, ...) shows every site's times")


def _shape(slow: SlowSite) -> str:
    site = slow.site
    tokens = site.M if isinstance(site.M, int) else f"{site.M}, modelled at {slow.times.M}"
    experts = f"E = {site.experts}, " if site.experts else ""
    return f"{experts}M, K, N = {tokens}, {site.K}, {site.N}"
