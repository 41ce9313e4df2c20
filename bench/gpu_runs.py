"""The record of the GPU runs whose raw results are in bench/results (``gpu-runs.json``): which file, which device
and torch, which fp8graph commit ran, which contestants it measured and which failed. ``bench model calibrate``
models each run at its commit, ``bench model compare`` names the commit a measurement ran, and the tests hold the
record to the files (``tests/bench/test_gpu_runs.py``)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
RECORD = "gpu-runs.json"


@dataclasses.dataclass(frozen=True)
class GPURun:
    file: str  # the raw result, in bench/results
    workload: str  # moe, moe-decode, decoder, linear, quantize
    device: str  # as torch.cuda.get_device_name gave it
    torch: str
    commit: str  # the fp8graph commit whose tree ran
    logs: str  # the run's folder of logs and profiles, in bench/results
    contestants: tuple[str, ...]  # measured
    failed: tuple[str, ...]  # an error row each
    note: str

    @property
    def gpu(self) -> str:
        """``"H100"`` or ``"H200"``: the name ``fp8graph.costs.gpus`` knows the device by."""
        return gpu_name(self.device)

    def measured(self, results: pathlib.Path = RESULTS) -> dict:
        return json.loads((results / self.file).read_text())


def gpu_name(device: str) -> str | None:
    """The name ``fp8graph.costs.gpus`` knows a device by (``"H200"`` of ``"NVIDIA H200"``), ``None`` if none."""
    return next((name for name in ("H100", "H200", "B200") if name in device), None)


def gpu_runs(results: pathlib.Path = RESULTS) -> list[GPURun]:
    """Every recorded run, oldest first."""
    record = json.loads((results / RECORD).read_text())
    return [GPURun(**{**run, "contestants": tuple(run["contestants"]), "failed": tuple(run["failed"])})
            for run in record["runs"]]


def run_of(file: str, results: pathlib.Path = RESULTS) -> GPURun | None:
    """The recorded run of the raw result named ``file`` (a name in bench/results), or ``None``."""
    return next((run for run in gpu_runs(results) if run.file == pathlib.Path(file).name), None)
