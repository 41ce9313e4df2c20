"""Scaling recipes: how each FP8 cast of a linear site picks its scale.

A recipe is a frozen dataclass. It holds no state and is hashable, so it can
key caches and be compared; variations are made with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import ClassVar, Union

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fp8graph.numerics.formats import ROLES, Format, Role, fp8_max
from fp8graph.numerics.tiles import ScaleKind, Tiling

__all__ = ["EXPERT_GRANULARITIES", "FP8_GEMM_DIM_MULTIPLE", "DelayedScaling", "Granularity", "Float8BlockScaling",
           "Float8CurrentScaling", "Float8RowwiseScaling", "MXFP8BlockScaling", "NATIVE_GROUPED_GRANULARITIES",
           "PRESETS", "Recipe", "TiledRecipe", "expert_recipe", "misaligned", "unsupported_on_experts"]

# cuBLAS's FP8 GEMMs need the dimensions they do not reduce over, and K, to be multiples of 16.
FP8_GEMM_DIM_MULTIPLE = 16


def _check_type(recipe: object, field: str, expected: type) -> None:
    value = getattr(recipe, field)
    # bool is an int subclass: reject it where an int is asked for, and vice versa.
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise ValueError(
            f"{type(recipe).__name__}.{field} must be {expected.__name__}, got {value!r}"
        )


def _largest_margin(fp8_format: Format) -> int:
    """The largest margin that keeps an amax above the smallest subnormal of every dtype of ``fp8_format``
    with a binade to spare: log2(max / smallest subnormal), less one (16 for E4M3, 30 for E5M2)."""
    def binades(dtype: torch.dtype) -> int:
        info = torch.finfo(dtype)
        return math.floor(math.log2(fp8_max(dtype) / (info.tiny * info.eps)))

    return min(binades(fp8_format.dtype(role)) for role in ROLES) - 1


def _check_amax_algo(algo) -> None:
    """A callable amax algorithm runs inside the compiled graph: it must be tensor code returning one value.
    Tried here on a fake history, so a Python-side value (``.item()``) or a wrong type fails now, by name."""
    with FakeTensorMode():
        history = torch.zeros(4)
        try:
            amax = algo(history)
        except Exception as error:
            raise ValueError(
                f"DelayedScaling.amax_compute_algo {getattr(algo, '__name__', algo)!r} must be tensor code the "
                f"graph can run (no .item(), .tolist() or Python control flow on values): on a history tensor it "
                f"raised {type(error).__name__}: {error}") from error
        ok = isinstance(amax, (int, float)) and not isinstance(amax, bool) or (
            isinstance(amax, torch.Tensor) and amax.numel() == 1 and amax.dtype.is_floating_point)
    if not ok:
        got = f"a {amax.dtype} tensor of shape {tuple(amax.shape)}" if isinstance(amax, torch.Tensor) else repr(amax)
        raise ValueError(
            f"DelayedScaling.amax_compute_algo {getattr(algo, '__name__', algo)!r} must return one amax (a "
            f"0-dim float tensor, or a number), got {got}")


def misaligned(recipe, **dims: int) -> str | None:
    """Why a GEMM whose dimensions are ``dims`` (``K=..., N=...``) cannot run ``recipe`` in FP8, or ``None``.

    Each dimension must be a multiple of the recipe's ``dim_multiple`` (its tile, or cuBLAS's 16); with
    ``recipe=None``, of 16, which every FP8 GEMM needs. The one place this is written: the traced sites
    (``fp8graph.passes.annotate``), the plan, the weights given state and FSDP2's FP8 gathers all ask it.
    """
    multiple = FP8_GEMM_DIM_MULTIPLE if recipe is None else recipe.dim_multiple
    for name, size in dims.items():
        if isinstance(size, int) and size % multiple:
            tiles = f" ({recipe.name} tiles)" if recipe is not None and recipe.tiled else ""
            return f"{name}={size} is not a multiple of {multiple}{tiles}"
    return None


class Granularity(enum.Enum):
    """What one scale of a recipe covers: what a GEMM, a kernel or a target asks of a recipe."""

    TENSOR = "one scale per tensor"
    ROW = "one scale per row along the reduction dimension"
    BLOCK = "one scale per 1x128 tile of activations, 128x128 block of weights"
    MX = "one E8M0 scale per block of 32 along the reduction dimension"


# What a scale of the recipes expert sites run covers (the others are kept in high precision with the reason:
# passes.annotate): no 128x128 weight blocks, which would tile across experts' groups of tokens.
EXPERT_GRANULARITIES = frozenset({Granularity.TENSOR, Granularity.ROW, Granularity.MX})
# Those whose expert GEMMs run torch._scaled_grouped_mm; MXFP8's are emulated block by block on every GPU
# (fp8graph.targets.grouped_blocks): the targets choose the GEMM by it, the cost model its rate.
NATIVE_GROUPED_GRANULARITIES = frozenset({Granularity.TENSOR, Granularity.ROW})


def unsupported_on_experts(recipe: "Recipe") -> str | None:
    """Why an expert GEMM (a 3-D weight) cannot run ``recipe``, or None: what ``passes.annotate`` keeps such a site
    in high precision for, and what ``fp8graph.plan`` says of the weight before tracing."""
    if recipe.granularity not in EXPERT_GRANULARITIES:
        return (f"{recipe.name} on expert GEMMs is not supported yet: expert sites run row-wise, current, delayed "
                "or MXFP8 scaling")
    return None


class _RecipeKind:
    """What every recipe says of itself, so that no caller has to ask with ``isinstance``.

    ``str(recipe)`` is its short name (``current(HYBRID)``), as reports and tables print it.
    """

    # Keeps amax histories and scales across steps, in buffers of the modules (fp8graph.buffers.delayed_state).
    stateful: ClassVar[bool] = False
    # One scale per row, tile or block (fp8graph.targets.linear_tiled), not one per tensor.
    tiled: ClassVar[bool] = False
    # An FP8 copy of its weight can be kept while the weight does not change (fp8graph.buffers.weight_cache):
    # the cast depends on the weight alone (bit-equal to casting at every call), or, with delayed scaling, on
    # the weight and the scale the copy keeps.
    caches_weights: ClassVar[bool] = False
    # K and N of an eligible site are multiples of this.
    dim_multiple: ClassVar[int] = FP8_GEMM_DIM_MULTIPLE
    # What one scale covers.
    granularity: ClassVar[Granularity] = Granularity.TENSOR
    # Its preset's name in PRESETS: what the cost model (fp8graph.costs) knows its casts and GEMM by.
    kind: ClassVar[str]

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_RecipeKind):
    """Per-tensor current scaling.

    Each tensor is scaled by its own amax at the moment it is cast::

        scale = fp8_max / amax(tensor)         (1 when amax is 0)
        tensor_fp8 = round_to_nearest_even(clamp(tensor * scale, -fp8_max, fp8_max))

    The amax is over the finite values: a NaN or inf casts to NaN (E5M2: inf
    stays inf) without changing the scale of the others.

    The amax costs one extra read of the tensor before the cast.

    Args:
        fp8_format: FP8 dtype per role; ``Format.HYBRID`` casts grad_output
            to E5M2 and input and weight to E4M3.
        power_2_scales: round every scale down to a power of two, so that
            scaling changes only the exponent and is exact.
        save_transposes: what the backward's GEMMs read transposed (each weight and each input, in FP8) is
            written by the forward and saved until the backward (``True``, as Transformer Engine keeps its
            weights' transposes): a step reads each weight once less, and holds one byte a weight element and
            an input element more from forward to backward. ``False`` (default): the backward casts each
            weight's transposed copy from the weight, and AOTAutograd's partitioner chooses for each input's
            between saving it and casting it again from what the backward saves anyway, so that a step keeps
            no more for its backward than BF16's (``fp8graph.targets.linear_tensorwise``). The bytes of every
            FP8 tensor, and so the results, are the same either way.

    Example:
        >>> Float8CurrentScaling(fp8_format=Format.E4M3)
        Float8CurrentScaling(fp8_format=<Format.E4M3: 'E4M3'>, power_2_scales=False, save_transposes=False)
    """

    kind: ClassVar[str] = "current"

    caches_weights: ClassVar[bool] = True

    fp8_format: Format = Format.HYBRID
    power_2_scales: bool = False
    save_transposes: bool = False

    def __post_init__(self) -> None:
        _check_type(self, "fp8_format", Format)
        _check_type(self, "power_2_scales", bool)
        _check_type(self, "save_transposes", bool)

    @property
    def name(self) -> str:
        """Short label for reports, e.g. ``current(HYBRID)``."""
        suffix = (", pow2" if self.power_2_scales else "") + (", saved transposes" if self.save_transposes else "")
        return f"current({self.fp8_format.value}{suffix})"

    def fp8_dtype(self, role: Role):
        return self.fp8_format.dtype(role)


_AMAX_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_RecipeKind):
    """Delayed scaling: each cast uses a scale derived from the amaxes of earlier casts.

    Per site and tensor role, a history of the last ``amax_history_len``
    amaxes and a scale are kept as buffers of the module that owns the site.
    At each training-mode call, for each role::

        amax      = max(history)            ("max")  | history[0] ("most_recent") | algo(history)
        scale     = fp8_max / (amax * 2**margin)     only if amax is finite and > 0, else unchanged
        history   = roll(history, -1); history[0] = 0      (newest moves to the end, oldest dropped)
        tensor_fp8 = cast(tensor * scale);  history[0] = amax(tensor)   (over its finite values)

    The cast and the amax read the tensor once (the scale is known before the
    cast), where current scaling reads it twice. The initial scale is 1.

    Args:
        margin: scale down by ``2**margin`` to leave headroom (int, 0 to 16:
            beyond, the amax itself casts within a binade of E4M3's smallest
            subnormal).
        fp8_format: FP8 dtype per role, as for current scaling.
        amax_history_len: amaxes kept per role (>= 1).
        amax_compute_algo: ``"max"``, ``"most_recent"``, or a callable taking
            the history tensor (newest in slot 0) and returning an amax.
        reduce_amax: max-reduce amaxes across the data-parallel group (``fp8graph.buffers.amax_reduction``).
        save_transposes: keep the backward's transposed FP8 copies from the forward, as for current scaling.
    """

    kind: ClassVar[str] = "delayed"
    # The copy keeps the scale it was cast with: the calls of a declaration reusing it cast the weight with that
    # scale and record no amax for it, as Transformer Engine's first-micro-batch caching (fp8graph.buffers.weight_cache).
    caches_weights: ClassVar[bool] = True

    stateful: ClassVar[bool] = True

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: object = "max"
    reduce_amax: bool = True
    save_transposes: bool = False

    def __post_init__(self) -> None:
        _check_type(self, "margin", int)
        _check_type(self, "save_transposes", bool)
        _check_type(self, "fp8_format", Format)
        _check_type(self, "amax_history_len", int)
        _check_type(self, "reduce_amax", bool)
        largest_margin = _largest_margin(self.fp8_format)
        if not 0 <= self.margin <= largest_margin:
            raise ValueError(
                f"DelayedScaling.margin must be in [0, {largest_margin}] for {self.fp8_format.value}, got "
                f"{self.margin}: the scale maps the amax to fp8_max / 2**margin, and beyond {largest_margin} "
                "that is within a binade of the smallest subnormal, so nearly every value casts to zero")
        if self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be >= 1, got {self.amax_history_len}")
        if not (self.amax_compute_algo in _AMAX_ALGOS or callable(self.amax_compute_algo)):
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable, "
                f"got {self.amax_compute_algo!r}"
            )
        if callable(self.amax_compute_algo):
            _check_amax_algo(self.amax_compute_algo)

    @property
    def name(self) -> str:
        algo = self.amax_compute_algo if isinstance(self.amax_compute_algo, str) else "custom"
        margin = f", margin {self.margin}" if self.margin else ""
        saved = ", saved transposes" if self.save_transposes else ""
        return f"delayed({self.fp8_format.value}, {algo}, len {self.amax_history_len}{margin}{saved})"

    @property
    def power_2_scales(self) -> bool:
        return False

    def fp8_dtype(self, role: Role):
        return self.fp8_format.dtype(role)


class _TiledScaling(_RecipeKind):
    """What the recipes with one scale per row, tile or block share.

    Every operand is E4M3. ``tiling(role)`` gives the tiles of an operand laid
    out (rows, reduction dim); each GEMM quantizes its operands along its own
    reduction dimension, from high precision (see ``fp8graph.targets.linear_tiled``).
    A site is eligible when K and N are multiples of ``dim_multiple``.
    """

    tiled: ClassVar[bool] = True
    caches_weights: ClassVar[bool] = True
    fp8_format = Format.E4M3

    def fp8_dtype(self, role: Role):
        return torch.float8_e4m3fn

    def tiling(self, role: Role) -> Tiling:
        raise NotImplementedError


def _saved_named(recipe: _TiledScaling, name: str) -> str:
    return f"{name[:-1]}, saved transposes)" if recipe.save_transposes else name


@dataclasses.dataclass(frozen=True)
class _ExactOrPower2Scaling(_TiledScaling):
    """Tiled recipes whose scales are exact or, by default, rounded down to powers of two."""

    power_2_scales: bool = True
    save_transposes: bool = False

    def __post_init__(self) -> None:
        _check_type(self, "power_2_scales", bool)
        _check_type(self, "save_transposes", bool)

    @property
    def scale_kind(self) -> ScaleKind:
        return ScaleKind.POWER_2 if self.power_2_scales else ScaleKind.EXACT

    def _named(self, name: str) -> str:
        return _saved_named(self, f"{name[:-1]}, pow2)" if self.power_2_scales else name)


@dataclasses.dataclass(frozen=True)
class Float8RowwiseScaling(_ExactOrPower2Scaling):
    """One scale per row of each operand along the GEMM's reduction dimension.

    The forward GEMM scales the input per token row and the weight per output
    channel; the gradient GEMMs requantize along their own reduction
    dimension from high precision (grad_output per row for grad_input, per
    column for grad_weight). Rows of very different magnitude no longer share
    one scale.

    Args:
        power_2_scales: round each scale down to a power of two (exact scaling).
        save_transposes: as for block scaling.
    """

    kind: ClassVar[str] = "rowwise"

    granularity = Granularity.ROW

    @property
    def name(self) -> str:
        return self._named("rowwise(E4M3)")

    def tiling(self, role: Role) -> Tiling:
        return Tiling(1, None, self.scale_kind)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_ExactOrPower2Scaling):
    """DeepSeek-V3 block scaling: 1x128 tiles for activations and gradients, 128x128 for weights.

    Activations and gradients needed along the other dimension in backward
    are requantized from high precision; the weight's 128x128 tiles are the
    same tiles transposed, so its quantization is reused. K and N must be
    multiples of 128.

    Args:
        power_2_scales: round each scale down to a power of two.
        save_transposes: the backward GEMMs' operands cast along the other dimension (each weight's and each
            input's, in FP8) are written by the forward and saved until the backward (``True``): a step reads
            each weight once less, and holds one byte a weight element and an input element more from forward
            to backward. ``False`` (default): the backward casts them from the weight and from the input, which
            AOTAutograd's partitioner saves or makes again from what the backward keeps anyway, so that a step
            keeps no more for its backward than BF16's (``fp8graph.targets.linear_tiled``); on CUDA an input
            fp8graph's kernel casts (1x128) keeps its copy from the forward. The bytes, and so the results, are
            the same either way.
    """

    kind: ClassVar[str] = "block"

    dim_multiple = 128
    granularity = Granularity.BLOCK

    @property
    def name(self) -> str:
        return self._named("block(1x128/128x128)")

    def tiling(self, role: Role) -> Tiling:
        return Tiling(128, 128, self.scale_kind) if role is Role.WEIGHT else Tiling(1, 128, self.scale_kind)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_TiledScaling):
    """MXFP8 (OCP microscaling): blocks of 32 along the reduction dimension, one E8M0 scale each.

    The scale of a block is the power of two at or above ``amax / 448``, so no
    element saturates. Every GEMM quantizes its operands along its own
    reduction dimension from high precision. K and N must be multiples of 32.

    Args:
        save_transposes: as for block scaling.
    """

    kind: ClassVar[str] = "mxfp8"

    dim_multiple = 32
    granularity = Granularity.MX

    save_transposes: bool = False

    def __post_init__(self) -> None:
        _check_type(self, "save_transposes", bool)

    @property
    def power_2_scales(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return _saved_named(self, "mxfp8(E4M3, 1x32, E8M0)")

    def tiling(self, role: Role) -> Tiling:
        return Tiling(1, 32, ScaleKind.E8M0)


# The recipes with one scale per row, tile or block (works with isinstance).
TiledRecipe = Union[Float8RowwiseScaling, Float8BlockScaling, MXFP8BlockScaling]
# The recipes a site can be given (works with isinstance).
Recipe = Union[Float8CurrentScaling, DelayedScaling, Float8RowwiseScaling, Float8BlockScaling, MXFP8BlockScaling]

# Each recipe with its defaults, by the short name command lines and benchmarks use.
PRESETS: dict[str, Recipe] = {
    "current": Float8CurrentScaling(),
    "delayed": DelayedScaling(),
    "rowwise": Float8RowwiseScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
}


def expert_recipe(recipe: Recipe) -> Recipe:
    """The recipe an expert site runs when a policy gives it ``recipe``: every operand E4M3, grad_output too
    (``torch._scaled_grouped_mm`` takes E4M3 only; fp8graph.targets.grouped), the rest unchanged."""
    if recipe.granularity is Granularity.TENSOR and recipe.fp8_format is not Format.E4M3:
        return dataclasses.replace(recipe, fp8_format=Format.E4M3)
    return recipe
