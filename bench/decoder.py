"""A Llama decoder stack (transformers): training tokens/s, peak memory, compile time, prefill, and where time goes.

Full mode, BF16 on CUDA with Inductor, batch 1, sequence 4096: ``--config
bench-8b-layer`` (Llama-3-8B layers, hidden 4096, FFN 14336, 32 heads, 8 KV
heads, a 32000-token vocabulary; 4 layers unless ``--layers`` says) or
``--config llama3-8b`` (the whole model: 32 layers, vocabulary 128256).
Each contestant runs in a process of its own (a fresh CUDA context, so peak
memory is the contestant's alone) and reports:

    compile_cold_s   first training step, compile included, with empty compile caches
    compile_warm_s   the same again, in-memory caches cleared, on-disk caches as the cold run left them
                     (what a new process finds); each contestant has caches of its own
    train            steps of forward + backward + SGD, timed with recompiles refused; tokens/s from the median
    peak_memory_gb   torch.cuda.max_memory_allocated over the training steps
    saved_gb         what one training step's forward saves for its backward (bench.memory; any device)
    profile          with --profile: kernel time per step by category and the top kernels (bench.profile)
    prefill          forward under torch.no_grad() with frozen weights; tokens/s from the median call
                     (--skip-prefill leaves it out: a compile with freezing per contestant)

Contestants: BF16 ``torch.compile``, fp8graph per recipe, and torchao's float8
training (tensorwise and rowwise, module swap + ``torch.compile``) when
torchao is installed. A contestant's name may end in Inductor settings,
``+name`` on and ``-name`` off (``"current +combo_kernels"``, ``"delayed
+cooperative_reductions"``, ``"bf16 -loop_ordering_after_fusion"``; see
``INDUCTOR_SETTINGS``), each run compiled under them, so a GPU run measures
what a setting changes against the same contestant without it. ``--smoke`` runs the tiny Llama on CPU with
``aot_eager`` (timings mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import tempfile
import time

import torch
from torch._inductor import config as inductor_config

import fp8graph
from fp8graph.models import build
from fp8graph.recipes import PRESETS

from . import forked
from .auto_policy import AUTO, auto_policy
from .cli import positive, require_cuda
from .memory import saved_for_backward_bytes
from .profile import CATEGORIES, profile_steps
from .timing import (accumulated_step, attempt, environment, failed, last_weight_cast_mode, markdown_table, median,
                     report, require_fp8_sites, time_compiled, time_ms, title, write_partial)

RECIPES = {name: PRESETS[name] for name in ("current", "delayed", "rowwise", "block")}
# The recipes with the transposed FP8 copies written by the forward and saved (recipe.save_transposes):
# what the default's leaner memory costs in time. Made when compiled (recipe_of), so that this module still
# imports beside an fp8graph from before the field (the cost model's calibration runs earlier commits).
SAVED_TRANSPOSES = tuple(f"{name} saved-transposes" for name in ("current", "delayed", "rowwise", "block"))
TORCHAO_RECIPES = ("tensorwise", "rowwise")
CONFIGS = ("bench-8b-layer", "llama3-8b")

# fp8graph's own compile with every site kept in BF16 (its regions and the graphs around them, bit-equal to
# torch.compile's): the like-for-like reference of its recipes, whose step over this one's is what FP8 itself gains
# (a whole-model torch.compile of a HuggingFace decoder on the GPU machine's torch 2.11, before pytorch#176499,
# materializes the causal mask; the trunk fp8graph's regions leave eager does not: docs/benchmarks.md).
SAME_GRAPHS_BF16 = "fp8graph bf16"
# "bf16 per-block": plain torch.compile of each decoder layer (layer.compile(), torchtitan's way);
# "current whole": fp8graph with regions=None.
KNOWN = ["bf16", *RECIPES, *SAVED_TRANSPOSES, *(f"torchao {name}" for name in TORCHAO_RECIPES), "bf16 per-block",
         SAME_GRAPHS_BF16, "current whole", *AUTO]
# Inductor settings a contestant's name may switch, each worth a measurement for quantization-heavy graphs:
# reductions spread over all SMs, horizontal fusion of independent kernels, loop reordering after fusion.
INDUCTOR_SETTINGS = {"cooperative_reductions": "triton.cooperative_reductions", "combo_kernels": "combo_kernels",
                     "loop_ordering_after_fusion": "loop_ordering_after_fusion"}


def parse_contestant(name: str, known=None) -> tuple[str, dict[str, bool]]:
    """``("current", {"combo_kernels": True})`` of ``"current +combo_kernels"``; raises on a name not in
    ``known`` (default: this benchmark's contestants) or an unknown setting."""
    known = KNOWN if known is None else known
    words = name.split()
    suffix = [word for word in words if word[:1] in "+-" and len(word) > 1]
    base = " ".join(word for word in words if word not in suffix)
    if base not in known:
        raise ValueError(f"unknown contestant {base!r} in {name!r}; known: {known}")
    patches = {}
    for word in suffix:
        if word[1:] not in INDUCTOR_SETTINGS:
            raise ValueError(f"unknown Inductor setting {word[1:]!r} in {name!r}; known: {sorted(INDUCTOR_SETTINGS)}")
        patches[INDUCTOR_SETTINGS[word[1:]]] = word[0] == "+"
    return base, patches


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


def _compile(model, contestant: str, compiler: str, freeze_weights: bool = False, policy_gpu: str | None = None):
    """``model`` compiled as ``contestant``; an ``auto`` one's sites timed on ``policy_gpu`` (``None``: the GPU this
    runs on)."""
    if contestant == "bf16 per-block":
        for layer in model.model.layers:
            layer.compile(backend=compiler)
        return model
    if contestant == SAME_GRAPHS_BF16:
        return fp8graph.compile(model, policy=fp8graph.Policy(default=None), compiler=compiler,
                                freeze_weights=freeze_weights)
    if contestant in AUTO:
        return fp8graph.compile(model, policy=auto_policy(contestant, policy_gpu), compiler=compiler,
                                freeze_weights=freeze_weights)
    if contestant == "current whole":
        return fp8graph.compile(model, policy=RECIPES["current"], compiler=compiler, freeze_weights=freeze_weights,
                                regions=None)
    if contestant == "bf16" or contestant.startswith("torchao"):
        compiled = torch.compile(model, backend=compiler)
        if not freeze_weights:
            return compiled

        def frozen(*args, **kwargs):  # what fp8graph's freeze_weights does, for the baseline
            with inductor_config.patch(freezing=True):
                return compiled(*args, **kwargs)
        return frozen
    return fp8graph.compile(model, policy=recipe_of(contestant), compiler=compiler, freeze_weights=freeze_weights)


def recipe_of(contestant: str):
    """The recipe of one of fp8graph's contestants."""
    if contestant in SAVED_TRANSPOSES:
        return dataclasses.replace(RECIPES[contestant.removesuffix(" saved-transposes")], save_transposes=True)
    return RECIPES[contestant]


def _train_step(compiled, model, tokens, micro_batches: int = 1):
    def sgd():
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(parameter.grad, alpha=-1e-5)
                parameter.grad = None
    return accumulated_step(compiled, lambda: compiled(tokens, labels=tokens).loss.backward(), sgd, micro_batches)


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


def _settings(args) -> dict:
    """Device, compiler, model config and loop sizes of this run."""
    if args.smoke:
        return {"device": torch.device("cpu"), "compiler": "aot_eager", "config": "tiny", "layers": None,
                "batch": 2, "sequence": 32, "warmup": 2, "repeats": 2, "dtype": torch.float32}
    return {"device": torch.device("cuda"), "compiler": "inductor", "config": args.config, "layers": args.layers,
            "batch": 1, "sequence": 4096, "warmup": 3, "repeats": args.repeats, "dtype": torch.bfloat16}


def build_model(settings: dict) -> torch.nn.Module:
    """The run's Llama, built on its device in its dtype, with ``settings["layers"]`` layers if given."""
    overrides = {} if settings["layers"] is None else {"num_hidden_layers": settings["layers"]}
    return build("llama", settings["config"], device=settings["device"], dtype=settings["dtype"], **overrides)


def measure_contestant(name: str, args) -> dict:
    """One contestant's row, measured in this process (under its Inductor settings, if its name has any)."""
    contestant, patches = parse_contestant(name)
    with inductor_config.patch(patches):
        row = _measure_contestant(contestant, args)
    return {**row, "contestant": name, "inductor_settings": patches}


def _measure_contestant(contestant: str, args) -> dict:
    settings = _settings(args)
    device, compiler = settings["device"], settings["compiler"]
    model = build_model(settings)
    if contestant.startswith("torchao"):
        _swap_in_torchao(model, contestant)
    tokens = torch.randint(0, model.config.vocab_size, (settings["batch"], settings["sequence"]), device=device)
    row = {"contestant": contestant, "layers_built": len(model.model.layers),
           **_measure_training(model, contestant, compiler, tokens, device, settings["warmup"], settings["repeats"],
                               args.profile, args.grad_accumulation)}
    if args.skip_prefill:
        return row
    # A prefill that fails (a compile with freezing) keeps the training numbers; its error stands beside them.
    prefill = attempt({}, lambda: _measure_prefill(model, contestant, compiler, tokens, device, settings["warmup"],
                                                   settings["repeats"]))
    row.update({"prefill_error": prefill["error"]} if "error" in prefill else prefill)
    return row


def _measure_training(model, contestant, compiler, tokens, device, warmup, repeats, profile,
                      micro_batches: int = 1) -> dict:
    row = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for phase in ("compile_cold_s", "compile_warm_s"):
            with _compile_caches_in(cache_dir):
                torch._dynamo.utils.counters.clear()
                compiled_model = _compile(model, contestant, compiler)
                step = _train_step(compiled_model, model, tokens, micro_batches)
                row[phase] = _first_call_seconds(step, device)
                require_fp8_sites(compiled_model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row["train_timings_ms"] = time_compiled(step, device, warmup, repeats)
    row["last_micro_batch_weight_casts"] = last_weight_cast_mode(compiled_model)
    row["train_tokens_per_s"] = micro_batches * tokens.numel() / (median(row["train_timings_ms"]) / 1e3)
    row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    if profile:
        row["profile"] = profile_steps(step, device)
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


def _in_own_process(contestant: str, args) -> dict:
    """``measure_contestant`` in a child process: its own CUDA context, so its own peak memory.

    A child that crashes or outlives ``--contestant-timeout`` leaves an error
    row with the end of its output; the other contestants go on.
    """
    command = ["decoder", "--one", contestant, "--config", args.config, "--repeats", str(args.repeats),
               "--grad-accumulation", str(args.grad_accumulation)]
    command += (["--layers", str(args.layers)] if args.layers is not None else [])
    command += [flag for flag, wanted in (("--smoke", args.smoke), ("--profile", args.profile),
                                          ("--skip-prefill", args.skip_prefill)) if wanted]
    return forked.row_in_child(contestant, command, args.contestant_timeout)


def run(args: argparse.Namespace) -> dict:
    if args.one:  # a child process of a run: one contestant's row into --row-file
        row = attempt({"contestant": args.one}, lambda: measure_contestant(args.one, args))
        args.row_file.write_text(json.dumps(row))
        return row
    require_cuda("decoder", args)
    settings = _settings(args)
    available = contestants()
    wanted = ["bf16", *(name for name in args.contestants or available if name != "bf16")]
    try:
        base_of = {name: parse_contestant(name)[0] for name in wanted}
    except ValueError as error:
        raise SystemExit(str(error)) from None
    missing = [name for name in wanted if base_of[name] not in available]
    if missing:
        print(f"torchao is not installed: {missing} left out")
        wanted = [name for name in wanted if name in available]
    rows = []
    result = {"workload": "decoder_stack", "smoke": args.smoke, "compiler": settings["compiler"],
              "config": settings["config"], "layers": settings["layers"], "batch": settings["batch"],
              "sequence": settings["sequence"], "environment": environment(settings["device"]),
              "warmup": settings["warmup"], "repeats": settings["repeats"], "process_per_contestant": True,
              "grad_accumulation": args.grad_accumulation, "rows": rows}
    for name in wanted:
        rows.append(_in_own_process(name, args))
        print(f"{name}: {'error' if 'error' in rows[-1] else 'measured'}", flush=True)
        write_partial(result, args.out, "decoder")
    baseline = rows[0]
    if "error" in baseline:
        raise SystemExit(f"the BF16 baseline failed, so nothing can be compared: {baseline['error']}")
    result["layers"] = baseline["layers_built"]
    add_ratios(rows)
    return report(result, args.out, "decoder", summary)


def add_ratios(rows: list[dict]) -> None:
    """Each measured row over BF16's (``rows[0]``), and its training step over :data:`SAME_GRAPHS_BF16`'s where
    that was measured: the same graphs with every site in BF16, so the ratio is what FP8 itself gains."""
    baseline = rows[0]
    same_graphs = next((r for r in rows if r["contestant"] == SAME_GRAPHS_BF16 and "error" not in r), None)
    for row in (r for r in rows if "error" not in r):
        row["train_speedup_vs_bf16_compile"] = row["train_tokens_per_s"] / baseline["train_tokens_per_s"]
        if "prefill_tokens_per_s" in row and "prefill_tokens_per_s" in baseline:
            row["prefill_speedup_vs_bf16_compile"] = row["prefill_tokens_per_s"] / baseline["prefill_tokens_per_s"]
        row["compile_cold_vs_bf16"] = row["compile_cold_s"] / baseline["compile_cold_s"]
        row["saved_vs_bf16"] = row["saved_gb"] / baseline["saved_gb"]
        if same_graphs is not None:
            row["train_speedup_vs_fp8graph_bf16"] = row["train_tokens_per_s"] / same_graphs["train_tokens_per_s"]


def summary(result: dict) -> str:
    rows = [[r["contestant"], f"{r['train_tokens_per_s']:.0f}", f"{r['train_speedup_vs_bf16_compile']:.2f}x",
             _number(r, "train_speedup_vs_fp8graph_bf16", "{:.2f}x"),
             _number(r, "prefill_tokens_per_s", "{:.0f}"), _number(r, "prefill_speedup_vs_bf16_compile", "{:.2f}x"),
             "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}",
             f"{r['saved_gb']:.3g}", f"{r['compile_cold_s']:.1f}", f"{r['compile_warm_s']:.1f}"]
            for r in result["rows"] if "error" not in r]
    columns = ["contestant", "train tokens/s", "vs bf16", "vs fp8graph bf16", "prefill tokens/s", "vs bf16", "peak GB",
               "saved for backward GB", "compile cold s", "warm s"]
    # Layers as built; results stored before rows recorded them asked for --layers but built the config's 2.
    built = {row["layers_built"] for row in result["rows"] if "layers_built" in row}
    layers = f", {built.pop()} layers" if len(built) == 1 else ""
    micro_batches = result.get("grad_accumulation", 1)
    heading = (f"Llama decoder stack ({result['config']}{layers}, batch {result['batch']}, "
               f"sequence {result['sequence']}" + (f", {micro_batches} micro-batches a step" if micro_batches > 1
                                                    else "") + ")")
    return "\n".join([title(heading, result), "", *markdown_table(columns, rows), *failed(result["rows"]),
                      *failed(result["rows"], "prefill_error", " prefill"), *_profile_tables(result["rows"])])


def _profile_tables(rows: list[dict]) -> list[str]:
    """Kernel time per training step by category, one column per contestant, then each one's top kernels."""
    profiled = [row for row in rows if "profile" in row]
    if not profiled:
        return []
    timed = profiled[0]["profile"]["timed"]
    lines = ["", f"Where a training step's time goes, ms per step ({timed}):", ""]
    table = [[name, *(f"{row['profile']['by_category_ms'][name]:.2f}" for row in profiled)] for name in CATEGORIES]
    table.append(["total", *(f"{row['profile']['total_ms']:.2f}" for row in profiled)])
    lines += markdown_table(["category", *(row["contestant"] for row in profiled)], table)
    for row in profiled:
        lines += ["", f"Top kernels, {row['contestant']}:", ""]
        lines += markdown_table(["kernel", "ms per step", "calls per step"],
                                [[name[:100], f"{ms:.2f}", f"{calls:g}"] for name, ms, calls in row["profile"]["top"][:10]])
    return lines


def _number(row: dict, key: str, form: str) -> str:
    return form.format(row[key]) if key in row else "-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="the tiny Llama on CPU, for the tests")
    parser.add_argument("--config", choices=CONFIGS, default="bench-8b-layer",
                        help="Llama-3-8B layers (bench-8b-layer) or the whole Llama-3-8B (llama3-8b)")
    parser.add_argument("--layers", type=positive(int), default=None, help="decoder layers to build (default: the config's)")
    parser.add_argument("--contestants", nargs="+", metavar="NAME",
                        help="run these (and the BF16 baseline) only, e.g. current 'torchao tensorwise'; "
                             "default: all available")
    parser.add_argument("--repeats", type=positive(int), default=20)
    parser.add_argument("--profile", action="store_true", help="also profile training steps: kernel time by category")
    parser.add_argument("--skip-prefill", action="store_true", help="training only (a GPU call's time is bounded)")
    parser.add_argument("--grad-accumulation", type=positive(int), default=1, metavar="N",
                        help="micro-batches a training step (fp8graph's declared unchanged: fp8graph.weights_unchanged)")
    parser.add_argument("--contestant-timeout", type=positive(float), default=900, help="seconds one contestant may take")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    parser.add_argument("--one", metavar="NAME", help=argparse.SUPPRESS)  # a child process's contestant
    parser.add_argument("--row-file", type=pathlib.Path, help=argparse.SUPPRESS)
