"""Compile time of ``backend="fp8"`` against plain Inductor, cold and warm, on CPU.

    cold   a fresh process and an empty Inductor cache directory: first forward + backward
    warm   a fresh process reusing that cache directory (FX graph cache, AOTAutograd cache)

The medians of ``--repeats`` cold and warm measurements are compared (a warm
start takes a few seconds, and one sample of it moves by a third from run to
run on a 2-core machine).

Each measurement runs in its own process so nothing stays in memory between
them. Full mode: the tiny Llama (the figure the README reports, target <= 1.3x);
``--deep``: 12 layers of it at sequence 64, where the cost of compiling every
layer shows; ``--smoke``: the toy MLP, for the tests.

Backends (``--backends``):

    inductor              plain ``torch.compile`` of the whole model
    fp8                   ``fp8graph.compile`` of the whole model
    inductor per-block    plain ``torch.compile`` of each decoder layer (``layer.compile()``), the rest
                          eager: the regional compilation torchtitan applies, which compiles a
                          repeated layer once and reuses it for every instance
    fp8 per-block         the same with fp8graph's backend on each layer, default policy (a measurement
                          of what regional compilation gains for the FP8 graphs: ``fp8graph.compile``
                          does not compile that way yet, and this form has no delayed state or stats)

Llama calls pass ``use_cache=False``: the KV cache a training forward builds
otherwise makes every layer's guards differ (one compile per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

from .timing import environment, markdown_table, median, report, title

BACKENDS = ("inductor", "fp8")
PER_BLOCK = ("inductor per-block", "fp8 per-block")
DEEP_LAYERS, DEEP_SEQUENCE = 12, 64


def _compile_per_block(model, backend: str):
    """Each decoder layer compiled in place (its ``state_dict`` keys unchanged); embedding, norm, head eager."""
    if backend == "fp8 per-block":
        from fp8graph.backend import FP8Backend

        compile_backend = FP8Backend(None, "inductor", "auto", model=model)
    else:
        compile_backend = "inductor"
    for layer in model.model.layers:
        layer.compile(backend=compile_backend)
    return model


def _first_step_seconds(family: str, config: str, backend: str, layers: int | None = None,
                        sequence: int = 16) -> float:
    """Runs in the child process: compile time of the first training step."""
    import fp8graph
    from fp8graph.models import build

    model = build(family, config, **({} if layers is None else {"num_hidden_layers": layers}))
    start = time.perf_counter()
    if backend in PER_BLOCK:
        compiled = _compile_per_block(model, backend)
    else:
        compiled = fp8graph.compile(model) if backend == "fp8" else torch.compile(model)
    if family == "llama":
        tokens = torch.randint(0, 250, (2, sequence))
        compiled(tokens, labels=tokens, use_cache=False).loss.backward()
    else:
        compiled(torch.randn(32, 64)).sum().backward()
    return time.perf_counter() - start


def _measure_in_child(family: str, config: str, backend: str, cache_dir: str, layers: int | None = None,
                      sequence: int = 16) -> float:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    code = ("import json, sys; from bench.compile_time import _first_step_seconds; "
            f"print(json.dumps(_first_step_seconds({family!r}, {config!r}, {backend!r}, {layers!r}, {sequence!r})))")
    completed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                               cwd=pathlib.Path(__file__).resolve().parents[1])
    return json.loads(completed.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    family, config = ("mlp", "tiny") if args.smoke else ("llama", "tiny")
    layers, sequence = (DEEP_LAYERS, DEEP_SEQUENCE) if args.deep else (None, 16)
    backends = args.backends or (BACKENDS if args.smoke else (*BACKENDS, *PER_BLOCK))
    if family != "llama" and set(backends) & set(PER_BLOCK):
        raise SystemExit(f"{PER_BLOCK} compile a Llama's decoder layers; the smoke model has none")
    repeats = 1 if args.smoke else args.repeats
    timings = {backend: {"cold_timings_s": [], "warm_timings_s": []} for backend in backends}
    # Backends take turns, so a slow spell of the machine does not fall on one of them only.
    for _ in range(repeats):
        for backend in backends:
            with tempfile.TemporaryDirectory() as cache_dir:
                for phase in ("cold_timings_s", "warm_timings_s"):
                    timings[backend][phase].append(
                        _measure_in_child(family, config, backend, cache_dir, layers, sequence))
    rows = [{"backend": backend, **timings[backend],
             "compile_cold_s": median(timings[backend]["cold_timings_s"]),
             "compile_warm_s": median(timings[backend]["warm_timings_s"])} for backend in backends]
    for row in rows:  # against plain Inductor on the whole model, the first backend
        row["cold_vs_inductor"] = row["compile_cold_s"] / rows[0]["compile_cold_s"]
        row["warm_vs_inductor"] = row["compile_warm_s"] / rows[0]["compile_warm_s"]
    model = f"{family} {config}" + (f", {layers} layers, sequence {sequence}" if layers else "")
    result = {"workload": "compile_time", "smoke": args.smoke, "model": model, "layers": layers, "sequence": sequence,
              "environment": environment(torch.device("cpu")), "cpu_threads": torch.get_num_threads(),
              "rows": rows}
    return report(result, args.out, "compile", summary)


def summary(result: dict) -> str:
    rows = [[r["backend"], f"{r['compile_cold_s']:.1f}", f"{r['cold_vs_inductor']:.2f}x",
             f"{r['compile_warm_s']:.1f}", f"{r['warm_vs_inductor']:.2f}x"] for r in result["rows"]]
    columns = ["backend", "cold s", "vs inductor", "warm s", "vs inductor"]
    return "\n".join([title(f"compile time, {result['model']}, first forward + backward", result), "",
                      *markdown_table(columns, rows)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="the toy MLP, for the tests (one repeat)")
    parser.add_argument("--repeats", type=int, default=3, help="cold and warm measurements per backend")
    parser.add_argument("--deep", action="store_true",
                        help=f"{DEEP_LAYERS} layers of the tiny Llama at sequence {DEEP_SEQUENCE}")
    parser.add_argument("--backends", nargs="+", choices=(*BACKENDS, *PER_BLOCK),
                        help="the first is the reference (default: all; the smoke run: inductor and fp8)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
