"""Where a step's time goes: kernel time by category, and the top kernels, from ``torch.profiler``.

    gemm fp8        cuBLAS FP8 GEMMs (``nvjet_smXX_q...``: the type letters of an E4M3 operand), CUTLASS e4m3
    gemm other      other GEMMs (BF16 ``nvjet_smXX_t...``, ``gemm``, ``cutlass``, ``xmma``)
    attention       SDPA's kernels: cuDNN, flash, memory-efficient (cuDNN's small helper kernels,
                    ``cudnn::fusion::*``, count as other, as in the stored H100 profiles)
    triton          Triton's kernels: Inductor's (``triton_*``), fp8graph's own (its custom ops': the quantize
                    kernels, ``transpose_bytes_kernel``, ...), torchao's (``_triton_*``). Profiles written
                    before 2026-11-27 count fp8graph's other than the quantize kernels and torchao's as other
                    (:func:`recategorized` moves them from their top kernels).
    memcpy/memset   copies and fills
    other           everything else (ATen's own elementwise kernels, ...)

On CUDA the categories sum GPU kernel times; off CUDA (the smoke runs) they
sum the CPU time of ATen ops, named alike (``aten::mm`` is a GEMM), which
only exercises the code. The name rules follow the H100's kernel names
(``bench/results/2026-11-23-h100/profile-*.json``); a kernel no rule knows is
"other", so a new GEMM kernel would show there rather than vanish.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

__all__ = ["CATEGORIES", "category", "profile_steps", "recategorized"]

CATEGORIES = ("gemm fp8", "gemm other", "attention", "triton", "memcpy/memset", "other")
_FP8_QUANTIZE_KERNELS = ("quantize_row_tiles_kernel", "quantize_rows_kernel", "quantize_blocks_kernel")
# The Triton kernels of custom ops: fp8graph's (fp8graph/kernels/_*_triton.py) and torchao's MoE kernels.
_CUSTOM_TRITON_KERNELS = (*_FP8_QUANTIZE_KERNELS, "transpose_bytes_kernel", "record_delayed_kernel",
                          "quantize_group_columns_placed_kernel", "gathered_gemv_kernel", "_triton_")
_CUSTOM_AS_TRITON = "custom_kernels_as_triton"  # a profile's key: written since custom ops' kernels count as Triton
_TOP_KERNELS = 25


def category(kernel: str) -> str:
    """The category of a GPU kernel (or, off CUDA, an ATen op) by its name."""
    name = kernel.lower()
    if name.startswith("triton") or name.startswith(_CUSTOM_TRITON_KERNELS):
        return "triton"
    if any(part in name for part in ("sdpa", "flash", "fmha", "attention")):
        return "attention"
    if re.match(r"nvjet_sm\d+_[a-z]*q", name) or "e4m3" in name or name == "aten::_scaled_mm":
        return "gemm fp8"
    if any(part in name for part in ("nvjet", "gemm", "cutlass", "xmma")) or name in ("aten::mm", "aten::addmm",
                                                                                          "aten::bmm"):
        return "gemm other"
    if "memcpy" in name or "memset" in name or name in ("aten::copy_", "aten::fill_", "aten::zero_"):
        return "memcpy/memset"
    return "other"


def profile_steps(step: Callable[[], object], device: torch.device, steps: int = 3) -> dict:
    """Run ``step`` ``steps`` times under the profiler; milliseconds per step by category, and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        if on_cuda:
            torch.cuda.synchronize(device)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    kernels = []
    for event in profiler.key_averages():
        if on_cuda:
            if event.device_type != DeviceType.CUDA:
                continue
            microseconds = event.self_device_time_total
        else:
            if not event.key.startswith("aten::"):
                continue
            microseconds = event.self_cpu_time_total
        milliseconds = microseconds / 1e3 / steps
        by_category[category(event.key)] += milliseconds
        kernels.append([event.key[:160], milliseconds, event.count / steps])
    kernels.sort(key=lambda kernel: -kernel[1])
    return {"steps": steps, "timed": "GPU kernels" if on_cuda else "CPU time of ATen ops (smoke)",
            "by_category_ms": by_category, "total_ms": sum(by_category.values()), "top": kernels[:_TOP_KERNELS],
            _CUSTOM_AS_TRITON: True}


def recategorized(profile: dict) -> dict[str, float]:
    """A profile's ms by category as :func:`category` tells them today: an older profile counted the custom ops'
    Triton kernels other than fp8graph's quantize kernels as other; those of its top kernels move to Triton (a
    smaller one stays where it was counted)."""
    by_category = dict(profile["by_category_ms"])
    if not profile.get(_CUSTOM_AS_TRITON):
        moved = sum(ms for name, ms, _ in profile.get("top", ()) if category(name) == "triton"
                    and not name.lower().startswith(("triton", *_FP8_QUANTIZE_KERNELS)))
        by_category["other"] -= moved
        by_category["triton"] = by_category.get("triton", 0.0) + moved
    return by_category
