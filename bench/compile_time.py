"""Compile time of ``backend="fp8"`` against plain Inductor, cold and warm, on CPU.

    cold   a fresh process and an empty Inductor cache directory: first forward + backward
    warm   a fresh process reusing that cache directory (FX graph cache, AOTAutograd cache)

The medians of ``--repeats`` cold and warm measurements are compared (a warm
start takes a few seconds, and one sample of it moves by a third from run to
run on a 2-core machine).

Each measurement runs in its own process so nothing stays in memory between
them. Full mode: the tiny Llama (the figure the README reports, target <= 1.3x);
``--smoke``: the toy MLP, for the tests.
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


def _first_step_seconds(family: str, config: str, backend: str) -> float:
    """Runs in the child process: compile time of the first training step."""
    import fp8graph
    from fp8graph.models import build

    model = build(family, config)
    compiled = fp8graph.compile(model) if backend == "fp8" else torch.compile(model)
    start = time.perf_counter()
    if family == "llama":
        tokens = torch.randint(0, 250, (2, 16))
        compiled(tokens, labels=tokens).loss.backward()
    else:
        compiled(torch.randn(32, 64)).sum().backward()
    return time.perf_counter() - start


def _measure_in_child(family: str, config: str, backend: str, cache_dir: str) -> float:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    code = ("import json, sys; from bench.compile_time import _first_step_seconds; "
            f"print(json.dumps(_first_step_seconds({family!r}, {config!r}, {backend!r})))")
    completed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                               cwd=pathlib.Path(__file__).resolve().parents[1])
    return json.loads(completed.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    family, config = ("mlp", "tiny") if args.smoke else ("llama", "tiny")
    repeats = 1 if args.smoke else args.repeats
    timings = {backend: {"cold_timings_s": [], "warm_timings_s": []} for backend in BACKENDS}
    # Backends take turns, so a slow spell of the machine does not fall on one of them only.
    for _ in range(repeats):
        for backend in BACKENDS:
            with tempfile.TemporaryDirectory() as cache_dir:
                timings[backend]["cold_timings_s"].append(_measure_in_child(family, config, backend, cache_dir))
                timings[backend]["warm_timings_s"].append(_measure_in_child(family, config, backend, cache_dir))
    rows = [{"backend": backend, **timings[backend],
             "compile_cold_s": median(timings[backend]["cold_timings_s"]),
             "compile_warm_s": median(timings[backend]["warm_timings_s"])} for backend in BACKENDS]
    for row in rows:
        row["cold_vs_inductor"] = row["compile_cold_s"] / rows[0]["compile_cold_s"]
        row["warm_vs_inductor"] = row["compile_warm_s"] / rows[0]["compile_warm_s"]
    result = {"workload": "compile_time", "smoke": args.smoke, "model": f"{family} {config}",
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
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
