"""Ready-made policies: :func:`auto` keeps in high precision the sites too small to gain from FP8.

    measured = "bench/results/linear-2026-....json"          # python -m bench linear, on the GPU you train on
    compiled = fp8graph.compile(model, policy=fp8graph.policies.auto(measured))
    print(fp8graph.explain(compiled, input_ids))              # kept sites name the measurement

FP8 pays for its quantization only on GEMMs large enough that the faster
GEMM outweighs the extra amax, scale and cast passes. Where that point lies
depends on the GPU, the recipe and the shapes, so ``auto`` takes it from a
measurement (``python -m bench linear``: forward + backward of one linear
layer, fp8graph against BF16 ``torch.compile``) instead of a built-in guess.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from .policy import Policy, SiteInfo
from .recipes import PRESETS

__all__ = ["auto"]


@dataclasses.dataclass(frozen=True)
class _Shape:
    M: int
    K: int
    N: int
    speedup: float

    @property
    def size(self) -> int:
        return self.M * self.K * self.N


def _load(measurements) -> dict:
    if isinstance(measurements, dict):
        return measurements
    path = pathlib.Path(measurements)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"fp8graph.policies.auto: cannot read measurements {path}: {error}") from error


def _measured_shapes(result: dict, recipe: str) -> list[_Shape]:
    if result.get("workload") != "linear_fwd_bwd":
        raise ValueError("fp8graph.policies.auto needs a `python -m bench linear` result, "
                         f"got workload {result.get('workload')!r}")
    device = result.get("environment", {}).get("device", "?")
    if result.get("smoke") or device == "cpu":
        raise ValueError(f"fp8graph.policies.auto: these measurements come from a CPU smoke run ({device}), "
                         "whose timings mean nothing; measure on the GPU you train on")
    contestant = f"fp8graph {recipe} ("
    shapes = [_Shape(row["M"], row["K"], row["N"], row["speedup_vs_bf16_compile"])
              for row in result.get("rows", []) if row["contestant"].startswith(contestant)]
    if not shapes:
        raise ValueError(f"fp8graph.policies.auto: the measurements have no row for recipe {recipe!r}")
    return sorted(shapes, key=lambda shape: shape.size)


def _threshold(shapes: list[_Shape], min_speedup: float) -> _Shape | None:
    """The smallest measured shape from which every larger measured shape gained."""
    threshold = None
    for shape in reversed(shapes):
        if shape.speedup < min_speedup:
            break
        threshold = shape
    return threshold


def auto(measurements, recipe: str = "current", min_speedup: float = 1.0) -> Policy:
    """A policy that gives ``recipe`` to the linear sites large enough to gain, by measurement.

    Args:
        measurements: a ``python -m bench linear`` result (the JSON file's path,
            or the loaded dict) from the GPU the model will run on.
        recipe: a name of :data:`fp8graph.recipes.PRESETS` whose rows in the
            measurements decide (``"current"``, ``"rowwise"``, ``"block"``, ``"mxfp8"``).
        min_speedup: the speedup over BF16 ``torch.compile`` a shape must
            reach to count as a gain (1.0: any gain).

    A site runs in FP8 when its ``M*K*N`` is at least that of the smallest
    measured shape from which every larger measured shape reached
    ``min_speedup``; smaller sites stay in high precision, with a reason
    that names the threshold and the measurement. Between two measured
    shapes nothing is interpolated: a site smaller than the threshold shape
    stays in high precision even if it is larger than the last losing one.
    A site whose ``M`` is symbolic (``dynamic=True``) is judged by ``K*N``
    against the threshold shape's. If no shape gained, every linear site
    stays in high precision.

    Raises:
        ValueError: the measurements are not a GPU ``bench linear`` result or
            have no row for ``recipe``; ``recipe`` is not a preset name.
    """
    if recipe not in PRESETS:
        raise ValueError(f"fp8graph.policies.auto: recipe must be one of {sorted(PRESETS)}, got {recipe!r}")
    result = _load(measurements)
    shapes = _measured_shapes(result, recipe)
    threshold = _threshold(shapes, min_speedup)
    environment = result.get("environment", {})
    source = f"bench linear on {environment.get('device', '?')}, {environment.get('date', '?')}"

    if threshold is None:
        def no_measured_gain(path: str, module, site: SiteInfo) -> bool:
            return True

        no_measured_gain.__name__ = (f"auto: {recipe} reached {min_speedup}x of BF16 torch.compile at no "
                                     f"measured shape ({source})")
        return Policy(default=None, rules=[(no_measured_gain, None)])

    def below_measured_gain(path: str, module, site: SiteInfo) -> bool:
        if site.K is None or site.N is None:
            return False  # not a GEMM shape the measurements speak to
        if isinstance(site.M, int):
            return site.M * site.K * site.N < threshold.size
        return site.K * site.N < threshold.K * threshold.N

    below_measured_gain.__name__ = (
        f"auto: M*K*N below {threshold.M}x{threshold.K}x{threshold.N}, the smallest shape from which "
        f"{recipe} reached {min_speedup}x of BF16 torch.compile ({source})")
    return Policy(default=PRESETS[recipe], rules=[(below_measured_gain, None)])
