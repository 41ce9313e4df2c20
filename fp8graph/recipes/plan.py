"""The plan: what a policy gives every weight of a model, decided once, before anything is traced.

    plan = fp8graph.plan(model, policy)      # or compiled.fp8graph_backend.plan
    print(plan)                               # a row per weight: its recipes, the rule, or why it stays

Everything fp8graph registers or arranges before tracing asks the plan, not the policy: delayed-scaling
state, the FP8 weight cache, FSDP2's FP8 gathers, which trunks run eagerly, and which module instances may
share a compiled frame (``fp8graph.instances``) or a region. The traced graph then decides each site
with its shape (``fp8graph.passes.annotate``), joined to its weight's entry.

A weight's entry is the recipes its sites may get (:class:`~fp8graph.recipes.policy.WeightRecipes`: a
rule whose predicate needs the traced token count leaves more than one possible) and the rules that may
decide them, and what follows from them for everything arranged before tracing: the delayed-scaling
recipe its state is laid out for (``delayed``), the recipe of its kept FP8 copy (``cached``), the one
recipe FSDP2 may gather it in (``decided``); a module's ``signature`` is its region group's key.
Every weight of two or three dimensions is planned (linears, expert weights; an embedding's
table too, which stays in high precision unless a linear shares it); vectors (norms, biases) are not.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterator

import torch

from fp8graph.recipes.policy import (Policy, WeightRecipes, normalize_policy, resolve_weight, rules_naming,
                                     weight_orientations)
from fp8graph.recipes.scaling import EXPERT_GRANULARITIES, DelayedScaling, Recipe, misaligned, unsupported_on_experts

__all__ = ["CACHE_WHERE_POSSIBLE", "Plan", "UNDECIDED", "WEIGHT_COPIES", "WeightEntry", "choose_weight_cache",
           "instance_path", "looked_up_or_convolved", "plan"]


def looked_up_or_convolved(module: torch.nn.Module) -> bool:
    """Whether ``module``'s weights are read by index or convolved: never a GEMM's weight."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag, torch.nn.modules.conv._ConvNd))


class _Undecided:
    def __repr__(self) -> str:
        return "UNDECIDED"


# A weight whose recipe only the traced graph decides (WeightEntry.decided).
UNDECIDED = _Undecided()
# How a compile keeps FP8 weight copies: cast by every call, cached between calls, or frozen into constants.
WEIGHT_COPIES = ("per call", "cached", "frozen")
# fp8graph.compile's default for cache_weights: copies wherever they can work (choose_weight_cache), used inside
# fp8graph.weights_unchanged.
CACHE_WHERE_POSSIBLE = "auto"


@dataclasses.dataclass(frozen=True)
class WeightEntry:
    """One weight's plan: where it is, and what the policy can give the sites that read it."""

    path: str  # the module holding it, as named_modules() names it
    name: str  # its attribute on that module
    shape: tuple[int, ...]
    recipes: WeightRecipes
    # Beside each of recipes.recipes: why the weight's shape rules that recipe out, or for an expert weight why its
    # GEMMs cannot run it (None: neither).
    misaligned: tuple[str | None, ...] = ()
    # How the compile asked FP8 weight copies to live (Plan's weight_copies); fp8_copy says what this one gets.
    weight_copies: str = "per call"
    # Copies kept for every recipe that can keep them (cache_weights=True), not only where a fill costs no more
    # than casting at every call ("auto": see cached).
    copies_everywhere: bool = False
    # Whether a GEMM may read it: False for a table only looked up or a kernel only convolved (no site, no copy).
    multiplied: bool = True

    @property
    def qualified_name(self) -> str:
        return f"{self.path}.{self.name}" if self.path else self.name

    @property
    def may_be_fp8(self) -> bool:
        """Whether a site on the weight may run in FP8: a recipe the policy may give it fits its shape."""
        return any(recipe is not None and reason is None
                   for recipe, reason in zip(self.recipes.recipes, self.misaligned))

    @property
    def decided(self) -> Recipe | None | _Undecided:
        """The one recipe every site on the weight gets (None: high precision), or :data:`UNDECIDED` when a rule
        needs the traced shape or more than one recipe is possible. FSDP2 gathers a weight in FP8 only when
        this is a recipe: the gathered bytes are its form (``fp8graph.fsdp.gathered_weight.gathered_form``)."""
        if self.recipes.undecided or len(self.recipes.recipes) != 1:
            return UNDECIDED
        return self.recipes.recipes[0]

    @property
    def delayed(self) -> DelayedScaling | None:
        """The delayed-scaling recipe the weight's state is laid out for (its history length), None for none.

        State is kept wherever a site on the weight may take delayed scaling (a rule on ``M`` is decided when
        the graph is traced; unused state stays at its initial values). Two delayed recipes with different
        history lengths cannot share one history: refused, naming the rules."""
        delayed = self.recipes.having("stateful")
        lengths = sorted({recipe.amax_history_len for recipe in delayed})
        if len(lengths) > 1:
            raise ValueError(
                f"{self.path or '<root>'}: before tracing, the policy may give this weight delayed scaling with "
                f"amax histories of lengths {lengths} (undecided: {', '.join(self.recipes.undecided)}), and a "
                "weight keeps one history: give those recipes one amax_history_len")
        return delayed[0] if delayed else None

    @property
    def cached(self) -> Recipe | None:
        """The recipe whose FP8 copy of the weight is kept between the calls of a ``fp8graph.weights_unchanged``
        declaration (``cache_weights``), None for none:
        the first the policy may give it whose weight cast a copy can keep (``Recipe.caches_weights``) and whose
        fill costs no more than casting at every call (:meth:`_fill_costs_more`)."""
        cacheable = [recipe for recipe in self._copyable() if not self._fill_costs_more(recipe)]
        return cacheable[0] if cacheable else None

    @property
    def per_call_reason(self) -> str | None:
        """Why the weight keeps no copy though the compile keeps copies and a recipe could keep one."""
        if self.weight_copies != "cached" or self.cached is not None:
            return None
        if any(self._fill_costs_more(recipe) for recipe in self._copyable()):
            return "a tiled recipe's fill casts a matrix more than a call casting it does (cache_weights=True keeps it)"
        return None

    def _copyable(self) -> list[Recipe]:
        """The recipes the policy may give the weight that could keep its copy: they fit its shape (an expert
        weight's, the recipes its sites run: ``misaligned``) and cast it from the weight and what the copy keeps."""
        return [recipe for recipe, shape_reason in zip(self.recipes.recipes, self.misaligned)
                if recipe is not None and recipe.caches_weights and shape_reason is None]

    def _fill_costs_more(self, recipe: Recipe) -> bool:
        """Whether ``"auto"`` casts the weight per call under ``recipe`` though a copy could be kept. Modelled on
        sm_90 (bench model decoder, 2026-11-27): the fill graphs of row-wise and block scaling cast each matrix
        once more than a call casting per call (its two layouts in the forward, and grad_input's again in the
        backward, or a kernel's outputs copied): launches 281 -> 314, 306 -> 318."""
        return len(self.shape) == 2 and recipe.tiled and not self.copies_everywhere

    @property
    def fp8_copy(self) -> str | None:
        """How the weight's FP8 copy lives: ``"per call"`` (cast by each call that reads it, inside the graph),
        ``"cached"`` (kept between the calls of a ``fp8graph.weights_unchanged`` declaration),
        ``"frozen"`` (a constant cast once: ``freeze_weights=True``), or None when no site on it may run in FP8."""
        if not self.may_be_fp8 or not self.multiplied:
            return None
        if self.weight_copies == "cached" and self.cached is None:
            return "per call"  # no recipe it may take keeps one (per_call_reason)
        return self.weight_copies

    def describe(self, policy: Policy) -> str:
        if not self.multiplied:
            return "high precision: read by index or convolved, never a GEMM's operand"
        names = ", ".join("high precision" if r is None else str(r) if reason is None else f"{r} (kept: {reason})"
                          for r, reason in zip(self.recipes.recipes, self.misaligned))
        rules = ", ".join("default" if i is None else policy.rule_label(i) for i in self.recipes.rule_indices)
        undecided = f" (decided when traced: {', '.join(self.recipes.undecided)})" if self.recipes.undecided else ""
        copy = "" if self.fp8_copy in (None, "per call") else f", FP8 copy {self.fp8_copy}"
        if self.per_call_reason is not None:
            copy = f", FP8 copy per call: {self.per_call_reason}"
        return f"{names} by {rules}{undecided}{copy}"


def _refuse_uninitialized_parameters(model: torch.nn.Module) -> None:
    """A LazyModule's parameters have no shape until its first call: nothing can be decided for them (a recipe's
    alignment, a copy's bytes, a delayed state's buffers), so the model is refused, naming them and the way out."""
    lazy = [f"{path!r} ({type(module).__name__})" if path else f"the model ({type(module).__name__})"
            for path, module in model.named_modules()
            if any(torch.nn.parameter.is_lazy(p) for p in module.parameters(recurse=False))]
    if lazy:
        modules, have = ("module", "has") if len(lazy) == 1 else ("modules", "have")
        raise ValueError(f"fp8graph: {modules} {', '.join(lazy)} {have} parameters not initialized yet: a LazyModule "
                         "infers their shapes at its first call. Call the model once on a batch, then compile, "
                         "explain or plan it")


class Plan:
    """Every weight's :class:`WeightEntry` for one model and policy, computed once.

    Entries are found by the weight itself (:meth:`entry`) or by the module path (:meth:`under`); a
    module's :meth:`signature` is what the policy gives its subtree, keyed relative to it, so two
    instances with equal signatures can run one compiled graph.
    """

    def __init__(self, model: torch.nn.Module, policy: Policy, weight_copies: str = "per call",
                 weight_copies_reason: str | None = None, copies_everywhere: bool = False):
        if weight_copies not in WEIGHT_COPIES:
            raise ValueError(f"weight_copies must be one of {WEIGHT_COPIES}, got {weight_copies!r}")
        _refuse_uninitialized_parameters(model)
        self.policy = normalize_policy(policy)
        self.weight_copies = weight_copies
        # Why the compile keeps no copies between calls where its default would (choose_weight_cache), or None.
        self.weight_copies_reason = weight_copies_reason
        self._entries: dict[int, WeightEntry] = {}
        self._by_path: dict[str, list[WeightEntry]] = {}
        # Modules without a weight of their own that rules name by path or class (an attention whose matmuls are
        # sites): the rules are part of what the policy gives the subtree (signature), though no entry holds them.
        self._rules_without_weights: dict[str, tuple[int, ...]] = {}
        multiplied = {}  # id(weight) -> whether a module holding it may multiply it (a tied table is)
        for module in model.modules():
            for weight in module.parameters(recurse=False):
                multiplied[id(weight)] = multiplied.get(id(weight), False) or not looked_up_or_convolved(module)
        for path, module in model.named_modules():
            if not any(weight.dim() in (2, 3) for weight in module.parameters(recurse=False)):
                rules = rules_naming(self.policy, path, module)
                if rules:
                    self._rules_without_weights[path] = rules
            for name, weight in module.named_parameters(recurse=False):
                if weight.dim() not in (2, 3) or id(weight) in self._entries:
                    continue  # a shared weight is planned once, by its first path, as named_parameters() names it
                recipes = resolve_weight(self.policy, path, module, weight)
                entry = WeightEntry(path, name, tuple(weight.shape), recipes,
                                    tuple(_misaligned(recipe, module, weight) for recipe in recipes.recipes),
                                    weight_copies, copies_everywhere, multiplied[id(weight)])
                self._entries[id(weight)] = entry
                self._by_path.setdefault(path, []).append(entry)
        self._signatures: dict[str, str] = {}

    def __iter__(self) -> Iterator[WeightEntry]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, weight: torch.Tensor) -> WeightEntry | None:
        """The entry of ``weight`` (the parameter object itself), or None for a tensor the model does not hold."""
        return self._entries.get(id(weight))

    def named(self, path: str, name: str) -> WeightEntry | None:
        """The entry of the weight ``name`` of the module at ``path``, or None."""
        return next((e for e in self._by_path.get(path, ()) if e.name == name), None)

    def under(self, path: str) -> list[WeightEntry]:
        """The entries of the weights at ``path`` and below, in the model's order."""
        prefix = f"{path}." if path else ""
        return [e for p, entries in self._by_path.items() if p == path or p.startswith(prefix) for e in entries]

    def signature(self, path: str) -> str:
        """What the policy gives the weights under ``path``, relative to it, as a short digest."""
        if path not in self._signatures:
            start = len(path) + 1 if path else 0
            relative = tuple((e.path[start:], e.name, e.shape, e.recipes) for e in self.under(path))
            relative += tuple((p[start:], rules) for p, rules in self._rules_without_weights.items()
                              if not path or p == path or p.startswith(path + "."))
            self._signatures[path] = hashlib.sha1(repr(relative).encode()).hexdigest()[:12]
        return self._signatures[path]

    def __getitem__(self, weight: torch.Tensor) -> WeightEntry:
        """The entry of ``weight``; a weight the plan does not hold is refused."""
        entry = self.entry(weight)
        if entry is None:
            raise KeyError(f"a weight of shape {tuple(weight.shape)} that the plan of this model does not hold: "
                           "compile the model it belongs to")
        return entry

    def recipes(self, weight: torch.Tensor) -> WeightRecipes:
        """What the policy can give the sites on ``weight``; a weight the plan does not hold is refused."""
        return self[weight].recipes

    def __str__(self) -> str:
        width = max((len(e.qualified_name) for e in self), default=0)
        rows = [f"{e.qualified_name:<{width}}  {'x'.join(map(str, e.shape)):>11}  {e.describe(self.policy)}"
                for e in self]
        header = f"fp8graph plan: {len(self)} weights, policy {self.policy}"
        if self.weight_copies_reason is not None:
            header += f"; FP8 weight copies per call: {self.weight_copies_reason}"
        return "\n".join([header] + rows)


def instance_path(path: str, template: str, instance: str) -> str | None:
    """``path`` inside ``template`` moved to the same place inside ``instance``; ``None`` if outside."""
    if path == template:
        return instance
    if path.startswith(template + "."):
        return instance + path[len(template):]
    return None


def _misaligned(recipe, module: torch.nn.Module, weight: torch.Tensor) -> str | None:
    """Why ``weight``'s shape rules ``recipe`` out whichever way round its module multiplies it, or None; an expert
    weight's (3-D), also why its expert GEMMs cannot run it."""
    if recipe is None:
        return None
    if weight.dim() == 3 and (reason := unsupported_on_experts(recipe)) is not None:
        return reason
    reasons = [misaligned(recipe, K=k, N=n) for n, k in weight_orientations(module, weight)]
    return None if None in reasons else reasons[0]


def plan(model: torch.nn.Module, policy=None, cache_weights=CACHE_WHERE_POSSIBLE, freeze_weights: bool = False
         ) -> Plan:
    """What ``policy`` gives each weight of ``model``, before anything is traced.

    Args:
        model: the ``nn.Module`` to plan.
        policy: a :class:`fp8graph.Policy`, a bare recipe, or ``None`` (current scaling everywhere eligible).
        cache_weights, freeze_weights: as :func:`fp8graph.compile` will be given them: how FP8 weight
            copies live (each entry's ``fp8_copy``).

    Returns:
        A :class:`Plan`; ``print()`` it for a row per weight.

    Example:
        >>> print(fp8graph.plan(model, fp8graph.Policy(rules=[("lm_head", None)])))
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fp8graph.plan needs an nn.Module, got {type(model).__name__}")
    everywhere = cache_weights is True
    cache_weights, reason = choose_weight_cache(model, cache_weights, freeze_weights, fp8_all_gather=True)
    return Plan(model, policy, weight_copies_of(cache_weights, freeze_weights), reason, everywhere)


def weight_copies_of(cache_weights: bool, freeze_weights: bool) -> str:
    """The :data:`WEIGHT_COPIES` entry of a compile's options."""
    return "frozen" if freeze_weights else "cached" if cache_weights else "per call"


def choose_weight_cache(model, cache_weights, freeze_weights: bool, fp8_all_gather: bool) -> tuple[bool, str | None]:
    """Whether a compile gives the weights buffers for FP8 casts kept between the calls of a
    ``fp8graph.weights_unchanged`` declaration, and, where ``"auto"`` leaves them off, why (``True`` and ``False``
    are the user's word; ``True`` where it cannot work is refused by the compile).

    ``"auto"`` keeps them wherever they work: a copy changes no value (the recipes that cache cast the weight
    from the weight alone) but delayed scaling's weight scale, which stays the fill's for the declaration's
    calls, as Transformer Engine's first-micro-batch caching keeps it (``fp8graph.buffers.weight_cache``), and a
    call that fills moves the bytes a call that casts moves (``fp8graph.targets.kept_copies``); the price is
    memory, held only inside a declaration. Off for a function or a module without submodules (the copies are
    buffers brought into the graph by submodules' hooks), with ``freeze_weights`` (which folds the copies into
    the graphs instead) and under FSDP2 (with ``fp8_all_gather`` each weight arrives cast from its gathered FP8
    shard, and the shard's cast is what is kept; without, a whole copy of every weight on each rank would undo
    the sharding)."""
    if cache_weights != CACHE_WHERE_POSSIBLE:
        return cache_weights, None
    if not isinstance(model, torch.nn.Module):
        return False, "a function has no modules to keep the copies on"
    if next(model.children(), None) is None:
        return False, (f"this {type(model).__name__} has no submodules, whose hooks would bring the copies into "
                       "the graph")
    if freeze_weights:
        return False, "freeze_weights folds the weights' FP8 copies into the graphs instead"
    if _has_fsdp_modules(model):
        if fp8_all_gather:
            return False, ("FSDP2 all-gathers the weights in FP8, cast from their shards (each shard's cast kept "
                           "between calls instead: fp8graph.fsdp.shard_casts)")
        return False, "FSDP2 shards the weights: a whole FP8 copy of each on every rank would undo the sharding"
    return True, None


def _has_fsdp_modules(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())
