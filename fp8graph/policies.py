"""Ready-made policies: :func:`auto` keeps in high precision the sites FP8 would make slower.

    compiled = fp8graph.compile(model, policy=fp8graph.policies.auto())    # modelled on the GPU it runs on
    print(fp8graph.explain(compiled, input_ids))                            # each kept site says why, in us

FP8 pays for its quantization only on GEMMs large enough that the faster
GEMM outweighs the extra amax, scale and cast passes. ``auto`` decides each
site from its modelled kernel time (:mod:`fp8graph.costs`: the GPU's rates and
the bytes this version's casts move), or, given a ``python -m bench linear``
measurement from the GPU you train on, from the smallest measured shape that gained.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

from fp8graph.costs import SYMBOLIC_TOKENS, GPU, gpu as gpu_named, running_gpu, site_times
from fp8graph.recipes.policy import Policy, SiteInfo
from fp8graph.recipes.scaling import PRESETS, Recipe

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


def auto(measurements=None, recipe: str = "current", min_speedup: float = 1.05, gpu: "str | GPU | None" = None,
         tokens: int = SYMBOLIC_TOKENS) -> Policy:
    """A policy that gives ``recipe`` to the linear and expert sites that gain from it.

    Args:
        measurements: ``None`` decides from the cost model (:func:`fp8graph.costs.site_times`: the site's
            forward and backward GEMMs and the casts ``recipe`` adds, at ``gpu``'s rates); a
            ``python -m bench linear`` result (the JSON file's path, or the loaded dict) from the GPU the
            model will run on decides from the smallest measured shape that gained instead.
        recipe: a name of :data:`fp8graph.recipes.scaling.PRESETS` (``"current"``, ``"delayed"``,
            ``"rowwise"``, ``"block"``, ``"mxfp8"``).
        min_speedup: the speedup over BF16 a site must reach to run in FP8. The default asks a 5% gain, the
            margin of the model's error on a site: an expert GEMM modelled 1.01x ran its MoE block at
            0.99x in the cost model (docs/policies-and-inspection.md); 1.0 takes any gain.
        gpu: the GPU the cost model times sites on (``"H100"``, ``"H200"``, ``"B200"``, or a
            :class:`fp8graph.costs.GPU`); ``None``, the one this process runs on
            (:func:`fp8graph.costs.running_gpu`: the H100's rates where it knows no other); unused with
            ``measurements``. The rule's name, which ``explain`` shows for each kept site, names it.
        tokens: the ``M`` the model times a site at when its ``M`` is symbolic (``dynamic=True``).

    Modelled, a site stays in high precision when its modelled time in ``recipe`` is more than its BF16
    time over ``min_speedup``, and ``explain`` gives both times as its reason. Measured, a site runs in
    FP8 when its ``M*K*N`` is at least that of the smallest measured shape from which every larger
    measured shape reached ``min_speedup``; nothing is interpolated, a symbolic ``M`` is judged by
    ``K*N``, and if no shape gained every linear site stays in high precision. Either way a rule of the
    user's own comes first: ``Policy(default=..., rules=[*mine, *auto().rules])``.

    Raises:
        ValueError: ``recipe`` is not a preset name; ``gpu`` is unknown; the measurements are not a GPU
            ``bench linear`` result or have no row for ``recipe``.
    """
    if recipe not in PRESETS:
        raise ValueError(f"fp8graph.policies.auto: recipe must be one of {sorted(PRESETS)}, got {recipe!r}")
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) or not min_speedup > 0:
        raise ValueError(f"fp8graph.policies.auto: min_speedup must be a positive number, got {min_speedup!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"fp8graph.policies.auto: tokens must be a positive int, got {tokens!r}")
    if measurements is None:
        return _modelled(PRESETS[recipe], min_speedup, None if gpu is None else gpu_named(gpu), tokens)
    return _measured(measurements, recipe, min_speedup)


class _ModelledBelow:
    """auto()'s modelled rule: keeps a site whose modelled speedup in ``recipe`` is under ``min_speedup``. Without a
    named GPU it takes the rates of the one this process runs on when it decides its first site, at compile time,
    not when the policy is made: a policy made before a fork leaves CUDA uninitialised for the children."""

    def __init__(self, recipe: Recipe, min_speedup: float, gpu: "GPU | None", tokens: int):
        self._recipe, self._min_speedup, self._named_gpu, self._tokens = recipe, min_speedup, gpu, tokens

    @functools.cached_property
    def gpu(self) -> GPU:
        return running_gpu() if self._named_gpu is None else self._named_gpu

    @property
    def __name__(self) -> str:  # the rule's name in explain's reports
        return f"auto: {self._recipe.kind} modelled below {self._min_speedup}x of BF16 on {self.gpu.name}"

    def __call__(self, path: str, module, site: SiteInfo) -> "str | bool":
        if not (isinstance(site.K, int) and isinstance(site.N, int)):
            return False  # not a GEMM shape the model speaks to (none, or two activations' symbolic sizes)
        times = site_times(site, self._recipe, self.gpu, training=True, tokens=self._tokens)
        if times.speedup >= self._min_speedup:
            return False
        if times.speedup < 1.0:
            return f"FP8 modelled slower: {times.describe()}"
        return f"FP8 modelled to gain under the {self._min_speedup}x asked: {times.describe()}"


def _modelled(recipe: Recipe, min_speedup: float, gpu: "GPU | None", tokens: int) -> Policy:
    return Policy(default=recipe, rules=[(_ModelledBelow(recipe, min_speedup, gpu, tokens), None)])


class _NoMeasuredGain:
    """auto()'s measured rule where no shape gained: keeps every site. A class, not a closure, so that a policy
    (and a model compiled with it) pickles."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(self, path: str, module, site: SiteInfo) -> bool:
        return True


class _BelowMeasuredGain:
    """auto()'s measured rule: keeps a site whose GEMM is smaller than the smallest shape from which every larger
    measured shape gained (``threshold``)."""

    def __init__(self, name: str, threshold: _Shape) -> None:
        self.__name__, self._threshold = name, threshold

    def __call__(self, path: str, module, site: SiteInfo) -> bool:
        if not (isinstance(site.K, int) and isinstance(site.N, int)):
            return False  # not a GEMM shape the measurements speak to
        if isinstance(site.M, int):
            return site.M * site.K * site.N < self._threshold.size
        return site.K * site.N < self._threshold.K * self._threshold.N


def _measured(measurements, recipe: str, min_speedup: float) -> Policy:
    result = _load(measurements)
    shapes = _measured_shapes(result, recipe)
    threshold = _threshold(shapes, min_speedup)
    environment = result.get("environment", {})
    source = f"bench linear on {environment.get('device', '?')}, {environment.get('date', '?')}"

    if threshold is None:
        rule = _NoMeasuredGain(f"auto: {recipe} reached {min_speedup}x of BF16 torch.compile at no measured shape "
                               f"({source})")
        return Policy(default=None, rules=[(rule, None)])
    below_measured_gain = _BelowMeasuredGain(
        f"auto: M*K*N below {threshold.M}x{threshold.K}x{threshold.N}, the smallest shape from which "
        f"{recipe} reached {min_speedup}x of BF16 torch.compile ({source})", threshold)
    return Policy(default=PRESETS[recipe], rules=[(below_measured_gain, None)])
