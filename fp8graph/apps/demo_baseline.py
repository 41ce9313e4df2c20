"""Which high-precision dtype the demo's baseline (and FP8's high-precision ops) run in.

On a CUDA GPU the baseline is BF16 autocast, what FP8 training is compared with in practice. On a CPU it
is decided from what the CPU reports, never from a timing: BF16 autocast only where the CPU has AMX's
BF16 tile units and both ATen and oneDNN may use them; fp32 everywhere else. Without AMX a BF16 matmul
is emulated (AVX2-only x86) or run on AVX-512 BF16 dot products that can be slower than fp32's FMAs on
the demo's small shapes; a single timed matmul told these apart badly on a busy machine and once chose
BF16 where a step took many times fp32's (README, "The demo"). Both runs use the chosen precision, so
the comparison stays fair; the choice and the features behind it are printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib

import torch

__all__ = ["Baseline", "CpuFeatures", "choose_baseline", "cpu_features"]

# Flags of /proc/cpuinfo: the tile registers and their BF16 multiply (Intel Sapphire Rapids and later).
_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})


@dataclasses.dataclass(frozen=True)
class CpuFeatures:
    """What the CPU and the libraries report, as the choice reads it.

    ``flags``: the instruction-set flags the operating system lists (empty where it lists none);
    ``aten_capability``: ``torch.backends.cpu.get_cpu_capability()`` (``ATEN_CPU_CAPABILITY`` lowers it);
    ``onednn_max_isa``: ``ONEDNN_MAX_CPU_ISA`` when set (it keeps oneDNN from AMX when it names an older ISA).
    """

    flags: frozenset[str]
    aten_capability: str
    onednn_max_isa: str | None = None

    @property
    def amx_usable(self) -> bool:
        onednn_allows = self.onednn_max_isa is None or "AMX" in self.onednn_max_isa.upper() \
            or self.onednn_max_isa.upper() in ("ALL", "DEFAULT")
        return _AMX_FLAGS <= self.flags and self.aten_capability.startswith("AVX512") and onednn_allows

    def describe(self) -> str:
        amx = "AMX BF16" if _AMX_FLAGS <= self.flags else "no AMX"
        avx512_bf16 = ", AVX-512 BF16" if "avx512_bf16" in self.flags else ""
        limit = f", oneDNN limited to {self.onednn_max_isa}" if self.onednn_max_isa else ""
        return f"{amx}{avx512_bf16}, ATen {self.aten_capability}{limit}"


def cpu_features() -> CpuFeatures:
    """This machine's :class:`CpuFeatures` (Linux lists flags in /proc/cpuinfo; elsewhere none are read)."""
    flags: frozenset[str] = frozenset()
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.partition(":")[2].split())
                break
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return CpuFeatures(flags, torch.backends.cpu.get_cpu_capability(), onednn)


@dataclasses.dataclass(frozen=True)
class Baseline:
    """The high-precision dtype of both demo runs, and why it was chosen."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return {torch.bfloat16: "BF16", torch.float32: "FP32"}[self.dtype]

    def autocast(self, device: torch.device):
        """BF16 autocast (fp32 master weights), or nothing: fp32 is the modules' own dtype."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)


def choose_baseline(device: torch.device, requested: str, features: CpuFeatures | None = None) -> Baseline:
    """``requested`` is "bf16", "fp32" or "auto"; ``features`` default to this machine's (read only on a CPU)."""
    if requested == "bf16":
        return Baseline(torch.bfloat16, "asked for (--precision bf16)")
    if requested == "fp32":
        return Baseline(torch.float32, "asked for (--precision fp32)")
    if requested != "auto":
        raise ValueError(f"--precision must be auto, bf16 or fp32, not {requested!r}")
    if device.type == "cuda":
        return Baseline(torch.bfloat16, "CUDA GPU: BF16 autocast, the usual baseline for FP8")
    features = features if features is not None else cpu_features()
    if features.amx_usable:
        return Baseline(torch.bfloat16, f"this CPU has {features.describe()}: BF16 autocast on its AMX tiles, "
                                        "the usual baseline for FP8")
    return Baseline(torch.float32, f"this CPU has {features.describe()}: without AMX a BF16 matmul is emulated "
                                   "or slower than fp32 here, so both runs in fp32")
