"""The record of the GPU runs (bench/results/gpu-runs.json, ``bench.gpu_runs``): every measured raw result in
bench/results is recorded, and the record says what the file says (device, torch, contestants measured and
failed), names a commit of this repository and a folder of logs that exist."""

import json
import pathlib
import subprocess

from bench.gpu_runs import RESULTS, gpu_runs, run_of

ROOT = RESULTS.parents[1]


def _measured_files() -> list[pathlib.Path]:
    """The raw results a GPU wrote: bench/results/*.json neither modelled nor run on a CPU."""
    files = []
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict) and "rows" in result and not result.get("modelled") \
                and result.get("environment", {}).get("device", "cpu") not in ("cpu", "x86_64", ""):
            files.append(path)
    return files


def test_every_gpu_result_is_recorded_as_its_file_says():
    runs = {run.file: run for run in gpu_runs()}
    measured = _measured_files()
    assert measured and sorted(runs) == sorted(path.name for path in measured)
    for path in measured:
        run, result = runs[path.name], json.loads(path.read_text())
        assert (run.device, run.torch) == (result["environment"]["device"], result["environment"]["torch"]), path.name
        rows = [row for row in result["rows"] if row.get("contestant")]
        assert run.contestants == tuple(row["contestant"] for row in rows if "error" not in row), path.name
        assert run.failed == tuple(row["contestant"] for row in rows if "error" in row), path.name
        assert path.name.startswith(run.workload + "-2026") and (RESULTS / run.logs).is_dir(), path.name
        assert run.gpu in ("H100", "H200")
        recorded_commit = result["environment"].get("project_commit")
        assert recorded_commit in (None, run.commit), path.name  # newer runs record it themselves


def test_every_recorded_commit_is_in_the_repository():
    for commit in {run.commit for run in gpu_runs()}:
        found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
        assert found.returncode == 0, f"{commit} is not a commit of this repository"


def test_a_run_is_found_by_its_file_name():
    assert run_of("bench/results/moe-2026-11-27T132818Z.json").commit == "ec8f139"
    assert run_of("model-moe-2026-11-27T114341Z.json") is None
