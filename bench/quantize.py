"""Quantize kernels per recipe: achieved bandwidth against a device-to-device copy.

    bandwidth = (bytes read + bytes written) / time     read: the BF16 tensor; written: FP8 values + scales

Full mode: a 16384x8192 BF16 tensor on CUDA. Per-tensor current and delayed
casts as fp8graph's linear emits them, compiled by Inductor: one layout, both
layouts (the tensor and its transpose, as the GEMMs read them), and fused
after the RMSNorm that produces it, timed against the RMSNorm alone; every
tiling (row-wise, 1x128, 128x128, MX 1x32) both ways, Inductor's code for
``fp8graph.numerics.tiles.reference_quantize_tiles`` and
fp8graph's Triton kernel (``fp8graph.kernels.quantize_tiles``); and for the
tilings the linear quantizes in both layouts, the two layouts from one call
(``quantize_tiles_and_transpose`` for 1x128 and 128x128, against Inductor compiling
both casts together for every tiling).
Each row says which of them fp8graph runs on CUDA (``kernel_quantizes``), and
the targets judge those rows. ``--smoke`` runs a small tensor on CPU with
``aot_eager`` so the script is exercised by the tests (its timings mean nothing).

What the formula allows: a copy moves 4 bytes an element (2 read, 2
written), a one-layout quantize counts 3 (2 read, 1 written), a two-layout one
4 (2 read, 2 written). One pass over the tensor can reach the copy's rate.
Per-tensor current scaling needs the whole tensor's amax before its first
cast, so on a tensor larger than the cache it reads every element twice: 5
bytes moved for the 3 counted, at most 3/5 = 60% of the copy. Delayed scaling
(scale known before the cast, amax recorded in the same pass) and the tiled
recipes (each tile's amax before its cast) need one pass.
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import torch

from fp8graph import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling
from fp8graph.numerics.delayed_scaling import delayed_cast
from fp8graph.numerics.formats import Role
from fp8graph.kernels.transpose_fp8 import transpose_fp8
from fp8graph.kernels.quantize_tiles import (kernel_quantizes, run_quantize_tiles_and_transpose_kernel,
                                             run_quantize_tiles_kernel, triton_available)
from fp8graph.numerics.quantize import quantize_current
from fp8graph.numerics.tiles import reference_quantize_tiles, reference_quantize_tiles_and_transpose

from .cli import positive, require_cuda
from .timing import attempt, environment, failed, markdown_table, median, report, time_ms, title, write_partial

FULL_SHAPE = (16384, 8192)
SMOKE_SHAPE = (256, 512)
# The tilings, named as the targets name them: each recipe's activation tiles, and block scaling's weight tiles.
TILINGS = {"rowwise": Float8RowwiseScaling().tiling(Role.INPUT), "1x128": Float8BlockScaling().tiling(Role.INPUT),
           "128x128": Float8BlockScaling().tiling(Role.WEIGHT), "mxfp8 1x32": MXFP8BlockScaling().tiling(Role.INPUT)}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm (transformers' formula): the producer of most linear inputs in a decoder layer."""
    x_fp32 = x.float()
    return weight * (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def _per_tensor_contestants(compiler: str, device: torch.device, columns: int) -> list[dict]:
    """The per-tensor casts as fp8graph's linear emits them: one layout or both (the GEMMs read the
    input and grad_output transposed too), alone or after the RMSNorm that produces the tensor."""
    e4m3 = torch.float8_e4m3fn
    history, scale = torch.ones(1024, device=device), torch.ones((), device=device)
    norm_weight = torch.ones(columns, device=device, dtype=torch.bfloat16)

    def current(x):
        return quantize_current(x, e4m3)

    def delayed(x):
        # Delayed scaling knows its scale before the cast, so the cast and the amax it records
        # can share one read (current scaling reads twice: amax, then cast).
        return delayed_cast(x, history, scale, e4m3, 0, "max", True)

    def both_layouts(cast, transposed_by):
        def cast_both(x):
            x_fp8, *rest = cast(x)
            if transposed_by == "fp8graph::transpose_fp8":
                return x_fp8, transpose_fp8(x_fp8), *rest
            return x_fp8, x_fp8.t().contiguous(), *rest  # Inductor recomputes it from x, beside the cast
        return cast_both

    def after_rms_norm(cast):
        return lambda x: cast(_rms_norm(x, norm_weight))

    # (name, scaling, layouts, producer, whether fp8graph emits it on CUDA, function). Both ways of writing the
    # transposed copy are timed for both scalings, so a GPU run can confirm or reverse fp8graph's choice
    # (fp8graph.targets.linear_tensorwise: Inductor's for current scaling, the FP8 transpose op for delayed).
    rows = [("rmsnorm alone (BF16 output, the reference)", None, 1, "rmsnorm", None,
             lambda x: _rms_norm(x, norm_weight))]
    for scaling, cast in (("current", current), ("delayed", delayed)):
        fp8graph_transposes = "fp8graph::transpose_fp8" if scaling == "delayed" else "inductor"
        rows.append((f"{scaling} (per tensor)", scaling, 1, None, True, cast))
        for transposed_by in ("inductor", "fp8graph::transpose_fp8"):
            rows.append((f"{scaling} (per tensor), both layouts, transposed by {transposed_by}", scaling, 2, None,
                         transposed_by == fp8graph_transposes, both_layouts(cast, transposed_by)))
        rows += [(f"rmsnorm + {scaling} cast", scaling, 1, "rmsnorm", True, after_rms_norm(cast)),
                 (f"rmsnorm + {scaling} cast, both layouts", scaling, 2, "rmsnorm", True,
                  after_rms_norm(both_layouts(cast, fp8graph_transposes)))]
    return [{"contestant": name, "tiling": "tensor", "scaling": scaling, "code": compiler, "layouts": layouts,
             "producer": producer, "fp8graph_uses": uses,  # None: the reference
             "fn": torch.compile(fn, backend=compiler)}
            for name, scaling, layouts, producer, uses, fn in rows]


def _contestants(compiler: str, device: torch.device, columns: int) -> list[dict]:
    """Each contestant: name, the function, its tiling, code, layouts, and whether fp8graph runs it on CUDA."""
    contestants = _per_tensor_contestants(compiler, device, columns)
    with_kernel = device.type == "cuda" and triton_available()
    for name, tiling in TILINGS.items():
        uses_kernel = kernel_quantizes(tiling)
        for count in (1, 2):
            both = count == 2
            label = f"{name}{', both layouts' if both else ''}"
            inductor_fn = reference_quantize_tiles_and_transpose if both else reference_quantize_tiles
            contestants.append({"contestant": f"{label} ({compiler})", "tiling": name, "code": compiler,
                                "layouts": count, "fp8graph_uses": not uses_kernel,
                                "fn": torch.compile(functools.partial(inductor_fn, tiling=tiling), backend=compiler)})
            if with_kernel and (not both or tiling.cols == 128):  # the kernel writes both layouts of 128-wide tiles
                kernel_fn = run_quantize_tiles_and_transpose_kernel if both else run_quantize_tiles_kernel
                contestants.append({"contestant": f"{label} (fp8graph Triton kernel)", "tiling": name,
                                    "code": "fp8graph kernel", "layouts": count, "fp8graph_uses": uses_kernel,
                                    "fn": functools.partial(kernel_fn, tiling=tiling)})
    return contestants


def _bytes_moved(x: torch.Tensor, outputs) -> int:
    return x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in outputs)


def run(args: argparse.Namespace) -> dict:
    require_cuda("quantize", args)
    device = torch.device("cpu" if args.smoke else "cuda")
    compiler = "aot_eager" if args.smoke else "inductor"
    warmup, repeats = (1, 3) if args.smoke else (10, args.repeats)
    rows_count, columns = SMOKE_SHAPE if args.smoke else FULL_SHAPE
    x = torch.randn(rows_count, columns, device=device, dtype=torch.bfloat16)
    copy_target = torch.empty_like(x)
    copy_timings = time_ms(lambda: copy_target.copy_(x), device, warmup, repeats)
    copy_gbps = 2 * x.numel() * x.element_size() / median(copy_timings) / 1e6
    rows = [{"contestant": "device-to-device copy", "timings_ms": copy_timings,
             "median_ms": median(copy_timings), "gb_per_s": copy_gbps, "fraction_of_copy": 1.0}]
    result = {"workload": "quantize", "smoke": args.smoke, "compiler": compiler, "shape": [rows_count, columns],
              "dtype": "bfloat16", "environment": environment(device), "warmup": warmup, "repeats": repeats,
              "rows": rows}
    for contestant in _contestants(compiler, device, columns):
        quantize = contestant.pop("fn")

        def measure(quantize=quantize):
            outputs = quantize(x)
            timings = time_ms(lambda: quantize(x), device, warmup, repeats)
            gbps = _bytes_moved(x, outputs) / median(timings) / 1e6
            return {"timings_ms": timings, "median_ms": median(timings), "gb_per_s": gbps,
                    "fraction_of_copy": gbps / copy_gbps}
        rows.append(attempt(contestant, measure))
        write_partial(result, args.out, "quantize")
    torch._dynamo.reset()
    return report(result, args.out, "quantize", summary)


def summary(result: dict) -> str:
    rows = [[r["contestant"], f"{r['median_ms']:.3f}", f"{r['gb_per_s']:.0f}", f"{r['fraction_of_copy']:.0%}",
             _used(r)] for r in result["rows"] if "error" not in r]
    columns = ["contestant", "median ms", "GB/s", "of copy bandwidth", "fp8graph runs it on CUDA"]
    return "\n".join([title(f"quantize {result['shape'][0]}x{result['shape'][1]} BF16", result), "",
                      *markdown_table(columns, rows), *failed(result["rows"])])


def _used(row: dict) -> str:
    if row.get("fp8graph_uses") is None:  # the copy, a reference, or a result stored before rows said so
        return "-"
    return "yes" if row["fp8graph_uses"] else "no"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="a small tensor on CPU, for the tests")
    parser.add_argument("--repeats", type=positive(int), default=100)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
