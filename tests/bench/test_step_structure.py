"""The structure of the sm_90 code Inductor generates for bench decoder's training step, pinned.

    4 Llama-3-8B layers, vocabulary 32000, batch 1 x 4096 tokens, forward + backward (bench.costmodel)

Each contestant is compiled for a fake H100 as ``python -m bench model decoder`` does (the four one after
another in one child process, ``bench.model.run_children``), and its kernels are read, never run. Bytes,
launches, duplicated stores and register spills are facts of the generated code, the same on any machine
for the pinned torch and triton, so a fusion that regresses fails here. What this does not prove: time on a
GPU (``bench decoder`` measures it; the model estimates it, docs/cost-model.md says how well).

Budgets are the modelled result committed in bench/results/ (``BUDGET_SOURCE``) plus 1%: an
improvement passes, and its commit lowers the budget.
"""

import json

import pytest

from bench import model as bench_model
from bench.costmodel import costs, site_casts
from fp8graph.costs.casts import CAST_TRAFFIC

BUDGET_SOURCE = "bench/results/model-decoder-2026-11-30T222913Z.json"
# Per contestant: launches (Triton kernels and custom ops) and Triton GB (read + written) per step of one
# micro-batch, and FP8 GB stored twice. Delayed scaling's launches include a tiny kernel a call laying its GEMMs'
# scales out 16 bytes apart (cuBLASLt's rule: fp8graph.gemm.scaled_gemm.scalars_of). Every recipe casts each weight's
# transposed copy again in the backward by default (recipe.save_transposes), and each input's (block's on CUDA by
# fp8graph's kernel, from the RMSNorm's and SwiGLU's outputs made again in the backward: more launches and bytes
# than keeping the copies from the forward, and 0.43 GB less saved). Sites that read one input (q, k
# and v; gate and up) are one call for every recipe (passes/group_sites.py), so each shared input is cast once
# in each layout, forward and backward: row-wise's backward stored one FP8 tensor twice (0.20 GB) while tiled
# sites did not group.
BUDGETS = {
    "current": {"launches": 298, "gb": 24.045, "fp8_stored_twice_gb": 0.0},
    "delayed": {"launches": 325, "gb": 17.154, "fp8_stored_twice_gb": 0.0},
    "rowwise": {"launches": 274, "gb": 23.853, "fp8_stored_twice_gb": 0.0},
    "block": {"launches": 343, "gb": 12.040, "fp8_stored_twice_gb": 0.0},
}
SLACK = 1.01


def _modelled_steps() -> tuple[dict, dict]:
    """Each contestant's summary and rows of bench decoder's step, modelled one after another in one child
    process with every Triton config compiled to an sm_90 cubin, or found in the findings of an earlier compile
    of the same source by the same toolchain (bench/costmodel/sm90_cubin_facts.json: a kernel this version
    changed is compiled here); and the rows of its bench linear step at fp8graph.costs.casts's shape, in the
    same process."""
    spec = {"workload": "decoder", "config": "bench-8b-layer", "batch": 1, "sequence": 4096, "overrides": {},
            "cubin": True}
    specs = [{**spec, "contestant": c} for c in BUDGETS] + [site_casts.linear_spec(c) for c in bench_model.CAST_TABLE]
    results = bench_model.kept_children(1200)(specs)
    steps, linears = {}, {}
    for spec, result in zip(specs, results):
        assert "error" not in result, (spec["contestant"], result["error"])
        costs.summarize([result], costs.Machine())
        (case,) = result["cases"]
        (linears if spec["workload"] == "linear" else steps)[spec["contestant"]] = case
    return steps, linears


def _structure_failures(contestant: str, step: dict) -> list[str]:
    summary, budget = step["summary"], BUDGETS[contestant]
    failures = []
    stored_twice = summary["duplicate_written_gb"]
    if stored_twice > budget["fp8_stored_twice_gb"] + 1e-9:
        failures.append(f"FP8 GB stored twice: {stored_twice}")
    launches = summary["triton_launches"] + summary["other_externs"]
    if launches > budget["launches"] * SLACK:
        failures.append(f"launches: {launches}")
    gb = summary["triton_read_gb"] + summary["triton_written_gb"]
    if gb > budget["gb"] * SLACK:
        failures.append(f"Triton GB: {gb}")
    configs = [(row["name"], config) for row in step["rows"] for config in row.get("cubin") or ()]
    kernels = {row["name"] for row in step["rows"] if row["kind"] == "triton"}
    if {name for name, _ in configs} != kernels:
        failures.append(f"Triton kernels not compiled to a cubin: {sorted(kernels - {n for n, _ in configs})}")
    failed = [(name, config["config"], config.get("error")) for name, config in configs if config.get("error")]
    if failed:
        failures.append(f"Triton configs that did not build for sm_90: {failed}")
    spilled = [(name, config["config"], config["spill_bytes"]) for name, config in configs if config["spill_bytes"]]
    if spilled:
        failures.append(f"Triton configs that spill registers: {spilled}")
    return [f"{contestant}: {failure}" for failure in failures]


def test_the_modelled_step_keeps_its_structure():
    """For each contestant, three facts of the generated code, each failing with its own message:

    - No FP8 tensor stored twice: every FP8 tensor is written once per layout it is read in (q, k and v
      share their input's cast; a delayed cast is one buffer for its GEMM and its transposed copy).
      Row-wise: the backward still quantizes the shared input's transposed copy once per site
      (0.20 GB, docs/benchmarks.md), a known miss.
    - Launches (Triton kernels and custom ops) and Triton bytes within the budgets.
    - Each autotuning config of each Triton kernel compiles with Triton's ptxas for sm_90 and keeps its
      values in registers (what the interpreter, which runs the numerics tests, never checks).

    And the per-element traffic of each recipe's casts on one linear site, which fp8graph.costs (the
    modelled policy, explain's times) holds as a table: a change to the casts fails here until
    ``python -m bench model linear --casts`` has regenerated the table.

    One test for the four: their child process compiles each kernel they share once.
    """
    steps, linears = _modelled_steps()
    assert list(steps) == list(BUDGETS) and list(linears) == bench_model.CAST_TABLE
    failures = [failure for contestant, step in steps.items() for failure in _structure_failures(contestant, step)]
    for contestant, case in linears.items():
        derived = site_casts.as_recipe_casts(site_casts.derive(case["rows"], *site_casts.SHAPE))
        if derived != CAST_TRAFFIC[contestant]:
            failures.append(f"{contestant}: the casts of a linear site are {derived}, fp8graph.costs.casts holds "
                            f"{CAST_TRAFFIC[contestant]}")
    assert failures == []


def test_the_budgets_are_the_committed_modelled_result():
    """The budgets above are what ``BUDGET_SOURCE`` records, so they cannot drift from the result they cite."""
    import pathlib

    result = json.loads((pathlib.Path(__file__).resolve().parents[2] / BUDGET_SOURCE).read_text())
    rows = {row["contestant"]: row for row in result["rows"]
            if "error" not in row and "micro-batches" not in row["case"]}  # one micro-batch a step
    for contestant, budget in BUDGETS.items():
        row = rows[contestant]
        assert budget["launches"] == row["triton_launches"] + row["other_externs"], contestant
        assert budget["gb"] == pytest.approx(row["triton_read_gb"] + row["triton_written_gb"], abs=0.005), contestant
        assert budget["fp8_stored_twice_gb"] >= row["duplicate_written_gb"], contestant


def test_a_kernel_in_the_cubin_facts_is_not_compiled_again(tmp_path, monkeypatch):
    """The facts are keyed by the kernel's source without its name and by the toolchain: the same kernel under
    another name is found, a changed one is compiled; a failed compile is never written."""
    from bench.costmodel import cubins

    compiled = []

    def compile_kernel(name, source):
        compiled.append(name)
        return [{"config": "XBLOCK=1024,w4,s1", "regs": 16, "spill_bytes": 0}] if "ok" in source else \
            [{"config": "?", "error": "RuntimeError: ptxas", "regs": None, "spill_bytes": None}]

    monkeypatch.setattr(cubins, "compile_kernel", compile_kernel)
    path = tmp_path / "facts.json"
    first = cubins.CubinFacts(path)
    first.configs("triton_poi_0", "def triton_poi_0(): ok")
    first.configs("triton_poi_1", "def triton_poi_1(): fails")
    assert compiled == ["triton_poi_0", "triton_poi_1"]
    assert first.write(first.new) == 1  # the failed one is left out

    again = cubins.CubinFacts(path)
    assert again.configs("triton_poi_7", "def triton_poi_7(): ok")[0]["regs"] == 16  # another name, found
    again.configs("triton_poi_0", "def triton_poi_0(): ok, changed")
    again.configs("triton_poi_1", "def triton_poi_1(): fails")
    assert compiled[2:] == ["triton_poi_0", "triton_poi_1"] and len(again.new) == 2
    monkeypatch.setattr(cubins, "toolchain", lambda: "another triton")
    assert cubins.CubinFacts(path).configs("triton_poi_7", "def triton_poi_7(): ok") and len(compiled) == 5
