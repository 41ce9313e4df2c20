"""Compile time of ``backend="fp8"`` against plain Inductor, cold and warm, on CPU.

    cold   a fresh process and an empty Inductor cache directory: first forward + backward
    warm   a fresh process reusing that cache directory (FX graph cache, AOTAutograd cache)

(``--smoke``: the first forward only, under ``no_grad``: the machinery at half the compiling, for the tests.)

The medians of ``--repeats`` cold and warm measurements are compared (a warm
start takes a few seconds, and one sample of it moves by a third from run to
run on a 2-core machine).

Each measurement runs in its own process so nothing stays in memory between
them (``bench.forked``: a fork of a server that imported torch, transformers
and fp8graph; imports are never timed). Full mode: the tiny Llama (the
figure the README reports, target <= 1.3x); ``--deep``: 12 layers of it at
sequence 64, where the cost of compiling every layer shows (target: ``fp8``
<= 1.0x ``inductor`` cold and warm); ``--smoke``: the toy MLP, for the
tests, or with ``--deep`` 2 layers at sequence 16.

Backends (``--backends``):

    inductor              plain ``torch.compile`` of the whole model
    fp8                   ``fp8graph.compile``: each repeated layer compiled once (its default)
    fp8 whole             ``fp8graph.compile(regions=None)``: the whole model as one graph
    inductor per-block    plain ``torch.compile`` of each decoder layer (``layer.compile()``), the rest
                          eager: the regional compilation torchtitan applies, so the gain of compiling
                          per block and the FP8 overhead that remains are told apart

Llama calls pass ``use_cache=False``: the KV cache a training forward builds
otherwise makes every layer's guards differ (one compile per layer).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import torch

from . import forked
from .cli import positive
from .timing import environment, markdown_table, median, report, title

BACKENDS = ("inductor", "fp8")
LLAMA_ONLY = ("fp8 whole", "inductor per-block")
DEEP_LAYERS, DEEP_SEQUENCE = 12, 64
# Two layers: the second reuses the first's region, which is what the smoke checks.
SMOKE_DEEP_LAYERS, SMOKE_DEEP_SEQUENCE = 2, 16


def _compile(model, backend: str):
    import fp8graph

    if backend == "inductor per-block":
        for layer in model.model.layers:  # in place: state_dict keys unchanged; embedding, norm, head eager
            layer.compile()
        return model
    if backend == "fp8 whole":
        return fp8graph.compile(model, regions=None)
    return fp8graph.compile(model) if backend == "fp8" else torch.compile(model)


def _first_step_seconds(family: str, config: str, backend: str, layers: int | None = None,
                        sequence: int = 16, backward: bool = True) -> float:
    """Runs in the child process: compile time of the first training step, or of the first inference forward
    without ``backward``."""
    from fp8graph.models import build

    model = build(family, config, **({} if layers is None else {"num_hidden_layers": layers}))
    start = time.perf_counter()
    compiled = _compile(model, backend)
    with torch.set_grad_enabled(backward):
        if family == "llama":
            tokens = torch.randint(0, 250, (2, sequence))
            loss = compiled(tokens, labels=tokens, use_cache=False).loss
        else:
            loss = compiled(torch.randn(32, 64)).sum()
    if backward:
        loss.backward()
    return time.perf_counter() - start


def _child(results, cache_dir: str, arguments: tuple) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read by Inductor at each use, not at import
    results.put(_first_step_seconds(*arguments))


def _measure_in_child(family: str, config: str, backend: str, cache_dir: str, layers: int | None = None,
                      sequence: int = 16, backward: bool = True) -> float:
    context = forked.context()
    results = context.SimpleQueue()
    child = context.Process(target=_child,
                            args=(results, cache_dir, (family, config, backend, layers, sequence, backward)))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"measuring {backend} on {family} {config}: the child process exited with code "
                           f"{child.exitcode}")
    return results.get()


def run(args: argparse.Namespace) -> dict:
    family, config = ("mlp", "tiny") if args.smoke and not args.deep else ("llama", "tiny")
    layers, sequence = (None, 16)
    if args.deep:
        layers, sequence = (SMOKE_DEEP_LAYERS, SMOKE_DEEP_SEQUENCE) if args.smoke else (DEEP_LAYERS, DEEP_SEQUENCE)
    backends = args.backends or (BACKENDS if args.smoke else (*BACKENDS, *LLAMA_ONLY))
    if family != "llama" and set(backends) & set(LLAMA_ONLY):
        raise SystemExit(f"{LLAMA_ONLY} compile a Llama's decoder layers; the smoke model has none")
    repeats = 1 if args.smoke else args.repeats
    timings = {backend: {"cold_timings_s": [], "warm_timings_s": []} for backend in backends}
    # Backends take turns, so a slow spell of the machine does not fall on one of them only.
    for _ in range(repeats):
        for backend in backends:
            with tempfile.TemporaryDirectory() as cache_dir:
                for phase in ("cold_timings_s", "warm_timings_s"):
                    timings[backend][phase].append(
                        _measure_in_child(family, config, backend, cache_dir, layers, sequence, not args.smoke))
    rows = [{"backend": backend, **timings[backend],
             "compile_cold_s": median(timings[backend]["cold_timings_s"]),
             "compile_warm_s": median(timings[backend]["warm_timings_s"])} for backend in backends]
    for row in rows:  # against plain Inductor on the whole model, the first backend
        row["cold_vs_inductor"] = row["compile_cold_s"] / rows[0]["compile_cold_s"]
        row["warm_vs_inductor"] = row["compile_warm_s"] / rows[0]["compile_warm_s"]
    model = f"{family} {config}" + (f", {layers} layers, sequence {sequence}" if layers else "")
    step = "first forward" if args.smoke else "first forward + backward"
    result = {"workload": "compile_time", "smoke": args.smoke, "step": step, "model": model, "layers": layers,
              "sequence": sequence,
              "environment": environment(torch.device("cpu")), "cpu_threads": torch.get_num_threads(),
              "rows": rows}
    return report(result, args.out, "compile", summary)


def summary(result: dict) -> str:
    rows = [[r["backend"], f"{r['compile_cold_s']:.1f}", f"{r['cold_vs_inductor']:.2f}x",
             f"{r['compile_warm_s']:.1f}", f"{r['warm_vs_inductor']:.2f}x"] for r in result["rows"]]
    columns = ["backend", "cold s", "vs inductor", "warm s", "vs inductor"]
    step = result.get("step", "first forward + backward")  # results written before the smoke's forward only
    return "\n".join([title(f"compile time, {result['model']}, {step}", result), "", *markdown_table(columns, rows)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="one repeat of the first forward only: the toy MLP, or with --deep a 2-layer Llama "
                             "(for the tests)")
    parser.add_argument("--repeats", type=positive(int), default=3, help="cold and warm measurements per backend")
    parser.add_argument("--deep", action="store_true",
                        help=f"{DEEP_LAYERS} layers of the tiny Llama at sequence {DEEP_SEQUENCE}")
    parser.add_argument("--backends", nargs="+", choices=(*BACKENDS, *LLAMA_ONLY),
                        help="the first is the reference (default: all; the smoke run: inductor and fp8)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
