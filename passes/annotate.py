"""Decide, per site, whether it runs in FP8 and with which recipe.

Writes a :class:`Decision` into ``node.meta[DECISION_KEY]`` of every site and
changes nothing else. A site stays in high precision, with the reason
recorded, when it has a structural blocker (see ``find_sites``), its dtype is
not one FP8 should replace, the policy gives it no recipe, or its K or N is
not a multiple of 16 (cuBLAS FP8 GEMMs need both; M is free).
"""

from __future__ import annotations

import dataclasses

import torch

from fp8graph.lowering import Lowering
from fp8graph.policy import recipe_for_site
from fp8graph.recipes import Recipe

from .find_sites import Site

__all__ = ["DECISION_KEY", "Decision", "annotate_sites"]

DECISION_KEY = "fp8graph_decision"
_REPLACEABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GEMM_DIM_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class Decision:
    """A site and what happens to it: a recipe (rewritten) or a reason (kept)."""

    site: Site
    recipe: Recipe | None
    reason: str | None
    lowering: Lowering | None

    @property
    def rewritten(self) -> bool:
        return self.recipe is not None


def _reason_to_keep(site: Site, recipe: Recipe | None) -> str | None:
    if site.blocker is not None:
        return site.blocker
    if site.dtype == torch.float64:
        return "float64 stays in high precision"
    if site.dtype not in _REPLACEABLE_DTYPES:
        return f"dtype {site.dtype} is not a 16- or 32-bit float"
    if recipe is None:
        return "policy keeps it in high precision"
    for dim_name in ("K", "N"):
        dim = getattr(site, dim_name)
        if dim % _GEMM_DIM_MULTIPLE:
            return f"{dim_name}={dim} is not a multiple of {_GEMM_DIM_MULTIPLE}"
    return None


def annotate_sites(sites: list[Site], policy: Recipe, lowering: Lowering) -> list[Decision]:
    """Attach a decision to each site's node and return the decisions in order."""
    decisions = []
    for site in sites:
        recipe = None if site.blocker else recipe_for_site(policy, site.path)
        reason = _reason_to_keep(site, recipe)
        decision = (
            Decision(site, recipe, None, lowering) if reason is None
            else Decision(site, None, reason, None)
        )
        site.node.meta[DECISION_KEY] = decision
        decisions.append(decision)
    return decisions
