"""Which recipe each site gets: ordered rules over module paths, types and site shapes.

    policy = Policy(
        default=Float8CurrentScaling(),
        rules=[
            ("lm_head", None),                                   # keep in high precision
            ("model.layers.0.*", None),
            ("*.mlp.*", Float8CurrentScaling(Format.E4M3)),
            (re.compile(r".*\\.self_attn\\.[qkv]_proj"), Float8CurrentScaling(power_2_scales=True)),
            (lambda path, module, site: site.N >= 4096, Float8CurrentScaling()),
        ],
    )

The first rule whose pattern matches a site decides; sites no rule matches get
``default``. Resolution is the pure function :func:`resolve`, tested by
tables of cases without compiling anything.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Callable, Union

import torch

from fp8graph.recipes.scaling import Float8CurrentScaling, Recipe

__all__ = ["DEFAULT_RECIPE", "Policy", "Resolution", "SiteInfo", "WeightRecipes", "normalize_policy", "resolve",
           "resolve_weight", "rules_naming", "weight_experts", "weight_orientations"]

DEFAULT_RECIPE = Float8CurrentScaling()


@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """What a rule can see of a site besides its module: op and GEMM shape.

    ``M`` is a string when the token dimension is symbolic (``dynamic=True``).
    ``is_linear`` is False for activation-by-activation matmuls, which only
    an explicit rule can move to FP8. ``experts`` is E of an expert site
    (op ``grouped_mm``: E GEMMs over groups of M sorted tokens), else ``None``.
    ``gate`` is True for a mixture-of-experts router or shared-expert gate,
    which, like an activation matmul, only an explicit rule moves to FP8.
    ``expert_stage`` is which GEMM of an expert MLP an expert site is, where the
    graph has the MLP whole (the first GEMM's output read by SwiGLU alone, that
    SwiGLU the second's input, the second's output read by the experts' combine
    alone): 0 the first, 1 the second; ``None`` elsewhere.
    ``input_readers`` is how many linear sites of its graph read its input, itself
    included (q, k and v: 3; gate and up: 2): fp8graph casts a shared input once for
    all of them in one recipe (``passes.group_sites``), and the cost model charges
    each site its share of that cast.
    """

    op: str
    M: int | str | None
    K: int | None
    N: int | None
    dtype: torch.dtype | None
    is_linear: bool = True
    experts: int | None = None
    gate: bool = False
    expert_stage: int | None = None
    input_readers: int = 1


Predicate = Callable[[str, Union[torch.nn.Module, None], SiteInfo], bool]
Pattern = Union[str, "re.Pattern[str]", type, Predicate]


def _check_pattern(pattern: object, index: int) -> None:
    if isinstance(pattern, (str, re.Pattern)):
        return
    if isinstance(pattern, type):
        if not issubclass(pattern, torch.nn.Module):
            raise ValueError(f"Policy rule {index}: class pattern {pattern.__name__} is not an nn.Module subclass")
        return
    if not callable(pattern):
        raise ValueError(
            f"Policy rule {index}: pattern must be a glob string, a compiled regex, an nn.Module "
            f"subclass or a predicate (path, module, site) -> bool, got {pattern!r}"
        )


def _check_recipe(recipe: object, where: "str | Callable[[], str]") -> None:
    """``where``: the setting's name, or what makes it (a rule's name is only asked for in the error)."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(f"{where if isinstance(where, str) else where()} must be a recipe or None, got {recipe!r}")


def describe_pattern(pattern: Pattern) -> str:
    """A short readable form of a rule's pattern, for reports and errors."""
    if isinstance(pattern, str):
        return repr(pattern)
    if isinstance(pattern, re.Pattern):
        return f"re{pattern.pattern!r}"
    if isinstance(pattern, type):
        return pattern.__name__
    return getattr(pattern, "__name__", repr(pattern))


class Policy:
    """Ordered rules mapping sites to recipes; the first match wins.

    Args:
        default: the recipe of sites no rule matches; ``None`` keeps them in
            high precision. Activation-by-activation matmuls and the routers
            and shared-expert gates of mixture-of-experts layers never take the
            default: only a rule that matches them opts them into FP8.
        rules: ``(pattern, recipe_or_None)`` pairs. A pattern is a glob over the
            module path (``"*.mlp.*"``, ``"lm_head"``), a compiled regex that
            must match the whole path, an ``nn.Module`` subclass, or a
            predicate ``(path, module, site) -> bool``. ``None`` as recipe
            keeps matching sites in high precision. A predicate may return a
            non-empty string instead of ``True``: the site matches, and a site
            the rule keeps in high precision shows the string as its reason.
        strict: raise instead of reporting when a rule names a site its recipe
            cannot apply to, or (in :func:`fp8graph.explain`) matches no site.

    Policies are immutable and compare equal when their rules are equal.

    Example:
        >>> Policy(default=Float8CurrentScaling(), rules=[("lm_head", None)])
    """

    __slots__ = ("_default", "_rules", "_strict")

    def __init__(self, default: Recipe | None = DEFAULT_RECIPE, rules=(), strict: bool = False):
        _check_recipe(default, "Policy.default")
        if not isinstance(strict, bool):
            raise ValueError(f"Policy.strict must be bool, got {strict!r}")
        checked = []
        for index, rule in enumerate(rules):
            if not (isinstance(rule, tuple) and len(rule) == 2):
                raise ValueError(f"Policy rule {index} must be a (pattern, recipe) pair, got {rule!r}")
            pattern, recipe = rule
            _check_pattern(pattern, index)
            _check_recipe(recipe, lambda: f"Policy rule {index} ({describe_pattern(pattern)}) recipe")
            checked.append((pattern, recipe))
        object.__setattr__(self, "_default", default)
        object.__setattr__(self, "_rules", tuple(checked))
        object.__setattr__(self, "_strict", strict)

    def __setattr__(self, name, value):
        raise AttributeError("Policy is immutable; build a new one")

    def __reduce__(self):
        # copy, deepcopy and pickle rebuild through __init__ (checked again) instead of setting slots,
        # which __setattr__ refuses. A rule's predicate pickles as any Python function does (lambdas do not).
        return Policy, (self._default, self._rules, self._strict)

    default = property(lambda self: self._default)
    rules = property(lambda self: self._rules)
    strict = property(lambda self: self._strict)

    @property
    def recipes(self) -> tuple[Recipe, ...]:
        """Every recipe the policy can hand out."""
        candidates = [self._default, *(recipe for _, recipe in self._rules)]
        return tuple(recipe for recipe in candidates if recipe is not None)

    @property
    def needs_state(self) -> bool:
        """Whether some recipe keeps state across steps (delayed scaling)."""
        return any(recipe.stateful for recipe in self.recipes)

    def rule_label(self, index: int) -> str:
        """How reports and errors name rule ``index``: ``rule 2 ('*.mlp.*')``."""
        return f"rule {index} ({describe_pattern(self._rules[index][0])})"

    def _key(self):
        return (self._default, self._rules, self._strict)

    def __eq__(self, other):
        return isinstance(other, Policy) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        rules = ", ".join(f"({describe_pattern(p)}, {r.name if r else None})" for p, r in self._rules)
        default = self._default.name if self._default else None
        return f"Policy(default={default}, rules=[{rules}], strict={self._strict})"


@dataclasses.dataclass(frozen=True)
class Resolution:
    """The recipe for a site (``None``: high precision) and the rule that chose it (``None``: default)."""

    recipe: Recipe | None
    rule_index: int | None
    reason: str | None = None  # what the matching predicate said of the site, when it said a string


def _matches(pattern: Pattern, path: str, module: torch.nn.Module | None,
             module_type: type | None, site: SiteInfo) -> "bool | str":
    if isinstance(pattern, str):
        return fnmatch.fnmatchcase(path, pattern)
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(path) is not None
    if isinstance(pattern, type):
        owner_type = type(module) if module is not None else module_type
        return owner_type is not None and issubclass(owner_type, pattern)
    answer = pattern(path, module, site)
    return answer if isinstance(answer, str) else bool(answer)


def rules_naming(policy: Policy, path: str, module: torch.nn.Module) -> tuple[int, ...]:
    """The indices of ``policy``'s rules that name the module at ``path`` by its path or class (a predicate, which
    needs a site, names none)."""
    return tuple(index for index, (pattern, _) in enumerate(policy.rules)
                 if isinstance(pattern, (str, re.Pattern, type)) and _matches(pattern, path, module, None, None))


def resolve(policy: Policy, path: str, site: SiteInfo, module: torch.nn.Module | None = None,
            module_type: type | None = None) -> Resolution:
    """The recipe ``policy`` gives the site at ``path``.

    ``module`` is the module that runs the site when the model is known;
    otherwise class patterns match on ``module_type``.
    """
    for index, (pattern, recipe) in enumerate(policy.rules):
        if matched := _matches(pattern, path, module, module_type, site):
            return Resolution(recipe, index, matched if isinstance(matched, str) else None)
    if not site.is_linear or site.gate:
        return Resolution(None, None)
    return Resolution(policy.default, None)


@dataclasses.dataclass(frozen=True)
class WeightRecipes:
    """What ``policy`` can give the linears on one weight, decided before tracing.

    Buffers that become graph inputs (delayed-scaling state, FP8 weight
    copies) are registered before anything is traced, when the token
    dimension ``M`` is unknown and, for a module other than ``nn.Linear`` or
    HuggingFace's ``Conv1D``, so is which way round the weight is multiplied.
    A rule that cannot be decided without them (a predicate that reads
    ``site.M``, or reads ``K`` and ``N`` of a weight whose orientation is
    unknown) makes its recipe possible without ruling out the rules after it;
    the traced graph decides each site (``fp8graph.passes.annotate``).
    """

    recipes: tuple[Recipe | None, ...]  # every recipe a site on the weight may get, in rule order, no repeats
    rule_indices: tuple[int | None, ...]  # the rules that may decide, in order (None: the default)
    undecided: tuple[str, ...]  # the rules that could not be decided before tracing, labelled

    def having(self, trait: str) -> tuple[Recipe, ...]:
        """The possible recipes with ``trait`` (``"stateful"``, ``"caches_weights"``), in rule order."""
        return tuple(recipe for recipe in self.recipes if recipe is not None and getattr(recipe, trait))


def weight_experts(weight: torch.Tensor) -> int | None:
    """How many experts a weight holds: E of a 3-D expert weight, (E, N, K) or (E, K, N), whose sites are
    grouped GEMMs; None for a matrix."""
    return weight.shape[0] if weight.dim() == 3 else None


def weight_orientations(module: torch.nn.Module | None, weight: torch.Tensor) -> list[tuple[int, int]]:
    """The ``(N, K)`` a linear on ``weight`` can have: ``nn.Linear`` stores (N, K), HuggingFace's ``Conv1D``
    (GPT-2) stores (K, N); a weight of any other module (an expert's, the last two dims of a 3-D weight) may
    be multiplied either way."""
    rows, columns = weight.shape[-2:]
    if isinstance(module, torch.nn.Linear):
        return [(rows, columns)]
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers."):
        return [(columns, rows)]
    return [(rows, columns)] if rows == columns else [(rows, columns), (columns, rows)]


class _BeforeTracing:
    """A site as a rule sees it before tracing: reading what only the traced graph knows (``M``,
    ``expert_stage``, ``input_readers``, and what op multiplies the weight: ``op``, ``is_linear``, ``gate``,
    guessed here as a linear that is no gate) leaves the rule undecided whatever the predicate answers
    (``site.M is not None and ...`` answers False here)."""

    TRACED = ("M", "expert_stage", "input_readers", "op", "is_linear", "gate")

    def __init__(self, site: SiteInfo):
        self._site, self.read_traced = site, False

    def __getattr__(self, name: str):
        if name in self.TRACED:
            self.read_traced = True
        return getattr(self._site, name)


def resolve_weight(policy: Policy, path: str, module: torch.nn.Module | None, weight: torch.Tensor) -> WeightRecipes:
    """The recipes ``policy`` can give a linear on the 2-D ``weight`` of ``module`` (at ``path``), or an expert
    site on its 3-D one (E, N, K), before tracing: see :class:`WeightRecipes`."""
    experts = weight_experts(weight)
    sites = [SiteInfo(op="linear" if experts is None else "grouped_mm", M=None, K=k, N=n, dtype=weight.dtype,
                      experts=experts) for n, k in weight_orientations(module, weight)]
    recipes, rule_indices, undecided = [], [], []
    for index, (pattern, recipe) in enumerate(policy.rules):
        verdicts = set()
        for site in sites:
            probe = _BeforeTracing(site)
            try:
                verdict = _matches(pattern, path, module, None, probe)
            except Exception:  # noqa: BLE001 - a predicate that needs the traced site (M is None here)
                verdict = None
            if isinstance(verdict, str):  # a predicate's reason: a match (resolve's test), unless empty
                verdict = bool(verdict)
            verdicts.add(None if probe.read_traced else verdict)
        if verdicts == {False}:
            continue
        rule_indices.append(index)
        if recipe not in recipes:
            recipes.append(recipe)
        if verdicts == {True}:
            return WeightRecipes(tuple(recipes), tuple(rule_indices), tuple(undecided))
        undecided.append(policy.rule_label(index))
    rule_indices.append(None)
    if policy.default not in recipes:
        recipes.append(policy.default)
    return WeightRecipes(tuple(recipes), tuple(rule_indices), tuple(undecided))


def normalize_policy(policy: object) -> Policy:
    """The :class:`Policy` a ``policy`` argument stands for.

    ``None`` is the default policy (every eligible linear site with
    ``Float8CurrentScaling()``); a bare recipe is shorthand for
    ``Policy(default=recipe)``.
    """
    if policy is None:
        return Policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, Recipe):
        return Policy(default=policy)
    raise TypeError(
        f"policy must be a fp8graph.Policy, a recipe such as fp8graph.Float8CurrentScaling(), "
        f"or None, got {type(policy).__name__}"
    )
