"""Quantize kernels per recipe: achieved bandwidth against a device-to-device copy.

    bandwidth = (bytes read + bytes written) / time     read: the BF16 tensor; written: FP8 values + scales

Full mode: a 16384x8192 BF16 tensor on CUDA; each recipe's quantize compiled
by Inductor, and for the tiled recipes also fp8graph's Triton kernel
(``fp8graph::quantize_tiles``), against a copy of the same tensor timed in the
same run. ``--smoke`` runs a small tensor on CPU with ``aot_eager`` so the
script is exercised by the tests (its timings mean nothing).

What the formula allows: a copy moves 4 bytes an element (2 read, 2
written), a quantize counts 3 (2 read, 1 written). One pass over the tensor
can reach the copy's rate. Per-tensor current scaling needs the whole
tensor's amax before its first cast, so on a tensor larger than the cache it
reads every element twice: 5 bytes moved for the 3 counted, at most 3/5 = 60%
of the copy. Delayed scaling (scale known before the cast, amax recorded in
the same pass) and the tiled recipes (each tile's amax before its cast) need
one pass. Inside a model the first pass can often fuse into the producer.
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import torch

from fp8graph import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling
from fp8graph.delayed_scaling import delayed_cast
from fp8graph.formats import Role
from fp8graph.kernels.quantize_tiles import quantize_tiles_triton, triton_available
from fp8graph.quantize import quantize_current
from fp8graph.tiles import quantize_tiled

from .timing import attempt, environment, failed, markdown_table, median, report, time_ms, title

FULL_SHAPE = (16384, 8192)
SMOKE_SHAPE = (256, 512)
TILED = {"rowwise": Float8RowwiseScaling(), "block 1x128": Float8BlockScaling(),
         "mxfp8 1x32": MXFP8BlockScaling()}


def _contestants(compiler: str, device: torch.device) -> dict:
    e4m3 = torch.float8_e4m3fn
    contestants = {"current (per tensor)": torch.compile(
        functools.partial(quantize_current, fp8_dtype=e4m3), backend=compiler)}
    # Delayed scaling knows its scale before the cast, so the cast and the amax it
    # records share one read (current scaling reads twice: amax, then cast).
    history, scale = torch.ones(1024, device=device), torch.ones((), device=device)
    contestants["delayed (per tensor)"] = torch.compile(functools.partial(
        delayed_cast, history=history, scale=scale, fp8_dtype=e4m3, margin=0, algo="max", update=True),
        backend=compiler)
    for name, recipe in TILED.items():
        tiling = recipe.tiling(Role.INPUT)
        contestants[f"{name} ({compiler})"] = torch.compile(
            functools.partial(quantize_tiled, tiling=tiling), backend=compiler)
        if device.type == "cuda" and triton_available():
            contestants[f"{name} (fp8graph Triton kernel)"] = functools.partial(quantize_tiles_triton,
                                                                                  tiling=tiling)
    contestants["block 128x128 weight tiles" + f" ({compiler})"] = torch.compile(
        functools.partial(quantize_tiled, tiling=Float8BlockScaling().tiling(Role.WEIGHT)), backend=compiler)
    return contestants


def _bytes_moved(x: torch.Tensor, outputs) -> int:
    return x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in outputs)


def run(args: argparse.Namespace) -> dict:
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
    for name, quantize in _contestants(compiler, device).items():
        def measure(quantize=quantize):
            outputs = quantize(x)
            timings = time_ms(lambda: quantize(x), device, warmup, repeats)
            gbps = _bytes_moved(x, outputs) / median(timings) / 1e6
            return {"timings_ms": timings, "median_ms": median(timings), "gb_per_s": gbps,
                    "fraction_of_copy": gbps / copy_gbps}
        rows.append(attempt({"contestant": name}, measure))
    torch._dynamo.reset()
    result = {"workload": "quantize", "smoke": args.smoke, "compiler": compiler, "shape": [rows_count, columns],
              "dtype": "bfloat16", "environment": environment(device), "warmup": warmup, "repeats": repeats,
              "rows": rows}
    return report(result, args.out, "quantize", summary)


def summary(result: dict) -> str:
    rows = [[r["contestant"], f"{r['median_ms']:.3f}", f"{r['gb_per_s']:.0f}", f"{r['fraction_of_copy']:.0%}"]
            for r in result["rows"] if "error" not in r]
    columns = ["contestant", "median ms", "GB/s", "of copy bandwidth"]
    return "\n".join([title(f"quantize {result['shape'][0]}x{result['shape'][1]} BF16", result), "",
                      *markdown_table(columns, rows), *failed(result["rows"])])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="a small tensor on CPU, for the tests")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
