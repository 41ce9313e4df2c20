"""Which high-precision dtype the demo's baseline (and FP8's high-precision ops) run in.

On a CUDA GPU the baseline is BF16 autocast, what FP8 training is compared with
in practice. A CPU is another matter: one without BF16 matrix units (AVX2-only
x86, most AMD EPYCs before Zen 4) has oneDNN refuse BF16 and ATen fall back to a
reference GEMM, tens of times slower than fp32 (measured: the README's demo
section). So on CPU the demo times one matmul of
the demo's shape in both dtypes and runs both of its runs in BF16 autocast,
unless BF16 is over 2x slower than fp32 (emulated): then in plain fp32. The
comparison stays fair (both runs in the same precision, same weights and
batches); the choice and its measured reason are printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

__all__ = ["Baseline", "EMULATED_BF16_SLOWDOWN", "choose_baseline", "time_matmul"]

# Where BF16 matmuls are native they are faster than fp32 (4x in the probe here); emulated, 48x
# slower. A BF16 time within 2x of fp32's is timing noise on a small shape, or a CPU doing BF16
# at some cost, not emulation: the demo stays on BF16, the usual baseline, there.
EMULATED_BF16_SLOWDOWN = 2.0


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


def time_matmul(dtype: torch.dtype, m: int, k: int, n: int, repeats: int = 5) -> float:
    """Median seconds of one (m, k) @ (k, n) matmul in ``dtype`` on the CPU, after one warm-up."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    a @ b
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        timings.append(time.perf_counter() - start)
    return sorted(timings)[len(timings) // 2]


def choose_baseline(device: torch.device, requested: str, shape: tuple[int, int, int],
                    timer=time_matmul) -> Baseline:
    """``requested`` is "bf16", "fp32" or "auto"; ``shape`` the (m, k, n) of a typical projection."""
    if requested == "bf16":
        return Baseline(torch.bfloat16, "asked for (--precision bf16)")
    if requested == "fp32":
        return Baseline(torch.float32, "asked for (--precision fp32)")
    if requested != "auto":
        raise ValueError(f"--precision must be auto, bf16 or fp32, not {requested!r}")
    if device.type == "cuda":
        return Baseline(torch.bfloat16, "CUDA GPU: BF16 autocast, the usual baseline for FP8")
    m, k, n = shape
    bf16_s, fp32_s = timer(torch.bfloat16, m, k, n), timer(torch.float32, m, k, n)
    measured = (f"a {m}x{k}x{n} matmul took {1e3 * bf16_s:.2f} ms in BF16 and "
                f"{1e3 * fp32_s:.2f} ms in fp32 on this CPU")
    if bf16_s <= EMULATED_BF16_SLOWDOWN * fp32_s:
        return Baseline(torch.bfloat16, f"{measured}: BF16 autocast, the usual baseline for FP8")
    return Baseline(torch.float32, f"{measured}, over {EMULATED_BF16_SLOWDOWN:g}x slower in BF16: "
                                   "BF16 is emulated here, so both runs in fp32")
