"""How a scaled FP8 GEMM is executed: cuBLAS ``_scaled_mm`` or exact emulation.

``torch._scaled_mm`` runs FP8 tensor-core GEMMs on CUDA devices of compute
capability 8.9 and later (Ada, Hopper, Blackwell). Everywhere else the GEMM is
emulated: both FP8 operands are widened to fp32 and multiplied. A product of
two FP8 values is exact in fp32, so the emulation equals the FP8 GEMM up to
the order of the fp32 accumulation.

``_scaled_mm`` has a CPU kernel too, for per-tensor and row-wise scales, about
1000x slower than an fp32 matmul (3.6 s against 1.3 ms at 512x256x512), so
``"auto"`` emulates on CPU; asking for ``lowering="scaled_mm"`` there runs the
GPU's graph (padding, layouts, ``_scaled_mm`` calls) on the CPU kernel, which
is how the tests check that path without a GPU.

The choice is made once per compile and recipe, from the device of the
graph's inputs, and recorded in the report; tests can force it. On a CUDA
device without a native FP8 GEMM for a recipe (MXFP8 below SM 10.0, block
scaling outside SM 9.x, any FP8 below SM 8.9, FP8 activation matmuls, which
cuBLAS has no batched FP8 GEMM for) the emulation would run many times
slower than BF16, so ``"auto"`` refuses it (:class:`NoNativeGemm`: the site
stays in high precision with the reason, a strict policy raises); only
``lowering="emulated"`` emulates there. The CPU always emulates exactly.
"""

from __future__ import annotations

import enum
import functools
from typing import Callable

import torch

from fp8graph.gemm.layouts import column_major, row_major
from fp8graph.gemm.library_rules import SCALE_ALIGNMENT_BYTES
from fp8graph.kernels.quantize_tiles import triton_available
from fp8graph.gemm.padding import pad_reduction_dim
from fp8graph.gemm.native_tiled import native_tiled_gemm
from fp8graph.recipes.scaling import Granularity
from fp8graph.numerics.tiles import Tiling, reference_dequantize_tiles

__all__ = ["GEMM_FORMS", "LOWERING_CHOICES", "Lowering", "NoNativeGemm", "choose_lowering", "has_cpu_kernel",
           "native_requirement",
           "one_buffer", "scalars_of",
           "scaled_gemm", "scaled_gemm_by_inverse", "tiled_scaled_gemm"]

_MIN_FP8_CAPABILITY = (8, 9)


class Lowering(str, enum.Enum):
    SCALED_MM = "scaled_mm"
    EMULATED = "emulated"


LOWERING_CHOICES = ("auto", Lowering.SCALED_MM.value, Lowering.EMULATED.value)


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def native_requirement(recipe=None) -> tuple[str, Callable[[tuple[int, int]], bool]]:
    """What a recipe's native GEMM needs: a description and a test of the compute capability.

    Per-tensor and row-wise scaling: ``torch._scaled_mm`` on SM >= 8.9.
    Block scaling (1x128 x 128x128): ``torch.nn.functional.scaled_mm`` on SM90
    (cuBLASLt's block-scaled FP8 GEMM is Hopper-only). MXFP8: the same API
    with E8M0 scales on SM100.
    """
    has_v2 = hasattr(torch.nn.functional, "scaled_mm")
    granularity = _granularity(recipe)
    if granularity is Granularity.BLOCK:
        return "a CUDA device of compute capability 9.x (SM90)", lambda cc: has_v2 and cc[0] == 9
    if granularity is Granularity.MX:
        return "a CUDA device of compute capability 10.x (SM100)", lambda cc: has_v2 and cc[0] == 10
    return "a CUDA device of compute capability >= 8.9", lambda cc: cc >= _MIN_FP8_CAPABILITY


def has_cpu_kernel(recipe=None) -> bool:
    """Whether ``torch._scaled_mm``'s CPU kernel runs ``recipe``'s GEMMs.

    Per-tensor scales: every supported torch. Row-wise scales: torch 2.13 has
    them, torch 2.11 refuses them ("only supports per-tensor scaling for CPU
    backend"), so they are probed once. Block and MX scales: never.
    """
    granularity = _granularity(recipe)
    if granularity in (Granularity.BLOCK, Granularity.MX):
        return False
    return granularity is not Granularity.ROW or _cpu_kernel_takes_rowwise_scales()


def _granularity(recipe) -> Granularity:
    """What one scale of ``recipe`` covers; ``None`` stands for per-tensor scaling."""
    return Granularity.TENSOR if recipe is None else recipe.granularity


@functools.cache
def _cpu_kernel_takes_rowwise_scales() -> bool:
    a_fp8 = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a_fp8, a_fp8.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


class NoNativeGemm(ValueError):
    """A CUDA device without a native FP8 GEMM for a site, where emulation was not asked for."""


def _device_name(device: torch.device, capability: tuple[int, int] | None) -> str:
    return f"{device} (compute capability {capability[0]}.{capability[1]})" if capability else str(device)


GEMM_FORMS = ("linear", "batched", "grouped", "gathered")


def choose_lowering(device: torch.device, requested: str = "auto", recipe=None,
                    capability: tuple[int, int] | None = None, form: str = "linear") -> Lowering:
    """Pick the GEMM lowering of ``recipe`` (default: per-tensor scaling) for a compile on ``device``.

    ``requested`` is ``"auto"`` (scaled_mm where the device has the recipe's
    native FP8 GEMM; on CPU emulation), ``"scaled_mm"`` or ``"emulated"``.
    ``"scaled_mm"`` on CPU runs ``_scaled_mm``'s slow CPU kernel (per-tensor
    and row-wise recipes only). ``capability`` stands for the device's
    compute capability (read from the device when ``None``; tests give it).
    ``form`` is the site's (``passes.sites.Site.form``): ``"linear"``; ``"batched"``, an activation matmul,
    which has no FP8 GEMM on any device; ``"grouped"``, an expert GEMM, native as ``torch._scaled_grouped_mm``
    (row-wise scales on SM 9.x, MXFP8 on SM 10.x), which has no CPU kernel; ``"gathered"``, an expert GEMM of
    weights gathered per token (MoE decode), native as ``fp8graph::gathered_gemv``'s Triton kernel (E4M3,
    SM >= 8.9).

    Raises:
        NoNativeGemm: on a CUDA device without the recipe's native GEMM, unless
            ``"emulated"`` was requested (the emulation would be a cliff).
        ValueError: ``"scaled_mm"`` requested where there is none.
    """
    if requested not in LOWERING_CHOICES:
        raise ValueError(f"lowering must be one of {LOWERING_CHOICES}, got {requested!r}")
    if form not in GEMM_FORMS:
        raise ValueError(f"form must be one of {GEMM_FORMS}, got {form!r}")
    batched, grouped, gathered = (form == name for name in GEMM_FORMS[1:])
    if capability is None:
        capability = _capability(device)
    needs, supported = native_requirement(recipe)
    what = recipe.name if recipe is not None else "FP8"
    if batched:
        needs, supported = "a 2-D GEMM (cuBLAS has no batched FP8 GEMM): an activation matmul", lambda cc: False
    elif gathered:
        needs, supported = ("fp8graph's gathered FP8 GEMV (a Triton kernel: Triton installed, compute capability "
                            ">= 8.9)", lambda cc: cc >= _MIN_FP8_CAPABILITY and triton_available())
    elif grouped and _granularity(recipe) is Granularity.MX:
        needs, supported = ("torch._scaled_grouped_mm's MXFP8 form, on a CUDA device of compute capability 10.x "
                            "(SM100)", lambda cc: hasattr(torch, "_scaled_grouped_mm") and cc[0] == 10)
    elif grouped:
        needs, supported = ("torch._scaled_grouped_mm, which takes row-wise and per-tensor scales on a CUDA device "
                            "of compute capability 9.x (SM90)", _grouped_supported(recipe))
    native = capability is not None and supported(capability)
    if requested == "emulated" or (device.type != "cuda" and (batched or requested == "auto")):
        return Lowering.EMULATED
    if native:
        return Lowering.SCALED_MM
    if device.type == "cuda":
        problem = (f"{what} has no native FP8 GEMM on {_device_name(device, capability)}: it needs {needs}; "
                   "emulating it would run many times slower than BF16")
        if requested == "auto" or batched:
            raise NoNativeGemm(f"{problem} (lowering='emulated' asks for the emulation anyway)")
        raise ValueError(f"lowering='scaled_mm': {problem}")
    if has_cpu_kernel(recipe) and not (grouped or gathered):
        return Lowering.SCALED_MM  # _scaled_mm's CPU kernel, asked for
    raise ValueError(f"lowering='scaled_mm' of {what} needs {needs}; the graph runs on {device}")


def _grouped_supported(recipe) -> Callable[[tuple[int, int]], bool]:
    tiled_by_blocks = _granularity(recipe) in (Granularity.BLOCK, Granularity.MX)
    return lambda cc: hasattr(torch, "_scaled_grouped_mm") and cc[0] == 9 and not tiled_by_blocks


def one_buffer(x_fp8: torch.Tensor) -> torch.Tensor:
    """``x_fp8`` itself, through an identity view that Inductor must realize: every GEMM (and custom op)
    that reads it then reads the one buffer. Apply it where the FP8 tensor is made, before its readers.

    Inductor's lowerings of ``_scaled_mm`` and of custom ops require exact strides of their inputs and,
    for an input not yet realized, make a copy per reader: q, k and v would each store the input they
    share, and a delayed cast would be stored once for its GEMM and once for ``transpose_fp8``.
    """
    return torch.as_strided(x_fp8, x_fp8.shape, x_fp8.stride())


def scalars_of(values: torch.Tensor) -> list[torch.Tensor]:
    """Each element of ``values`` as a one-element view (shape (1,)) of one buffer, for scaled GEMMs to read,
    each at a 16-byte aligned offset.

    Scales computed together stay one small kernel only if each GEMM reads its scale from that kernel's
    buffer: an indexing view (``values[i]``) becomes a kernel of its own per element under Inductor.
    ``as_strided`` makes the buffer real and each element an offset into it; shape (1,), because
    Inductor's ``_scaled_mm`` lowering cannot reshape a 0-d view with an offset. cuBLASLt reads a scale only
    from an address that is a multiple of 16 bytes (``fp8graph.gemm.library_rules``): the elements are laid
    out that far apart, the bytes between them unused.
    """
    spacing = max(1, SCALE_ALIGNMENT_BYTES // values.element_size())
    spaced = values.reshape(-1, 1).expand(-1, spacing).contiguous()  # (n, spacing): element i at i * spacing
    return [torch.as_strided(spaced, (1,), (1,), index * spacing) for index in range(values.numel())]


def scaled_gemm(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    lowering: Lowering,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a_fp8 / a_scale) @ (b_fp8 / b_scale)`` for a (M, K) and b (K, N).

    Scales are the quantization scales (``x_fp8 = x_hp * scale``); the
    dequantization factors ``1 / scale`` are applied to the fp32 result.
    """
    return scaled_gemm_by_inverse(a_fp8, a_scale.reciprocal(), b_fp8, b_scale.reciprocal(), out_dtype, lowering,
                                  use_fast_accum)


def scaled_gemm_by_inverse(
    a_fp8: torch.Tensor,
    inverse_scale_a: torch.Tensor,
    b_fp8: torch.Tensor,
    inverse_scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    lowering: Lowering,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """:func:`scaled_gemm` given the dequantization factors ``1 / scale``.

    For callers that hold several scales in one tensor: their reciprocals are then one small kernel
    (usually fused into the kernel that computes the scales), where a reciprocal per GEMM operand is a
    launch of its own for every scale that is a view into another buffer.
    """
    if lowering is Lowering.SCALED_MM:
        a_fp8, b_fp8 = pad_reduction_dim(a_fp8, b_fp8)
        # cuBLAS FP8 GEMMs take A row-major and B column-major (the "TN" layout).
        return torch._scaled_mm(
            row_major(a_fp8),
            column_major(b_fp8),
            scale_a=inverse_scale_a,
            scale_b=inverse_scale_b,
            out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
        )
    product_fp32 = torch.mm(a_fp8.to(torch.float32), b_fp8.to(torch.float32))
    return (product_fp32 * (inverse_scale_a * inverse_scale_b)).to(out_dtype)


def tiled_scaled_gemm(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    a_tiling: Tiling,
    b_fp8: torch.Tensor,
    b_scale: torch.Tensor,
    b_tiling: Tiling,
    out_dtype: torch.dtype,
    lowering: Lowering,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b^T`` for a (M, K) and b (N, K), both quantized tile by tile along K.

    Emulated: each operand is dequantized tile by tile in fp32, then multiplied.
    """
    if lowering is Lowering.SCALED_MM:
        return native_tiled_gemm(a_fp8, a_scale, a_tiling, b_fp8, b_scale, b_tiling, out_dtype, use_fast_accum)
    a_fp32 = reference_dequantize_tiles(a_fp8, a_scale, a_tiling)
    b_fp32 = reference_dequantize_tiles(b_fp8, b_scale, b_tiling)
    return torch.mm(a_fp32, b_fp32.t()).to(out_dtype)
