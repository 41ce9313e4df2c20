"""A site's modelled time on a GPU, in BF16 and in an FP8 recipe: what :func:`fp8graph.policies.auto` decides by
and :func:`fp8graph.explain` reports.

For one linear site (``M`` tokens, ``K`` in, ``N`` out; an expert site: ``M`` sorted tokens over ``E`` groups)::

    BF16   output = input @ weight.T, and in training grad_input = grad_output @ weight and
           grad_weight = grad_output.T @ input: each 2 M K N FLOPs at the GPU's BF16 rate, never less than
           its operands' bytes at copy bandwidth or the GEMM floor
    FP8    the same GEMMs at the recipe's FP8 rate, plus the casts: every kernel of
           fp8graph.costs.casts at Inductor's bandwidth (fp8graph's own kernels at copy bandwidth), never
           less than the launch floor each, and the small launches at the floor; the input's kernels divided
           among the linear sites that read it (``SiteInfo.input_readers``: q, k and v, gate and up), which one
           cast serves when they run in one recipe (as if all of them do); an expert site in training,
           its share of what the recipe adds to a MoE block (GROUPED_CAST_TRAFFIC, or its own GEMM's where it
           knows which of the expert MLP's GEMMs it is, GROUPED_STAGE_CAST_TRAFFIC; a site that keeps its
           weight's copy for grad_input from the forward, _keeps_weight_copy, with that form's rates): Inductor's
           FP8 casts at the GPU's cast rate, its other kernels' bytes over BF16's at its plain rate, fp8graph's
           ops at their transposed-store rate, as the block model prices each kernel by its kind

A recipe whose GEMM the GPU lacks (MXFP8 before Blackwell) is emulated: its GEMMs run at the BF16 rate after
the casts, so it never gains. Only kernel time is modelled: no CPU overhead, no overlap, no attention or
elementwise work the site does not add. The cost model (``python -m bench model``) times whole steps from
the kernels Inductor generates; this module times one site from the per-element traffic those kernels
showed, so the two agree on a linear site by construction and may differ where a graph fuses casts into
other kernels.
"""

from __future__ import annotations

import dataclasses

from fp8graph.costs.casts import (CAST_TRAFFIC, GROUPED_CAST_TRAFFIC, GROUPED_STAGE_CAST_TRAFFIC, GroupedCasts,
                                  KernelBytes, RecipeCasts)
from fp8graph.costs.gpus import GPU, gpu as gpu_named
from fp8graph.recipes.policy import SiteInfo
from fp8graph.numerics.groups import ExpertGemm, weight_copies_kept, weight_copy_fits
from fp8graph.recipes.scaling import FP8_GEMM_DIM_MULTIPLE, NATIVE_GROUPED_GRANULARITIES, PRESETS

__all__ = ["SYMBOLIC_TOKENS", "SiteTimes", "site_times"]

# The token count a site whose M is symbolic (dynamic=True) is modelled at, where a caller gives none: what
# policies.auto() decides such sites at, and what fp8graph.inspection.slow_sites judges them at.
SYMBOLIC_TOKENS = 8192

_BF16_BYTES = 2
# MXFP8's casts are not in the table (the cost model has no MXFP8 contestant): block scaling's are the
# nearest, one read of each operand writing it and its transposed copy with a scale per 32 or 128 elements.
_CASTS_STANDING_IN = {"mxfp8": "block", "mxfp8 saved-transposes": "block saved-transposes"}


def _keeps_weight_copy(site: SiteInfo, M: int) -> bool:
    """Whether a per-tensor expert site keeps its weight's copy for grad_input from the forward: where its own
    input pays for it (``weight_copy_fits``), or, for a GEMM of a whole expert MLP (``expert_stage``), where the
    MLP's inputs pay for it with the other GEMM in FP8 too, as the stage table measured them
    (``weight_copies_kept``, the rule ``passes.expert_sites.pool_weight_copies`` applies): SwiGLU halves the
    first GEMM's N into the second's K, and the second's N is the first's K. A policy that puts the second GEMM
    alone in FP8 is priced with a copy the pass would not keep (what the first's input saves is not there)."""
    experts, K, N = site.experts, site.K, site.N
    gemm = ExpertGemm(M, experts, out_features=N, in_features=K)
    if site.expert_stage is None:
        return weight_copy_fits(gemm, FP8_GEMM_DIM_MULTIPLE)
    if site.expert_stage == 0:
        mlp = (gemm, ExpertGemm(M, experts, out_features=K, in_features=N // 2))
    else:
        mlp = (ExpertGemm(M, experts, out_features=2 * K, in_features=N), gemm)
    return weight_copies_kept(mlp, FP8_GEMM_DIM_MULTIPLE)[site.expert_stage]


@dataclasses.dataclass(frozen=True)
class SiteTimes:
    """Microseconds of kernel time per call (forward, and backward when ``training``)."""

    gpu: str
    recipe: str  # the recipe's kind (fp8graph.recipes.scaling.PRESETS)
    M: int
    bf16_us: float
    fp8_gemm_us: float
    fp8_casts_us: float
    emulated: bool  # the GPU has no FP8 GEMM for the recipe

    @property
    def fp8_us(self) -> float:
        return self.fp8_gemm_us + self.fp8_casts_us

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.fp8_us

    def describe(self) -> str:
        """``BF16 12.3 us, current 15.2 us (0.81x) on H100, modelled``."""
        emulated = ", its GEMM emulated" if self.emulated else ""
        return (f"BF16 {self.bf16_us:,.1f} us, {self.recipe} {self.fp8_us:,.1f} us ({self.speedup:.2f}x{emulated}) "
                f"on {self.gpu}, modelled")


def _gemms_us(M: int, K: int, N: int, weights: int, flops_rate: float, operand_bytes: float, gpu: GPU,
              training: bool) -> float:
    """The forward GEMM, and in training the two backward ones (same FLOPs, same operands' sizes)."""
    flops = 2 * M * K * N
    moved = operand_bytes * (M * K + weights * K * N + M * N)
    one = max(flops / flops_rate * 1e6, moved / gpu.copy_bandwidth * 1e6, gpu.gemm_floor_us)
    return one * (3 if training else 1)


def _casts_us(casts: RecipeCasts, sizes: dict[str, int], gpu: GPU, training: bool) -> float:
    total = 0.0
    for kernels in casts.kernels:
        if kernels.backward and not training:
            continue
        rate = gpu.copy_bandwidth if kernels.custom_op else gpu.triton_bandwidth * gpu.cast_fraction
        moved = (kernels.read + kernels.written) * sizes[kernels.operand]
        total += max(moved / rate * 1e6, kernels.launches * gpu.launch_floor_us)
    small = casts.small_launches if training else casts.small_launches - casts.small_backward_launches
    return total + small * gpu.launch_floor_us


def _kernel_bytes_us(moved: KernelBytes, elements: float, gpu: GPU) -> float:
    """``elements`` times ``moved``'s bytes an element, each kind of kernel at its rate."""
    return elements * (moved.cast / (gpu.triton_bandwidth * gpu.cast_fraction) + moved.plain / gpu.triton_bandwidth
                       + moved.custom_op / (gpu.copy_bandwidth * gpu.transposed_store_fraction)) * 1e6


def _grouped_casts_us(casts: GroupedCasts, M: int, K: int, N: int, experts: int, gpu: GPU, kept: bool) -> float:
    """One expert GEMM's share of a block's casts (or its stage's): its own elements' bytes, its share of the
    launches; ``kept``:
    the site keeps its weight's copy for grad_input from the forward. fp8graph's ops on an expert GEMM store
    tiles transposed (grad_weight's placed operands, the weights' layouts)."""
    weight = casts.weight + casts.kept_weight if kept else casts.weight
    moved_us = _kernel_bytes_us(casts.activation, M * (K + N), gpu) + _kernel_bytes_us(weight, experts * K * N, gpu)
    return max(moved_us, casts.block_launches / casts.sites * gpu.launch_floor_us)


def site_times(site: SiteInfo, recipe, gpu: "str | GPU" = "H100", training: bool = True,
               tokens: int | None = None) -> SiteTimes:
    """The modelled kernel time of ``site`` per call in BF16 and in ``recipe`` on ``gpu``.

    Args:
        site: the site as policy rules see it; ``site.M`` a string (a symbolic token count) is modelled at
            ``tokens``.
        recipe: a recipe (:data:`fp8graph.recipes.scaling.PRESETS`' values and their variations) or a kind's name.
        gpu: ``"H100"``, ``"H200"``, ``"B200"`` or a :class:`fp8graph.costs.gpus.GPU`.
        training: forward and backward (three GEMMs), else the forward alone.
        tokens: the M of a site whose M is symbolic.

    Raises:
        ValueError: the site has no GEMM shape, a symbolic M and no ``tokens``, or ``recipe`` is unknown.
    """
    rates = gpu_named(gpu)
    kind = recipe if isinstance(recipe, str) else getattr(recipe, "kind", None)
    table = f"{kind} saved-transposes" if getattr(recipe, "save_transposes", False) else kind
    casts = CAST_TRAFFIC.get(_CASTS_STANDING_IN.get(table, table))
    if casts is None:
        raise ValueError(f"fp8graph.costs: no modelled casts for recipe {recipe!r}; known: "
                         f"{sorted({*CAST_TRAFFIC, *_CASTS_STANDING_IN})}")
    if site.K is None or site.N is None:
        raise ValueError(f"fp8graph.costs: {site.op} has no GEMM shape to model")
    M = site.M
    if not isinstance(M, int):
        if tokens is None:
            raise ValueError(f"fp8graph.costs: M is symbolic ({M}); pass the tokens to model it at")
        M = tokens
    K, N = site.K, site.N
    weights = site.experts or 1
    if site.experts:
        bf16_rate = rates.grouped_flops(False, M / weights)  # M: the sorted tokens, M / E a group on average
        granularity = (PRESETS[kind] if isinstance(recipe, str) else recipe).granularity
        fp8_rate = rates.grouped_flops(True, M / weights) if granularity in NATIVE_GROUPED_GRANULARITIES else None
    else:
        bf16_rate, fp8_rate = rates.bf16_flops, rates.fp8_gemm_flops.get(kind)
    emulated = fp8_rate is None
    bf16_us = _gemms_us(M, K, N, weights, bf16_rate, _BF16_BYTES, rates, training)
    if emulated:  # dequantized to BF16 and multiplied there: the BF16 GEMMs, after the casts
        fp8_gemm_us = bf16_us
    else:  # FP8 operands, a BF16 output: about 1.3 bytes an element read and written
        fp8_gemm_us = _gemms_us(M, K, N, weights, fp8_rate, 4 / 3, rates, training)
    grouped = GROUPED_CAST_TRAFFIC.get(kind) if site.experts else None
    if grouped is not None and site.expert_stage is not None and kind in GROUPED_STAGE_CAST_TRAFFIC:
        grouped = GROUPED_STAGE_CAST_TRAFFIC[kind][site.expert_stage]  # its own GEMM's casts, not the block's
    if grouped is not None and training:
        # A symbolic M (dynamic=True) is modelled at ``tokens``, but the site cannot prove it fits: cast again.
        kept = getattr(recipe, "save_transposes", False) or (isinstance(site.M, int) and _keeps_weight_copy(site, M))
        casts_us = _grouped_casts_us(grouped, M, K, N, weights, rates, kept)
    else:  # dense sites; expert sites of the recipes the sweep did not model, or in inference: the dense casts
        # One cast of a shared input serves every linear reading it (passes.group_sites): each pays its share.
        sizes = {"input": M * K / max(site.input_readers, 1), "weight": weights * K * N, "grad_output": M * N}
        casts_us = _casts_us(casts, sizes, rates, training)
    return SiteTimes(rates.name, kind, M, bf16_us, fp8_gemm_us, casts_us, emulated)
