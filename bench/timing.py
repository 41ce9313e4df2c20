"""Timing and the environment record every result file carries."""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import statistics
import time
from typing import Callable

import torch


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
    }


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


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_result(result: dict, out_dir: pathlib.Path, name: str) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = result["environment"]["date"].replace(":", "").replace("+0000", "Z")
    path = out_dir / f"{name}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def report(result: dict, out_dir: pathlib.Path, name: str, summary: Callable[[dict], str]) -> dict:
    """Write ``result`` as raw JSON, print its Markdown summary and where the JSON went."""
    path = write_result(result, out_dir, name)
    print(summary(result))
    print(f"raw results: {path}")
    return result


def title(what: str, result: dict) -> str:
    """The summary's first line: what ran, on which device and versions, when."""
    env = result["environment"]
    smoke = " (smoke: timings not meaningful)" if result["smoke"] else ""
    return f"{what} on {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}{smoke}"


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a Markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
