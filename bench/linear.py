"""One linear layer, forward + backward: fp8graph per recipe against BF16 eager and BF16 torch.compile.

    output = input @ weight^T; then output.backward(grad_output)

Full mode runs Llama-3-8B shapes (M = 16384 tokens; K, N = 4096x4096,
4096x14336, 14336x4096) and two small shapes where FP8 may lose, on CUDA with
Inductor; torchao's float8 training (tensorwise and rowwise, module swap +
torch.compile) joins when torchao is installed. ``--smoke`` runs a tiny shape on CPU with ``aot_eager`` so the
script is exercised by the tests (its timings mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import pathlib

import torch

import fp8graph
from fp8graph.recipes import PRESETS

from .timing import attempt, environment, failed, markdown_table, median, report, time_ms, title, write_partial

FULL_SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096),
               (1024, 1024, 1024), (4096, 1024, 1024)]
SMOKE_SHAPES = [(128, 128, 128)]  # block scaling needs multiples of 128


def _step(model, x, grad_output):
    def run():
        x.grad = None
        model.weight.grad = None
        model(x).backward(grad_output)
    return run


RECIPES = {name: PRESETS[name] for name in ("current", "rowwise", "block", "mxfp8")}


def _contestants(linear: torch.nn.Module, compiler: str) -> dict:
    contestants = {
        "bf16 eager": linear,
        f"bf16 torch.compile ({compiler})": torch.compile(linear, backend=compiler),
    }
    for name, recipe in RECIPES.items():
        compiled = fp8graph.compile(linear, policy=recipe, compiler=compiler)
        contestants[f"fp8graph {name} ({compiler})"] = compiled
    # Delayed scaling keeps its amax history on the module that owns the weight,
    # anchored through a submodule's hook: the linear goes inside a Sequential.
    contestants[f"fp8graph delayed ({compiler})"] = _on_a_copy(
        linear, lambda wrapped: fp8graph.compile(wrapped, policy=PRESETS["delayed"], compiler=compiler))
    # Micro-batches 2..n of gradient accumulation: the weight's FP8 copy is reused
    # (the weight never changes between the timed steps, so every step after the first reuses).
    contestants[f"fp8graph current, cached weight ({compiler})"] = _on_a_copy(
        linear, lambda wrapped: fp8graph.compile(wrapped, policy=RECIPES["current"], compiler=compiler,
                                                 cache_weights=True))
    contestants.update(_torchao_contestants(linear, compiler))
    return contestants


def _on_a_copy(linear: torch.nn.Module, compile_wrapped) -> "_SameWeight":
    """``compile_wrapped(Sequential(copy of linear))``, for contestants that add state or swap modules."""
    wrapped = torch.nn.Sequential(copy.deepcopy(linear))
    compiled = compile_wrapped(wrapped)
    return _SameWeight(compiled, wrapped[0].weight)  # read after compile_wrapped, which may swap the module


def _torchao_contestants(linear: torch.nn.Module, compiler: str) -> dict:
    """torchao float8 training, tensorwise and rowwise, where torchao is installed (none otherwise)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return {}
    contestants = {}
    for recipe_name in ("tensorwise", "rowwise"):
        config = Float8LinearConfig.from_recipe_name(recipe_name)
        contestants[f"torchao {recipe_name} ({compiler})"] = _on_a_copy(
            linear, lambda wrapped, config=config: torch.compile(
                convert_to_float8_training(wrapped, config=config), backend=compiler))
    return contestants


class _SameWeight(torch.nn.Module):
    """A compiled copy of the linear, exposing its ``.weight`` as the step function expects."""

    def __init__(self, compiled: torch.nn.Module, weight: torch.nn.Parameter):
        super().__init__()
        self.compiled = compiled
        self.weight = weight

    def forward(self, x):
        return self.compiled(x)


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    compiler = "aot_eager" if args.smoke else "inductor"
    shapes = SMOKE_SHAPES if args.smoke else FULL_SHAPES
    warmup, repeats = (1, 3) if args.smoke else (10, args.repeats)
    rows = []
    result = {"workload": "linear_fwd_bwd", "smoke": args.smoke, "compiler": compiler,
              "environment": environment(device), "warmup": warmup, "repeats": repeats, "rows": rows}
    for M, K, N in shapes:
        torch.manual_seed(0)
        linear = torch.nn.Linear(K, N, bias=False, device=device, dtype=torch.bfloat16)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad_output = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        for name, model in _contestants(linear, compiler).items():
            def measure(model=model):
                timings = time_ms(_step(model, x, grad_output), device, warmup, repeats)
                flops = 3 * 2 * M * K * N  # three GEMMs
                return {"timings_ms": timings, "median_ms": median(timings), "tflops": flops / median(timings) / 1e9}
            rows.append(attempt({"contestant": name, "M": M, "K": K, "N": N}, measure))
        torch._dynamo.reset()
        write_partial(result, args.out, "linear")
    measured = [r for r in rows if "error" not in r]
    baseline = {(r["M"], r["K"], r["N"]): r["median_ms"] for r in measured if "torch.compile" in r["contestant"]}
    for r in measured:
        r["speedup_vs_bf16_compile"] = baseline[(r["M"], r["K"], r["N"])] / r["median_ms"]
    return report(result, args.out, "linear", summary)


def summary(result: dict) -> str:
    rows = [[r["contestant"], str(r["M"]), str(r["K"]), str(r["N"]), f"{r['median_ms']:.3f}",
             f"{r['tflops']:.1f}", f"{r['speedup_vs_bf16_compile']:.2f}x"] for r in result["rows"] if "error" not in r]
    columns = ["contestant", "M", "K", "N", "median ms", "TFLOP/s", "vs bf16 compile"]
    return "\n".join([title("linear fwd+bwd", result), "", *markdown_table(columns, rows), *failed(result["rows"])])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, for the tests")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
