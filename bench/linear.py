"""One linear layer, forward + backward: fp8graph per recipe against BF16 eager, BF16 torch.compile and torchao.

    output = input @ weight^T; then output.backward(grad_output)

Full mode runs Llama-3-8B shapes (M = 16384 tokens; K, N = 4096x4096,
4096x14336, 14336x4096) and two small shapes where FP8 may lose, on CUDA with
Inductor; torchao's float8 training (tensorwise and rowwise, module swap +
torch.compile) joins when torchao is installed. Each contestant is built on
its own copy of the layer and compiled alone, after ``torch._dynamo.reset()``;
one that runs eagerly, recompiles while timed, or (fp8graph) puts no site in
FP8 on this device is recorded as an error, not timed (``bench.timing.time_compiled``).
``--smoke`` runs a tiny shape on CPU with ``aot_eager`` so the script is
exercised by the tests (its timings mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import pathlib
from typing import Callable

import torch

import fp8graph
from fp8graph.recipes import PRESETS

from .cli import positive, require_cuda
from .timing import (attempt, environment, failed, markdown_table, median, report, require_fp8_sites,
                     time_compiled, time_ms, title, write_partial)

FULL_SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096),
               (1024, 1024, 1024), (4096, 1024, 1024)]
SMOKE_SHAPES = [(128, 128, 128)]  # block scaling needs multiples of 128
RECIPES = ("current", "rowwise", "block", "mxfp8", "delayed")
TORCHAO_RECIPES = ("tensorwise", "rowwise")


def _fp8graph(recipe_name: str, compiler: str, **options) -> Callable[[torch.nn.Module], torch.nn.Module]:
    return lambda layer: fp8graph.compile(layer, policy=PRESETS[recipe_name], compiler=compiler, **options)


def _torchao(recipe_name: str, compiler: str) -> Callable[[torch.nn.Module], torch.nn.Module]:
    def build(layer):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        return torch.compile(convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe_name)),
                             backend=compiler)
    return build


def contestants(compiler: str) -> dict[str, Callable[[torch.nn.Module], torch.nn.Module] | None]:
    """Name -> how to build the contestant from a ``Sequential(Linear)`` copy (``None``: BF16 eager)."""
    builders = {"bf16 eager": None,
                f"bf16 torch.compile ({compiler})": lambda layer: torch.compile(layer, backend=compiler)}
    for name in RECIPES:
        # Delayed scaling keeps its amax history on the module that owns the weight, anchored
        # through a submodule's hook: hence every contestant gets the linear inside a Sequential.
        # The timed steps leave the weight as it is: kept copies would be read, not cast (the cached row's case).
        builders[f"fp8graph {name} ({compiler})"] = _fp8graph(name, compiler, cache_weights=False)
    # Micro-batches 2..n of gradient accumulation: the weight's FP8 copy is reused
    # (the weight never changes between the timed steps, so every step after the first reuses).
    builders[f"fp8graph current, cached weight ({compiler})"] = _fp8graph("current", compiler)
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return builders
    for name in TORCHAO_RECIPES:
        builders[f"torchao {name} ({compiler})"] = _torchao(name, compiler)
    return builders


def _measure(build, layer, x, grad_output, device, warmup, repeats) -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = torch.nn.Sequential(copy.deepcopy(layer))
    compiled = model if build is None else build(model)
    weight = model[0].weight  # read after building: torchao swaps the module

    def step():
        x.grad = None
        weight.grad = None
        compiled(x).backward(grad_output)

    if build is None:
        timings = time_ms(step, device, warmup, repeats)
    else:
        step()  # compiles: fp8graph's decisions are known from here
        require_fp8_sites(compiled)
        timings = time_compiled(step, device, warmup, repeats)
    return {"timings_ms": timings, "median_ms": median(timings)}


def run(args: argparse.Namespace) -> dict:
    require_cuda("linear", args)
    device = torch.device("cpu" if args.smoke else "cuda")
    compiler = "aot_eager" if args.smoke else "inductor"
    shapes = SMOKE_SHAPES if args.smoke else FULL_SHAPES
    # Two warm-up calls at least: cache_weights compiles its reuse graph on the second.
    warmup, repeats = (2, 3) if args.smoke else (10, args.repeats)
    rows = []
    result = {"workload": "linear_fwd_bwd", "smoke": args.smoke, "compiler": compiler,
              "environment": environment(device), "warmup": warmup, "repeats": repeats, "rows": rows}
    builders = contestants(compiler)
    for M, K, N in shapes:
        torch.manual_seed(0)
        layer = torch.nn.Linear(K, N, bias=False, device=device, dtype=torch.bfloat16)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad_output = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        flops = 3 * 2 * M * K * N  # three GEMMs
        for name, build in builders.items():
            def measure(build=build):
                row = _measure(build, layer, x, grad_output, device, warmup, repeats)
                return {**row, "tflops": flops / row["median_ms"] / 1e9}
            rows.append(attempt({"contestant": name, "M": M, "K": K, "N": N}, measure))
            write_partial(result, args.out, "linear")
    torch._dynamo.reset()
    measured = [r for r in rows if "error" not in r]
    baseline = {(r["M"], r["K"], r["N"]): r["median_ms"] for r in measured if "torch.compile" in r["contestant"]}
    for r in measured:
        if (r["M"], r["K"], r["N"]) in baseline:
            r["speedup_vs_bf16_compile"] = baseline[(r["M"], r["K"], r["N"])] / r["median_ms"]
    return report(result, args.out, "linear", summary)


def summary(result: dict) -> str:
    rows = [[r["contestant"], str(r["M"]), str(r["K"]), str(r["N"]), f"{r['median_ms']:.3f}",
             f"{r['tflops']:.1f}", f"{r['speedup_vs_bf16_compile']:.2f}x" if "speedup_vs_bf16_compile" in r else "-"]
            for r in result["rows"] if "error" not in r]
    columns = ["contestant", "M", "K", "N", "median ms", "TFLOP/s", "vs bf16 compile"]
    return "\n".join([title("linear fwd+bwd", result), "", *markdown_table(columns, rows), *failed(result["rows"])])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, for the tests")
    parser.add_argument("--repeats", type=positive(int), default=100)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
