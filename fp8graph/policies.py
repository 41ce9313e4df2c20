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

from fp8graph.recipes.policy import Policy, SiteInfo
from fp8graph.recipes.scaling import PRESETS

__all__ = ["H100_LINEAR_SPEEDUPS", "auto"]


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


# The built-in measurement: ``python -m bench linear`` on an H100 80GB HBM3 (torch 2.11.0+cu130,
# triton 3.6.0, 2026-11-23), forward + backward of one linear layer, fp8graph's speedup over BF16
# torch.compile per (M, K, N), rounded to 0.01; the raw result is bench/results/linear-2026-11-23T081002Z.json
# (tests/recipes/test_policies_auto.py checks this table against it). Current scaling lost at 1024x1024x1024
# (0.73x) and 4096x1024x1024 (0.87x) and won 1.48-1.55x at the Llama-3-8B shapes. The tiled
# recipes ran that day on their previous kernels (block and MXFP8 never gained; MXFP8 is emulated
# on an H100): measure again with this version's kernels and pass the file.
H100_LINEAR_SPEEDUPS = {
    "current": {(1024, 1024, 1024): 0.73, (4096, 1024, 1024): 0.87, (16384, 4096, 4096): 1.51,
                (16384, 4096, 14336): 1.48, (16384, 14336, 4096): 1.55},
    "delayed": {(1024, 1024, 1024): 0.46, (4096, 1024, 1024): 0.64, (16384, 4096, 4096): 1.39,
                (16384, 4096, 14336): 1.47, (16384, 14336, 4096): 1.45},
    "rowwise": {(1024, 1024, 1024): 0.32, (4096, 1024, 1024): 0.38, (16384, 4096, 4096): 0.91,
                (16384, 4096, 14336): 1.06, (16384, 14336, 4096): 1.05},
    "block": {(1024, 1024, 1024): 0.31, (4096, 1024, 1024): 0.37, (16384, 4096, 4096): 0.74,
              (16384, 4096, 14336): 0.88, (16384, 14336, 4096): 0.87},
    "mxfp8": {(1024, 1024, 1024): 0.31, (4096, 1024, 1024): 0.41, (16384, 4096, 4096): 0.06,
              (16384, 4096, 14336): 0.06, (16384, 14336, 4096): 0.06},
}
H100_LINEAR_SOURCE = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-23",
                      "file": "bench/results/linear-2026-11-23T081002Z.json"}


def _built_in_measurements() -> dict:
    """The built-in H100 table in the form of a ``bench linear`` result."""
    rows = [{"contestant": f"fp8graph {recipe} (inductor)", "M": M, "K": K, "N": N, "speedup_vs_bf16_compile": speedup}
            for recipe, shapes in H100_LINEAR_SPEEDUPS.items() for (M, K, N), speedup in shapes.items()]
    return {"workload": "linear_fwd_bwd", "smoke": False, "rows": rows,
            "environment": {"device": H100_LINEAR_SOURCE["device"],
                            "date": f"{H100_LINEAR_SOURCE['date']}, {H100_LINEAR_SOURCE['file']}"}}


def auto(measurements=None, recipe: str = "current", min_speedup: float = 1.0) -> Policy:
    """A policy that gives ``recipe`` to the linear sites large enough to gain, by measurement.

    Args:
        measurements: a ``python -m bench linear`` result (the JSON file's path,
            or the loaded dict) from the GPU the model will run on; ``None``
            takes the built-in H100 measurement (:data:`H100_LINEAR_SPEEDUPS`).
        recipe: a name of :data:`fp8graph.recipes.scaling.PRESETS` whose rows in the
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
    result = _built_in_measurements() if measurements is None else _load(measurements)
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
