"""Timing and the environment record every result file carries."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import time
import traceback
from typing import Callable

import torch

from .targets import judge, verdict_table


def environment(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        # The code measured: the commit the device call passes (its copy of the tree has no git history), else
        # this checkout's.
        "project_commit": os.environ.get("FP8GRAPH_COMMIT") or project_commit(),
    }


def project_commit() -> str:
    """This checkout's commit, with ``+changes`` when its code (the package, the passes, the models, the
    benchmarks) differs from the working tree's, which is what a run measures or models; empty without git."""
    code = ["fp8graph", "passes", "models", "bench", ":!bench/results"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *code],
                                 capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return ""
    return f"{commit}+changes" if commit and changed else commit


def time_ms(step: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``step`` after ``warmup`` calls.

    CUDA: one pair of events around each call, read after a final sync.
    CPU: ``perf_counter`` around each call.
    """
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        timings.append((time.perf_counter() - start) * 1e3)
    return timings


class NotCompiled(RuntimeError):
    """A compiled contestant that ran eagerly, recompiled while timed, or put nothing in FP8."""


def time_compiled(step: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """:func:`time_ms` of a step that runs a ``torch.compile``-d contestant compiled alone.

    Call it after ``torch._dynamo.reset()`` and before compiling anything
    else. Every contestant compiling the same code (``Linear.forward``) in one
    process, once an H100 run took the 9th past Dynamo's recompile limit and
    timed it running eagerly (torchao at 0.37-0.48x BF16 there, 1.57x alone).
    Here hitting the limit during warm-up raises, a warm-up that compiled no
    frame raises, and a recompile while timed raises: each is recorded as the
    contestant's error, never as a number.
    """
    from torch._dynamo.utils import counters

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(max(warmup, 1)):
            step()
    if counters["frames"]["ok"] == 0:
        raise NotCompiled("the warm-up compiled no frame: the contestant ran eagerly")
    with torch.compiler.set_stance("fail_on_recompile"):
        return time_ms(step, device, 0, repeats)


def accumulated_step(compiled: object, micro_batch: Callable[[], object], update: Callable[[], object],
                     micro_batches: int) -> Callable[[], None]:
    """One training step: ``micro_batches`` forward + backward calls (``micro_batch``), then ``update`` (the
    optimizer step). An fp8graph contestant's micro-batches are declared to see the same weights
    (``fp8graph.weights_unchanged``), as its users write gradient accumulation: the first casts the weights and
    keeps the casts, the others read them; one micro-batch casts per call, as outside a declaration."""
    import contextlib

    def step() -> None:
        declared = contextlib.nullcontext()
        if micro_batches > 1 and hasattr(compiled, "fp8graph_backend"):
            import fp8graph

            declared = fp8graph.weights_unchanged(compiled)
        with declared:
            for _ in range(micro_batches):
                micro_batch()
        update()
    return step


def last_weight_cast_mode(compiled: object) -> str | None:
    """What an fp8graph contestant's last call did with its weights' casts (``"per call"``, ``"fill"``, ``"reuse"``:
    ``fp8graph.buffers.weight_cache``), None for another contestant: a result says whether its micro-batches
    shared the casts."""
    cache = getattr(getattr(compiled, "fp8graph_backend", None), "weight_cache", None)
    return None if cache is None else cache.mode


def require_fp8_sites(compiled: object) -> None:
    """Raise unless fp8graph put a site of ``compiled`` (an fp8graph contestant, once called) in FP8.

    On a device without a recipe's FP8 GEMM every site stays in high precision
    (``fp8graph.gemm.scaled_gemm``): timing it would report BF16's speed under the recipe's name.
    Contestants that are not fp8graph's pass.
    """
    backend = getattr(compiled, "fp8graph_backend", None)
    if backend is None:
        return
    if not any(decision.rewritten for decision in backend.decisions):
        reasons = sorted({decision.reason for decision in backend.decisions})
        raise NotCompiled(f"no site in FP8 on this device: {'; '.join(reasons) or 'no site found'}")


def attempt(row: dict, measure: Callable[[], dict]) -> dict:
    """``row`` updated with ``measure()``'s numbers, or with the error that stopped it.

    One contestant that fails (an unsupported shape, out of memory) must not
    lose a GPU run's other timings: the error is printed, kept in the row and
    shown in the summary, and the targets skip the row.
    """
    try:
        return {**row, **measure()}
    except Exception as error:  # noqa: BLE001 - any failure is recorded, never dropped
        traceback.print_exc()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {**row, "error": f"{type(error).__name__}: {error}"[:2000]}


def failed(rows: list[dict], key: str = "error", what: str = "") -> list[str]:
    """Summary lines of the rows whose measurement (or the part ``what`` of it, under ``key``) failed."""
    return [f"- {r['contestant']}{_shape(r)}{what} failed: {r[key].splitlines()[0]}" for r in rows if key in r]


def _shape(row: dict) -> str:
    return f" at {row['M']}x{row['K']}x{row['N']}" if "M" in row else ""


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_result(result: dict, out_dir: pathlib.Path, name: str) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = result["environment"]["date"].replace(":", "").replace("+0000", "Z")
    path = out_dir / f"{name}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def write_partial(result: dict, out_dir: pathlib.Path, name: str) -> None:
    """Write the rows measured so far, marked incomplete, to the file :func:`report` completes.

    A GPU call stopped at its time limit then still leaves what it measured.
    """
    write_result({**result, "complete": False}, out_dir, name)


def report(result: dict, out_dir: pathlib.Path, name: str, summary: Callable[[dict], str]) -> dict:
    """Judge ``result`` against the targets, write it as raw JSON, print its summary and where the JSON went."""
    result["complete"] = True
    result["targets"] = judge(result)
    path = write_result(result, out_dir, name)
    print(with_verdicts(summary(result), result))
    print(f"raw results: {path}")
    return result


def with_verdicts(summary_text: str, result: dict) -> str:
    """The summary followed by the table of its targets' verdicts, if the workload has targets."""
    if not result.get("targets"):
        return summary_text
    columns = ["target", "case", "measured", "bound", "verdict"]
    caveat = " (smoke run: not meaningful)" if result["smoke"] else ""
    return "\n".join([summary_text, "", f"Targets{caveat}:", "",
                      *markdown_table(columns, verdict_table(result["targets"]))])


def title(what: str, result: dict) -> str:
    """The summary's first line: what ran, on which device and versions, when."""
    env = result["environment"]
    smoke = " (smoke: timings not meaningful)" if result["smoke"] else ""
    return f"{what} on {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}{smoke}"


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a Markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
