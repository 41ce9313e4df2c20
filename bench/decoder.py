"""A Llama decoder stack (transformers): training tokens/s, peak memory, compile time, and prefill.

Full mode: the ``bench-8b-layer`` config (hidden 4096, FFN 14336, 32 heads,
8 KV heads; ``--layers`` decoder layers), batch 1, sequence 4096, BF16 on
CUDA with Inductor. Per contestant:

    compile_cold_s   first training step, compile included, with empty compile caches
    compile_warm_s   the same again, in-memory caches cleared, on-disk caches as the cold run left them
                     (what a new process finds); each contestant has caches of its own
    train            steps of forward + backward + SGD; tokens/s from the median step
    peak_memory_gb   torch.cuda.max_memory_allocated over the training steps
    saved_gb         what one training step's forward saves for its backward (bench.memory; any device)
    prefill          forward under torch.no_grad(); tokens/s from the median call

Contestants: BF16 ``torch.compile``, fp8graph per recipe, and torchao's float8
training (tensorwise and rowwise, module swap + ``torch.compile``) when
torchao is installed. ``--smoke`` runs the tiny Llama on CPU with
``aot_eager`` (timings mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import pathlib
import tempfile
import time

import torch
from torch._inductor import config as inductor_config

import fp8graph
from fp8graph.recipes import PRESETS
from fp8graph.models import build

from .memory import saved_for_backward_bytes
from .timing import attempt, environment, failed, markdown_table, median, report, time_ms, title, write_partial

RECIPES = {name: PRESETS[name] for name in ("current", "delayed", "rowwise", "block")}
TORCHAO_RECIPES = ("tensorwise", "rowwise")


KNOWN = ["bf16", *RECIPES, *(f"torchao {name}" for name in TORCHAO_RECIPES)]


def contestants() -> list[str]:
    """BF16, fp8graph's recipes, and torchao's where it is installed."""
    torchao_installed = importlib.util.find_spec("torchao") is not None
    return [name for name in KNOWN if torchao_installed or not name.startswith("torchao")]


def _swap_in_torchao(model, contestant: str) -> None:
    """torchao's float8 training: its Float8Linear in place of every nn.Linear whose K and N suit FP8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = contestant.removeprefix("torchao ")
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, name: module.in_features % 16 == 0 and module.out_features % 16 == 0)


def _compile(model, contestant: str, compiler: str, freeze_weights: bool = False):
    if contestant == "bf16" or contestant.startswith("torchao"):
        compiled = torch.compile(model, backend=compiler)
        if not freeze_weights:
            return compiled

        def frozen(*args, **kwargs):  # what fp8graph's freeze_weights does, for the baseline
            with inductor_config.patch(freezing=True):
                return compiled(*args, **kwargs)
        return frozen
    return fp8graph.compile(model, policy=RECIPES[contestant], compiler=compiler, freeze_weights=freeze_weights)


def _train_step(compiled, model, tokens):
    def step():
        loss = compiled(tokens, labels=tokens).loss
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(parameter.grad, alpha=-1e-5)
                parameter.grad = None
    return step


@contextlib.contextmanager
def _compile_caches_in(directory: str):
    """Inductor's and Triton's on-disk caches in ``directory``, in-memory caches emptied: a new process's start."""
    from torch._inductor.utils import clear_caches

    names = {"TORCHINDUCTOR_CACHE_DIR": directory, "TRITON_CACHE_DIR": os.path.join(directory, "triton")}
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    torch._dynamo.reset()
    clear_caches()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _first_call_seconds(step, device) -> float:
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _measure(contestant: str, args, device, compiler, config, batch, sequence, warmup, repeats) -> dict:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build("llama", config).to(device=device, dtype=dtype)
    if not args.smoke:
        model.model.layers = model.model.layers[:args.layers]
        model.config.num_hidden_layers = args.layers
    if contestant.startswith("torchao"):
        _swap_in_torchao(model, contestant)
    tokens = torch.randint(0, model.config.vocab_size, (batch, sequence), device=device)
    row = {"contestant": contestant, **_measure_training(model, contestant, compiler, tokens, device, warmup, repeats)}
    # A prefill that fails (a compile with freezing) keeps the training numbers; its error stands beside them.
    prefill = attempt({}, lambda: _measure_prefill(model, contestant, compiler, tokens, device, warmup, repeats))
    row.update({"prefill_error": prefill["error"]} if "error" in prefill else prefill)
    return row


def _measure_training(model, contestant, compiler, tokens, device, warmup, repeats) -> dict:
    row = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for phase in ("compile_cold_s", "compile_warm_s"):
            with _compile_caches_in(cache_dir):
                compiled_model = _compile(model, contestant, compiler)
                step = _train_step(compiled_model, model, tokens)
                row[phase] = _first_call_seconds(step, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row["train_timings_ms"] = time_ms(step, device, warmup, repeats)
    row["train_tokens_per_s"] = tokens.numel() / (median(row["train_timings_ms"]) / 1e3)
    row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    row["saved_gb"] = saved_for_backward_bytes(
        lambda: compiled_model(tokens, labels=tokens).loss, model.parameters()) / 1e9
    for parameter in model.parameters():
        parameter.grad = None
    return row


def _measure_prefill(model, contestant, compiler, tokens, device, warmup, repeats) -> dict:
    """Inference with frozen weights (Inductor only): every contestant folds
    what depends on weights alone, so fp8graph quantizes each weight once."""
    freeze_weights = compiler == "inductor"
    torch._dynamo.reset()
    compiled = _compile(model, contestant, compiler, freeze_weights)

    def prefill():
        with torch.no_grad():
            compiled(tokens)
    timings = time_ms(prefill, device, warmup, repeats)
    return {"prefill_frozen_weights": freeze_weights, "prefill_timings_ms": timings,
            "prefill_tokens_per_s": tokens.numel() / (median(timings) / 1e3)}


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    compiler = "aot_eager" if args.smoke else "inductor"
    config, batch, sequence = ("tiny", 2, 32) if args.smoke else ("bench-8b-layer", 1, 4096)
    warmup, repeats = (1, 2) if args.smoke else (3, args.repeats)
    available = contestants()
    wanted = ["bf16", *(name for name in args.contestants or available if name != "bf16")]
    unknown = sorted(set(wanted) - set(KNOWN))
    if unknown:
        raise SystemExit(f"unknown contestants {unknown}; known: {KNOWN}")
    missing = [name for name in wanted if name not in available]
    if missing:
        print(f"torchao is not installed: {missing} left out")
        wanted = [name for name in wanted if name in available]
    rows = []
    result = {"workload": "decoder_stack", "smoke": args.smoke, "compiler": compiler, "config": config,
              "layers": None if args.smoke else args.layers, "batch": batch, "sequence": sequence,
              "environment": environment(device), "warmup": warmup, "repeats": repeats, "rows": rows}
    for name in wanted:
        rows.append(attempt({"contestant": name}, lambda name=name: _measure(
            name, args, device, compiler, config, batch, sequence, warmup, repeats)))
        write_partial(result, args.out, "decoder")
    torch._dynamo.reset()
    baseline = rows[0]
    if "error" in baseline:
        raise SystemExit(f"the BF16 baseline failed, so nothing can be compared: {baseline['error']}")
    for row in (r for r in rows if "error" not in r):
        row["train_speedup_vs_bf16_compile"] = row["train_tokens_per_s"] / baseline["train_tokens_per_s"]
        if "prefill_tokens_per_s" in row and "prefill_tokens_per_s" in baseline:
            row["prefill_speedup_vs_bf16_compile"] = row["prefill_tokens_per_s"] / baseline["prefill_tokens_per_s"]
        row["compile_cold_vs_bf16"] = row["compile_cold_s"] / baseline["compile_cold_s"]
        row["saved_vs_bf16"] = row["saved_gb"] / baseline["saved_gb"]
    return report(result, args.out, "decoder", summary)


def summary(result: dict) -> str:
    rows = [[r["contestant"], f"{r['train_tokens_per_s']:.0f}", f"{r['train_speedup_vs_bf16_compile']:.2f}x",
             _number(r, "prefill_tokens_per_s", "{:.0f}"), _number(r, "prefill_speedup_vs_bf16_compile", "{:.2f}x"),
             "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}",
             f"{r['saved_gb']:.3g}", f"{r['compile_cold_s']:.1f}", f"{r['compile_warm_s']:.1f}"]
            for r in result["rows"] if "error" not in r]
    columns = ["contestant", "train tokens/s", "vs bf16", "prefill tokens/s", "vs bf16", "peak GB",
               "saved for backward GB", "compile cold s", "warm s"]
    heading = f"Llama decoder stack ({result['config']}, batch {result['batch']}, sequence {result['sequence']})"
    return "\n".join([title(heading, result), "", *markdown_table(columns, rows), *failed(result["rows"]),
                      *failed(result["rows"], "prefill_error", " prefill")])


def _number(row: dict, key: str, form: str) -> str:
    return form.format(row[key]) if key in row else "-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="the tiny Llama on CPU, for the tests")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the full config")
    parser.add_argument("--contestants", nargs="+", metavar="NAME",
                        help="run these (and the BF16 baseline) only, e.g. current 'torchao tensorwise'; "
                             "default: all available")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
