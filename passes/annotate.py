"""Decide, per site, whether it runs in FP8 and with which recipe.

Writes a :class:`Decision` into ``node.meta[DECISION_KEY]`` of every site and
changes nothing else. The policy picks a recipe (first matching rule, else
the default); the site then stays in high precision, with the reason
recorded, when it has a structural blocker (see ``find_sites``), its dtype is
not one FP8 should replace, or its K or N is not a multiple of 16 (cuBLAS FP8
GEMMs need both; M is free), or the graph's CUDA device has no native FP8
GEMM for its recipe (``fp8graph.gemm.scaled_gemm.choose_lowering``). When a rule
named the site explicitly and its recipe cannot apply, the reason says so,
and a strict policy raises; a strict policy also raises when the device has
no native GEMM for a site's recipe.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from fp8graph.gemm.scaled_gemm import Lowering, NoNativeGemm
from fp8graph.recipes.plan import WeightEntry
from fp8graph.recipes.policy import Policy, Resolution, resolve
from fp8graph.recipes.scaling import Recipe, expert_recipe, misaligned, unsupported_on_experts
from fp8graph.buffers.snapshots import CONTEXT_FN_KEY
from fp8graph.targets.gathered import GATHERED_GRANULARITIES

from .sites import REPLACEABLE_DTYPES, ExpertSite, GatheredExpertSite, LinearSite, MatmulSite, Site

__all__ = ["DECISION_KEY", "Decision", "annotate_sites"]

DECISION_KEY = "fp8graph_decision"


@dataclasses.dataclass(frozen=True)
class Decision:
    """A site and what happens to it: a recipe (rewritten) or a reason (kept).

    ``rule_index`` is the policy rule that decided (``None``: the default).
    """

    site: Site
    recipe: Recipe | None
    reason: str | None
    lowering: Lowering | None
    rule_index: int | None = None
    # The plan's entry of the weight the site reads (fp8graph.recipes.plan), None for a site without one.
    planned: WeightEntry | None = None

    @property
    def rewritten(self) -> bool:
        return self.recipe is not None


def _reason_to_keep(site: Site, recipe: Recipe | None, has_state: Callable[[Site], bool], run_eagerly: bool,
                    policy_reason: str | None = None) -> str | None:
    """Why ``site`` stays in high precision although the policy gives it ``recipe`` (or none), else None;
    ``policy_reason``: what the rule that kept it said of it."""
    if site.gate is not None and recipe is None:
        return f"{site.gate} (FP8 only when a policy rule names it)"
    if site.blocker is not None:
        return site.blocker
    if site.dtype == torch.float64:
        return "float64 stays in high precision"
    if site.dtype not in REPLACEABLE_DTYPES:
        return f"dtype {site.dtype} is not a 16- or 32-bit float"
    if recipe is None:
        if isinstance(site, MatmulSite):
            return "activation x activation matmul (FP8 only when a policy rule names it)"
        return policy_reason or "policy keeps it in high precision"
    return _refuses(site, recipe, has_state, run_eagerly)


def _empty(site: Site) -> str | None:
    if 0 in (site.M, site.K, site.N):
        return "an empty operand (M, K or N is 0): nothing to cast; the GEMM runs as in high precision"
    return None


@functools.singledispatch
def _refuses(site: LinearSite, recipe: Recipe, has_state: Callable[[Site], bool], run_eagerly: bool) -> str | None:
    """Why a site of its kind cannot run ``recipe`` (None: it can). A linear: its shape and its state.
    ``run_eagerly``: the graph runs under fp8graph's ``eager`` compiler, without AOTAutograd."""
    if (reason := _empty(site)) is not None:
        return reason
    if recipe.stateful and site.checkpoint_region is not None \
            and CONTEXT_FN_KEY in site.checkpoint_region.meta:
        return ("delayed scaling in a torch.utils.checkpoint region with its own context_fn: its replayed "
                "casts would need fp8graph's policy to save the state they read (fp8graph.buffers.snapshots)")
    if recipe.stateful and site.checkpoint_region is not None and run_eagerly:
        # Autograd then saves the state the region's casts read and the forward's update writes it in place:
        # the backward's replay fails its version check ("modified by an inplace operation").
        return ("delayed scaling in a torch.utils.checkpoint region under compiler='eager': its state snapshots "
                "(fp8graph.buffers.snapshots) need AOTAutograd's functional graph; compiler='aot_eager' or "
                "'inductor' run it in FP8")
    shape_reason = misaligned(recipe, K=site.K, N=site.N)
    if shape_reason is not None:
        return shape_reason
    if recipe.stateful and not has_state(site):
        return ("delayed scaling has no state in this graph: the weight's amax history and scale are not "
                "among the graph's inputs (registered after compiling, a graph split between the GEMM "
                "and the forward hook of the module that owns them, or a weight whose owner's hooks "
                "did not run in this graph)")
    return None


@_refuses.register
def _matmul_refuses(site: MatmulSite, recipe: Recipe, has_state, run_eagerly: bool) -> str | None:
    """An activation matmul runs emulated (no cuBLAS shape constraint) in per-tensor recipes without state."""
    if (reason := _empty(site)) is not None:
        return reason
    if recipe.stateful:
        return ("delayed scaling has no state here: fp8graph.compile registers it per weight parameter, "
                "which activation matmuls lack")
    if recipe.tiled:
        return f"{recipe.name} applies to linear sites (a parameter operand), not activation matmuls"
    return None


@_refuses.register
def _experts_refuse(site: ExpertSite, recipe: Recipe, has_state: Callable[[Site], bool],
                    run_eagerly: bool) -> str | None:
    """Expert GEMMs: the recipes their targets run, no delayed state in checkpoint regions, then as a linear."""
    if (reason := unsupported_on_experts(recipe)) is not None:
        return reason
    if isinstance(site, GatheredExpertSite) and recipe.granularity not in GATHERED_GRANULARITIES:
        return (f"{recipe.name} on the decode form of expert GEMMs (weights gathered per token) is not supported "
                "yet: its FP8 GEMV takes row-wise, current or delayed scales")
    if (reason := _empty(site)) is not None:
        return reason
    if recipe.stateful and site.checkpoint_region is not None:
        return ("delayed scaling of expert GEMMs inside torch.utils.checkpoint is not supported yet (their state "
                "would need the snapshots linears get: fp8graph.buffers.snapshots)")
    return _refuses.dispatch(LinearSite)(site, recipe, has_state, run_eagerly)


def resolve_site(policy: Policy, site: Site, path: str | None = None,
                 module: torch.nn.Module | None = None) -> Resolution:
    """The recipe ``policy`` gives a traced site, or the same site at another ``path`` (a block instance's)."""
    return resolve(policy, site.path if path is None else path, site.info, module, site.module_type)


def annotate_sites(
    sites: list[Site],
    policy: Policy,
    lowering_for: Callable[[Recipe, Site], Lowering],
    modules_by_path: dict[str, torch.nn.Module] | None = None,
    has_state: Callable[[Site], bool] = lambda site: False,
    planned: Callable[[Site], WeightEntry | None] = lambda site: None,
    run_eagerly: bool = False,
) -> list[Decision]:
    """Attach a decision to each site's node and return the decisions in order.

    ``planned(site)`` is the plan's entry of the weight the site reads, joined to its decision: every
    buffer fp8graph registered before tracing (delayed state, FP8 weight copies, FSDP2's FP8 gathers)
    followed that entry, so a site of the module that owns the weight may run only a recipe the plan holds
    for it; a site that reads another module's weight (a tied ``lm_head``) is decided for its own path.

    ``lowering_for(recipe, site)`` says how a recipe's GEMMs run on the
    graph's device (see ``fp8graph.gemm.scaled_gemm.choose_lowering``); where the
    device has no native GEMM for it (``NoNativeGemm``) the site stays in high
    precision with that reason. ``run_eagerly``: the graph runs under fp8graph's ``eager`` compiler, without
    AOTAutograd's functional graph.

    Raises:
        ValueError: under a strict policy, when a rule gives a recipe to a site
            it cannot apply to, or the device has no native GEMM for a site's
            recipe; the message names the module path and the reason.
    """
    decisions = []
    for site in sites:
        module = (modules_by_path or {}).get(site.path)
        resolution = resolve_site(policy, site, module=module)
        recipe = resolution.recipe
        where = f"fp8graph: {site.path or '<root>'} ({site.op})"
        reason = _reason_to_keep(site, recipe, has_state, run_eagerly, resolution.reason)
        site_lowering = None
        if reason is None:
            try:
                site_lowering = lowering_for(recipe, site)
            except NoNativeGemm as error:
                if policy.strict:
                    raise ValueError(f"{where}: {error}") from None
                reason = str(error)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
        if reason is not None and recipe is not None and resolution.rule_index is not None:
            request = f"{policy.rule_label(resolution.rule_index)} asks for {recipe.name}"
            if policy.strict:
                raise ValueError(f"{where}: {request}, but {reason}")
            reason = f"{reason}; {request}"
        entry = planned(site)
        if reason is None and entry is not None and entry.path == site.path \
                and recipe not in entry.recipes.recipes:
            # The plan guessed the site before tracing (an nn.Linear's weight multiplied (N, K)); the graph
            # multiplies it otherwise (x @ linear.weight), and a rule reading K or N decides otherwise.
            reason = (f"traced, the policy gives it {recipe.name}, which the plan of {entry.qualified_name} "
                      f"({entry.describe(policy)}) does not hold: the buffers registered before tracing are not "
                      "the ones this site needs")
            if policy.strict:
                raise ValueError(f"{where}: {reason}")
        if reason is None and isinstance(site, ExpertSite):
            recipe = expert_recipe(recipe)  # what the expert GEMMs can run of it (E4M3 operands)
        decision = (
            Decision(site, recipe, None, site_lowering, resolution.rule_index, entry) if reason is None
            else Decision(site, None, reason, None, resolution.rule_index, entry)
        )
        site.node.meta[DECISION_KEY] = decision
        decisions.append(decision)
    return decisions
