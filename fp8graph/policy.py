"""Which recipe each site gets.

For now a policy is one recipe applied to every eligible site (``None`` means
the default, :data:`DEFAULT_RECIPE`). Resolution is a pure function of the
policy and the site, so it can be tested with tables of cases.
"""

from __future__ import annotations

from .recipes import Float8CurrentScaling, Recipe

__all__ = ["DEFAULT_RECIPE", "normalize_policy", "recipe_for_site"]

DEFAULT_RECIPE = Float8CurrentScaling()


def normalize_policy(policy: object) -> Recipe:
    """The recipe a ``policy`` argument stands for; raises ``TypeError`` for anything else."""
    if policy is None:
        return DEFAULT_RECIPE
    if isinstance(policy, Recipe):
        return policy
    raise TypeError(
        f"policy must be a recipe such as fp8graph.Float8CurrentScaling() or None, "
        f"got {type(policy).__name__}"
    )


def recipe_for_site(policy: Recipe, path: str) -> Recipe | None:
    """The recipe for the site at module ``path``; ``None`` keeps it in high precision."""
    del path  # every site gets the policy's recipe until per-module rules exist
    return policy
