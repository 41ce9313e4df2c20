"""The rates a GPU runs fp8graph's kernels at: what :mod:`fp8graph.costs.sites` times a site with.

The H100's rates are the cost model's (``python -m bench model``, docs/cost-model.md): fitted to this
project's H100 runs and checked against them by ``bench model calibrate``; its grouped GEMM rate at large
groups is an H200 run's (the same tensor cores). The H200's and B200's rates are the H100's scaled by the
ratio of the data-sheet figures (HBM bandwidth for copies and Inductor's kernels, dense tensor-core FLOP/s for
GEMMs), so they say what the data sheet predicts, not what was measured; but for the H200's rate of Inductor's
kernels, which its runs measured below the data sheet's (fitted by ``bench model calibrate``'s MoE section).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["B200", "GPU", "GPUS", "GROUPED_RATE_TOKENS", "H100", "H200", "gpu", "grouped_rate", "running_gpu"]

# The tokens a group at which each GPU's two grouped GEMM rates were timed: a grouped GEMM's rate grows with its
# groups' rows (more of each weight's tiles busy), and between these it is interpolated in log2 of the rows.
GROUPED_RATE_TOKENS = (512, 2048)


def grouped_rate(small: float, large: float, tokens_per_group: float | None) -> float:
    """A grouped GEMM's rate at ``tokens_per_group`` rows a group on average, from its rates at the two timed
    sizes (:data:`GROUPED_RATE_TOKENS`): interpolated in log2 of the rows between them, held beyond them (no
    run timed smaller or larger groups); ``small`` where the rows are unknown."""
    if not tokens_per_group:
        return small
    low, high = (math.log2(tokens) for tokens in GROUPED_RATE_TOKENS)
    position = min(max((math.log2(tokens_per_group) - low) / (high - low), 0.0), 1.0)
    return small + (large - small) * position


@dataclasses.dataclass(frozen=True)
class GPU:
    """Rates in bytes/s and FLOP/s; floors in microseconds.

    ``fp8_gemm_flops`` is keyed by a recipe's ``kind`` (:data:`fp8graph.recipes.scaling.PRESETS`); a kind
    missing there has no FP8 GEMM on this GPU and is emulated (dequantized, then a BF16 GEMM).
    """

    name: str
    copy_bandwidth: float  # a device-to-device copy
    triton_bandwidth: float  # what Inductor's generated kernels reach
    launch_floor_us: float  # the shortest kernel: launch latency and tail
    gemm_floor_us: float
    bf16_flops: float
    fp8_gemm_flops: dict[str, float]
    grouped_bf16_flops: float  # torch._grouped_mm (a MoE's expert GEMMs), at GROUPED_RATE_TOKENS[0] tokens a group
    grouped_fp8_flops: float  # torch._scaled_grouped_mm, likewise
    grouped_bf16_flops_large: float  # at GROUPED_RATE_TOKENS[1] tokens a group
    grouped_fp8_flops_large: float
    # Inductor's FP8 casts (amax, saturation, 1-byte stores) at this fraction of triton_bandwidth: the H100's
    # decoder profiles fit one rate for every kernel (1.0); the H200's MoE profiles do not (below).
    cast_fraction: float = 1.0
    # fp8graph's kernels that store tiles transposed (fp8graph::transpose_fp8, the ops that cast and place a grouped
    # GEMM's operand) at this fraction of copy_bandwidth: the H200 ran transpose_bytes_kernel at 3.0 TB/s of its
    # operand bytes, 0.70 of its modelled copy bandwidth (bench/results/moe-2026-11-27T052314Z.json and
    # moe-2026-11-27T132818Z.json: 1.10-1.15 ms for 4 calls moving 3.38 GB); the placing casts, not yet run on a
    # GPU, are assumed to run as it does. No other GPU has run them: the same fraction.
    transposed_store_fraction: float = 0.70

    def grouped_flops(self, fp8: bool, tokens_per_group: float | None) -> float:
        """This GPU's rate of a grouped GEMM whose groups hold ``tokens_per_group`` rows on average
        (:func:`grouped_rate`)."""
        if fp8:
            return grouped_rate(self.grouped_fp8_flops, self.grouped_fp8_flops_large, tokens_per_group)
        return grouped_rate(self.grouped_bf16_flops, self.grouped_bf16_flops_large, tokens_per_group)

    def scaled(self, name: str, bandwidth: float, flops: float) -> "GPU":
        """This GPU with every bandwidth times ``bandwidth`` and every FLOP rate times ``flops``."""
        return dataclasses.replace(
            self, name=name, copy_bandwidth=self.copy_bandwidth * bandwidth,
            triton_bandwidth=self.triton_bandwidth * bandwidth, bf16_flops=self.bf16_flops * flops,
            fp8_gemm_flops={kind: rate * flops for kind, rate in self.fp8_gemm_flops.items()},
            grouped_bf16_flops=self.grouped_bf16_flops * flops, grouped_fp8_flops=self.grouped_fp8_flops * flops,
            grouped_bf16_flops_large=self.grouped_bf16_flops_large * flops,
            grouped_fp8_flops_large=self.grouped_fp8_flops_large * flops)


H100 = GPU(
    name="H100",
    copy_bandwidth=3.0e12,  # device-to-device copy of 16384x8192 BF16: 2947-2968 GB/s
    # Inductor's kernels in the H100's 4-layer decoder profiles, the model's bytes over their time: 1.85-2.35 TB/s
    triton_bandwidth=2.2e12,
    launch_floor_us=3.0,
    gemm_floor_us=5.0,
    bf16_flops=740e12,  # cuBLAS BF16: 763 TF/s in the decoder profile, 693-721 in the linear bench
    # FP8 tensorwise 1404 TF/s in the decoder profile; a kernel breakdown of bench linear's 16384x4096x14336:
    # row-wise GEMMs at 1400 TF/s, 1x128 / 128x128 block GEMMs at 1200. The H100 has no MXFP8 GEMM.
    fp8_gemm_flops={"current": 1350e12, "delayed": 1350e12, "rowwise": 1350e12, "block": 1200e12},
    # At 512 tokens a group, torchao's published H100 timings (pytorch/ao PR #2490) of Llama-4 Scout's 16 experts:
    # BF16 524 TF/s, FP8 row-wise 776 TF/s. At 2048, this project's H200 run of Qwen3-30B-A3B's block (the same
    # GH100 tensor cores and clocks; bench/results/moe-2026-11-27T052314Z.json): its six grouped GEMMs, 7.42
    # TFLOP a step, in 9.69 ms (BF16) and 7.42 ms (FP8 row-wise scales).
    grouped_bf16_flops=524e12,
    grouped_fp8_flops=776e12,
    grouped_bf16_flops_large=766e12,
    grouped_fp8_flops_large=1000e12,
)

# The same GH100 tensor cores with HBM3e: 4.8 TB/s against the H100 SXM's 3.35. Inductor's kernels do not follow
# the bandwidth: fitted to the Triton time of the H200's profiles of the MoE block (bench/results/gpu-runs.json:
# its runs at 4b51eda and ec8f139, the least squares of the log errors of 9 contestant steps; docs/cost-model.md),
# they ran at 2.0 TB/s on the cost model's bytes, below the H100's 2.2, and its FP8 casts at 0.6 of that.
H200 = dataclasses.replace(H100.scaled("H200", bandwidth=4.8 / 3.35, flops=1.0), triton_bandwidth=2.0e12,
                           cast_fraction=0.6)

# Dense tensor-core FLOP/s, B200 over H100 SXM data sheets: BF16 2.25 / 0.989 PFLOP/s, FP8 4.5 / 1.979;
# HBM3e 8 TB/s against 3.35. Blackwell runs MXFP8 (1x32 E8M0 scales) at the FP8 rate.
B200 = dataclasses.replace(
    H100.scaled("B200", bandwidth=8.0 / 3.35, flops=2.25 / 0.989),
    fp8_gemm_flops={kind: rate * 4.5 / 1.979 for kind, rate in
                    {**H100.fp8_gemm_flops, "mxfp8": H100.fp8_gemm_flops["current"]}.items()},
    grouped_fp8_flops=H100.grouped_fp8_flops * 4.5 / 1.979,
    grouped_fp8_flops_large=H100.grouped_fp8_flops_large * 4.5 / 1.979)

GPUS = {gpu.name: gpu for gpu in (H100, H200, B200)}


def gpu(name: "str | GPU") -> GPU:
    """A GPU by name (``"H100"``, ``"H200"``, ``"B200"``, any case), or ``name`` itself when it is a :class:`GPU`.

    Raises:
        ValueError: no GPU of that name.
    """
    if isinstance(name, GPU):
        return name
    found = GPUS.get(str(name).upper())
    if found is None:
        raise ValueError(f"fp8graph.costs: no rates for GPU {name!r}; known: {sorted(GPUS)} (or pass a GPU)")
    return found


def running_gpu(device=None) -> GPU:
    """The rates of the CUDA GPU this process runs on (``device``, default the current one): the known GPU whose
    name its device name holds ("NVIDIA H200" -> H200, "NVIDIA GH200 480GB" -> H200), else the H100's (another
    Hopper or Ada GPU, or no CUDA device: the rates the model was fitted to first). Whichever it took, the
    policies and reports that use it name it."""
    import torch

    if not torch.cuda.is_available():
        return H100
    name = torch.cuda.get_device_name(device).upper()
    return next((rates for known, rates in GPUS.items() if known in name), H100)
