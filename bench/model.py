"""Modelled on a CPU-only machine: an H100 training step from the sm_90 kernels Inductor generates for it.

    python -m bench model decoder [--config llama3-8b] [--contestants ...]   bench decoder's step
    python -m bench model moe [--config bench] [--tokens 4096] [--contestants ...]   bench moe's MoE block step
    python -m bench model linear [--shape M,K,N ...]                         bench linear's step
    python -m bench model quantize [--all]                                   the H100 quantize probe's casts
    python -m bench model calibrate [--only SECTION ...]                     the model against the stored H100 runs
    python -m bench model compare bench/results/decoder-....json             a GPU run beside the modelled step
                                                                             (decoder-*.json or moe-*.json)

Nothing runs on a GPU. Each contestant (``bench decoder``'s: BF16, fp8graph per recipe, torchao) is
compiled in a child process of its own for a fake H100 (``bench.costmodel``); every Triton kernel,
cuBLAS / cuDNN call and custom op of the step is captured with its bytes and FLOPs, and
``bench.costmodel.costs`` turns them into time. Results are Markdown and raw JSON under bench/results/
(``model-<workload>-<date>.json``), marked ``"modelled": true``, never mistakable for a measurement;
``python -m bench show`` prints them again, judged against the modelled targets (``bench.targets``).
What the model can be trusted for, and how it was checked: docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from . import gpu_runs
from .cli import contestants_of, positive
from .costmodel import calibration, captures, costs, cubins, peak_memory, site_casts
from .targets import judge
from .timing import markdown_table, project_commit, with_verdicts, write_result

DEVICES = {"H100": "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)", "H200": "NVIDIA H200 (sm_90, 132 SMs)"}
FP8GRAPH = ["current", "delayed", "rowwise", "block"]
# The recipes whose casts fp8graph.costs holds a table of: the presets, and each with its transposes saved for the
# backward (recipe.save_transposes), whose casts differ.
CAST_TABLE = [*FP8GRAPH, *(f"{name} saved-transposes" for name in FP8GRAPH)]
TORCHAO = ["torchao tensorwise", "torchao rowwise"]


# --- child processes ---------------------------------------------------------------------------------------

def run_child(spec: dict, timeout: float, verbose: bool = False, env: dict | None = None) -> dict:
    """``bench.costmodel.workloads.run(spec)`` in a fresh process; a crash, error or timeout comes back as
    ``{"error": ...}``. Its Inductor and Triton caches are private and removed: nothing compiled for the
    fake sm_90 reaches the user's caches, and no cache hit can skip the capture."""
    (result,) = _run_process(spec, [spec], timeout, verbose, env)
    return result


def run_children(specs: list[dict], timeout: float, env: dict | None = None) -> list[dict]:
    """As :func:`run_child` for each of ``specs``, one after another in one fresh process (Dynamo reset
    between them; the captures are those of a process each): what the tests use, saving each process's
    start (``timeout`` is per spec). torchao's contestants still get a process each: converting a model
    patches Inductor for the rest of the process."""
    alone = [i for i, spec in enumerate(specs) if spec.get("contestant", "").startswith("torchao")]
    together = [i for i in range(len(specs)) if i not in alone]
    results: list[dict] = [{} for _ in specs]
    batch = [specs[i] for i in together]
    for i, result in zip(together, _run_process(batch, batch, timeout * len(batch), False, env) if batch else []):
        results[i] = result
    for i in alone:
        results[i] = run_child(specs[i], timeout, env=env)
    return results


def _run_process(payload, specs: list[dict], timeout: float, verbose: bool, env: dict | None) -> list[dict]:
    labels = [spec.get("contestant", spec["workload"]) for spec in specs]
    with tempfile.TemporaryDirectory(prefix="costmodel-") as scratch:
        spec_file, result_file = os.path.join(scratch, "spec.json"), os.path.join(scratch, "result.json")
        with open(spec_file, "w") as f:
            json.dump(payload, f)
        child_env = {**os.environ, **(env or {}), "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
                     "TRITON_CACHE_DIR": os.path.join(scratch, "triton")}
        command = [sys.executable, "-m", "bench.costmodel.child", spec_file, result_file]
        try:
            done = subprocess.run(command, env=child_env, text=True, timeout=timeout,
                                  stdout=None if verbose else subprocess.PIPE,
                                  stderr=None if verbose else subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            return [{"contestant": label, "error": f"timed out after {timeout:.0f} s"} for label in labels]
        if os.path.exists(result_file):
            with open(result_file) as f:
                result = json.load(f)
            return result if isinstance(payload, list) else [result]
        tail = "\n".join((done.stdout or "").strip().splitlines()[-15:])
        return [{"contestant": label, "error": f"the child process exited with code {done.returncode}\n{tail}"}
                for label in labels]


def kept_children(timeout: float) -> calibration.Runner:
    """:func:`run_children` serving the kept captures (``bench.costmodel.captures.kept``): what the tests that
    model a step run."""
    return captures.kept(lambda specs, env=None: run_children(specs, timeout, env=env))


def children(args) -> calibration.Runner:
    """Run specs one after another (a 2-core machine: never two compiles at once), saying how each went. What
    a ``--cubin`` child compiled for the first time is added to the cubin facts (bench.costmodel.cubins)."""
    def run(specs: list[dict], env: dict | None = None) -> list[dict]:
        results = []
        for spec in specs:
            started = time.time()
            result = run_child(spec, args.timeout, args.verbose, env)
            status = "error" if "error" in result else "modelled"
            new_facts = result.pop("cubin_facts_new", None)  # only a --cubin child's result has them
            added = cubins.CubinFacts().write(new_facts) if new_facts else 0
            print(f"  {spec.get('contestant', spec['workload'])}: {status} in {time.time() - started:.0f} s"
                  + (f", {added} kernels' cubin facts added to {cubins.FACTS_PATH.name}" if added else ""),
                  file=sys.stderr, flush=True)
            results.append(result)
        return results
    return run


# The rate options (TB/s or TFLOP/s), each a Machine field; unset, the --gpu's rate.
RATE_OPTIONS = {"bandwidth": "copy_bandwidth", "triton_bandwidth": "triton_bandwidth", "bf16_tflops": "bf16_flops",
                "fp8_tflops": "fp8_flops", "grouped_bf16_tflops": "grouped_bf16_flops",
                "grouped_fp8_tflops": "grouped_fp8_flops", "grouped_bf16_tflops_large": "grouped_bf16_flops_large",
                "grouped_fp8_tflops_large": "grouped_fp8_flops_large"}


def machine_of(args) -> costs.Machine:
    """The --gpu's rates, each rate option given replacing its own."""
    given = {field: getattr(args, option) * 1e12 for option, field in RATE_OPTIONS.items()
             if getattr(args, option) is not None}
    return dataclasses.replace(costs.Machine.of(args.gpu), **given)


# --- the result file ---------------------------------------------------------------------------------------

def _environment(results: list[dict], machine: costs.Machine) -> dict:
    versions = {}
    for result in results:  # a BF16 child never imports fp8graph: take every child's versions
        versions.update(result.get("versions", {}))
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": f"{DEVICES[machine.gpu]}, modelled", "torch": versions.get("torch"),
            "triton": versions.get("triton"), "versions": versions, "ran_on_gpu": False}


def build_result(workload: str, spec: dict, results: list[dict], machine: costs.Machine, what: str) -> dict:
    """The JSON a ``bench model`` run writes: per-contestant captures, and one summary row per (case,
    contestant) that the targets judge; ``summarize`` re-times the captures at ``machine``'s rates."""
    costs.summarize(results, machine)
    for result in results:
        for case in result.get("cases", []):
            if "memory" in case:
                memory = peak_memory.step_memory(case["memory"]["persistent"], case["memory"]["calls"],
                                                 case.get("micro_batches", 1))
                case["summary"].update(peak_gb=memory["peak_bytes"] / 1e9, saved_gb=memory["saved_bytes"] / 1e9)
    rows = []
    for result in results:
        if "error" in result:
            rows.append({"contestant": result["contestant"], "error": result["error"]})
        for case in result.get("cases", []):
            rows.append({"contestant": result["contestant"], "case": case["case"], "note": case.get("note", ""),
                         **case["summary"]})
    _add_ratios(rows)
    return {"workload": f"model_{workload}", "modelled": True, "what": what, "smoke": False,
            "environment": _environment(results, machine), "project_commit": project_commit(),
            "machine": dataclasses.asdict(machine), "spec": spec, "rows": rows, "captures": results}


def _add_ratios(rows: list[dict]) -> None:
    """Each row's step against BF16's and torchao's of the same case (above 1: this row is faster)."""
    step = {(row["case"], row["contestant"]): row["step_ms"] for row in rows if "error" not in row}
    for row in rows:
        if "error" in row:
            continue
        for baseline, key in (("bf16", "vs_bf16"), ("torchao tensorwise", "vs_torchao_tensorwise"),
                              ("torchao rowwise", "vs_torchao_rowwise"),
                              ("torchao moe rowwise", "vs_torchao_moe_rowwise")):
            base = step.get((row["case"], baseline))
            if base:
                row[key] = base / row["step_ms"]
        bf16 = next((r for r in rows if r.get("case") == row["case"] and r["contestant"] == "bf16"), None)
        if bf16 and _launches(bf16):
            row["launches_vs_bf16"] = _launches(row) / _launches(bf16)
        for column in ("peak_gb", "saved_gb", "outside_gemm_gb"):
            if bf16 and bf16.get(column) and column in row:
                row[f"{column.removesuffix('_gb')}_vs_bf16"] = row[column] / bf16[column]


def _launches(row: dict) -> int:
    """Kernel launches besides the GEMMs and attention: Inductor's Triton kernels, the custom ops' (fp8graph's
    transpose, tiled quantize and state update) and memsets, so that moving work into an op hides nothing."""
    return row["triton_launches"] + row.get("other_externs", 0)


def write(result: dict, out: pathlib.Path) -> pathlib.Path:
    result["complete"] = True
    result["targets"] = judge(result)
    path = write_result(result, out, result["workload"].replace("_", "-"))
    print(with_verdicts(summary(result), result))
    print(f"raw results (modelled): {path}")
    return path


# --- the summary -------------------------------------------------------------------------------------------

def title(result: dict) -> str:
    env = result["environment"]
    named = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items())
    commit = result.get("project_commit")
    device = env["device"].removesuffix(", modelled")
    return (f"**{result['what']}**: MODELLED for one {device} on a CPU-only machine (Inductor generated "
            f"every kernel for sm_90; nothing ran on a GPU), {named}" + (f", project at {commit}" if commit else "")
            + f", {env['date']}.")


def summary(result: dict) -> str:
    """The table of a stored ``bench model`` result (``bench show`` prints it)."""
    machine = costs.Machine(**result["machine"])
    rows = result["rows"]
    if result["workload"] == "model_quantize":
        table = _quantize_table(result, machine)
    else:
        table = _step_table(rows, machine, digits=3 if result["workload"] == "model_linear" else 2,
                            optimizer=result["workload"] in ("model_decoder", "model_moe"),
                            attention=result["workload"] != "model_moe")
    notes = list(dict.fromkeys(f"- {row['contestant']}: {row['note']}" for row in rows if row.get("note")))
    errors = [f"- **{row['contestant']}: not modelled.** {row['error'].strip().splitlines()[0][:300]}"
              for row in rows if "error" in row]
    return "\n".join([title(result), "", *table, *([""] + notes if notes else []), *([""] + errors if errors else []),
                      "", _legend(machine)])


def _step_table(rows: list[dict], machine: costs.Machine, digits: int, optimizer: bool,
                attention: bool = True) -> list[str]:
    """One row per (case, contestant); a MoE block has no attention column, and a ``vs torchao ...`` column
    appears for each torchao baseline the run has (tensorwise for the decoder, the MoE one for moe)."""
    entries = [row for row in rows if "error" not in row]
    several = len({row["case"] for row in entries}) > 1
    memory = any("peak_gb" in row for row in entries)
    baselines = [(key, name) for key, name in (("vs_torchao_tensorwise", "vs torchao tensorwise"),
                                               ("vs_torchao_moe_rowwise", "vs torchao moe rowwise"))
                 if any(key in row for row in entries)]
    columns = (["case"] if several else []) + [
        "contestant", "Triton launches (distinct)", "custom-op launches", "Triton GB read", "GB written",
        "GB outside GEMMs", "FP8 GB stored twice", "scattered GB",
        "tiny launches", f"Triton ms @{machine.copy_bandwidth / 1e12:.2f} TB/s",
        f"Triton ms @{machine.triton_bandwidth / 1e12:.2f} TB/s", "GEMM ms", *(["attention ms"] if attention else []),
        "other extern ms", *(["SGD ms"] if optimizer else []), "step ms", "vs bf16", *(name for _, name in baselines),
        *(["peak GB", "saved GB"] if memory else [])]
    f = f"{{:.{digits}f}}".format
    table = []
    for s in entries:
        table.append(([s["case"]] if several else []) + [
            s["contestant"], f"{s['triton_launches']} ({s['triton_kernels']})", str(s.get("other_externs", 0)),
            f(s["triton_read_gb"]),
            f(s["triton_written_gb"]), _gb(s, "outside_gemm_gb", "outside_gemm_vs_bf16"),
            f(s["duplicate_written_gb"]), f(s.get("triton_scattered_gb", 0.0)),
            str(s["tiny_launches"]), f(s["triton_ms_copy"]),
            f(s["triton_ms"]), f(s["gemm_ms"]), *([f(s["attention_ms"])] if attention else []), f(s["other_ms"]),
            *([f(s["optimizer_ms"])] if optimizer else []), f(s["step_ms"]), _ratio(s, "vs_bf16"),
            *(_ratio(s, key) for key, _ in baselines),
            *([_gb(s, "peak_gb", "peak_vs_bf16"), _gb(s, "saved_gb", "saved_vs_bf16")] if memory else [])])
    return markdown_table(columns, table)


def _ratio(row: dict, key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def _gb(row: dict, key: str, ratio: str) -> str:
    """``1.23 (0.95x)``: GB, and over BF16's where the run has BF16."""
    if key not in row:
        return "-"
    return f"{row[key]:.2f}" + (f" ({row[ratio]:.2f}x)" if ratio in row else "")


def _quantize_table(result: dict, machine: costs.Machine) -> list[str]:
    table = []
    for capture in result["captures"]:
        for case in capture.get("cases", []):
            s = case["summary"]
            kernels = sum(r.count for r in costs.rows_from_json(case) if r.kind != "memset")
            table.append([case["case"], str(kernels), f"{s['triton_read_gb'] * 1e3:.1f}",
                          f"{s['triton_written_gb'] * 1e3:.1f}", f"{s['duplicate_written_gb'] * 1e3:.1f}",
                          f"{(s['triton_ms_copy'] + s['other_ms']) * 1e3:.0f}", f"{s['step_ms'] * 1e3:.0f}"])
    return markdown_table(["case", "kernels", "MB read", "MB written", "FP8 MB stored twice",
                           f"us @{machine.copy_bandwidth / 1e12:.2f} TB/s",
                           f"us @{machine.triton_bandwidth / 1e12:.2f} TB/s"], table)


def _legend(m: costs.Machine) -> str:
    return (f"Modelled, per step. Triton: Inductor's kernels, launches (distinct kernels) and GB as Inductor counts "
            f"them; FP8 GB stored twice: writes of a value already stored at the same index in another buffer; "
            f"scattered: DRAM bytes beyond those of pointwise stores a row apart (a 32-byte sector read and written "
            f"back an element); tiny: launches under 0.1 MB. Triton ms at a copy's bandwidth and at the rate "
            f"Inductor's kernels reached on the {m.gpu} ({m.triton_bandwidth / 1e12:.2f} TB/s, its FP8 casts at "
            f"{m.cast_fraction:.2f} of it), at least {m.launch_floor_us:.0f} us a launch. GEMM: cuBLAS at "
            f"{m.bf16_flops / 1e12:.0f} (BF16), {m.fp8_flops / 1e12:.0f} (FP8 tensorwise), "
            f"{m.fp8_rowwise_flops / 1e12:.0f} (rowwise), {m.fp8_blockwise_flops / 1e12:.0f} (blockwise) TFLOP/s, "
            f"grouped {m.grouped_bf16_flops / 1e12:.0f}-{m.grouped_bf16_flops_large / 1e12:.0f} (BF16), "
            f"{m.grouped_fp8_flops / 1e12:.0f}-{m.grouped_fp8_flops_large / 1e12:.0f} (FP8 rowwise) from 512 to "
            "2048 tokens a group; "
            f"attention: cuDNN SDPA at {m.attention_flops / 1e12:.0f} TFLOP/s; other extern: custom ops, operand "
            f"bytes at copy bandwidth (fp8graph's transposed stores at {m.transposed_store_fraction:.2f} of it, a "
            "gathering op's rows as gathered, the delayed record by its loop steps, segment_reduce as measured); "
            f"SGD: bench decoder's eager p.add_(p.grad). step ms: Triton at the {m.gpu}'s rate "
            "plus the rest, kernel time only (no CPU or launch overhead). vs: the baseline's step ms over this "
            "one's. Peak GB: the step's most memory allocated at once, replayed from the allocations of the "
            "wrappers Inductor generated, on top of the parameters, buffers and inputs (not the allocator's "
            "rounding or workspaces); saved GB: the activations the backward receives (the step's inputs "
            "excluded). Differences in bytes, launches and structure are facts of the generated code; a few "
            "percent of time are not (docs/cost-model.md).")


def top_kernels(result: dict, n: int) -> list[str]:
    """The ``n`` largest memory-bound kernels (Triton, custom ops) per contestant, by bytes per step; a kernel
    launched several times by one graph is one line."""
    machine = costs.Machine(**result["machine"])
    lines = []
    for capture in result["captures"]:
        for case in capture.get("cases", []):
            kernels: dict[tuple, list] = {}
            for r in costs.rows_from_json(case):
                if r.kind in ("triton", "extern"):
                    kernels.setdefault((r.graph, r.name, r.bytes), [r, 0])[1] += r.count
            largest = sorted(kernels.values(), key=lambda e: -e[0].bytes * e[1])[:n]
            table = [[r.graph, str(count), f"{r.bytes / 1e6:.1f}", f"{r.bytes * count / 1e9:.3f}",
                      f"{costs.time_us(r, machine, machine.triton_bandwidth) * count:.0f}",
                      r.kind if r.kind == "triton" else "custom op", r.detail[:60], f"`{r.name}`"]
                     for r, count in largest]
            lines += ["", f"Largest kernels, {capture['contestant']} ({case['case']}), by bytes per step:", "",
                      *markdown_table(["graph", "launches", "MB a launch", "GB a step", "us a step", "kind", "detail",
                                       "name"], table)]
    return lines


def cubin_lines(result: dict) -> list[str]:
    lines = []
    for capture in result["captures"]:
        for case in capture.get("cases", []):
            compiled = [r for r in case["rows"] if r.get("cubin")]
            if compiled:
                lines += ["", f"sm_90 cubins, {capture['contestant']} ({case['case']}), per autotuning config:"]
            for row in compiled:
                lines.append(f"- `{row['name']}`")
                for c in row["cubin"]:
                    access = " ".join(f"{k.replace(' ', '')}x{v}" for k, v in sorted(c.get("access", {}).items()))
                    lines.append(f"    - {c['config']}: " + (c["error"] if c.get("error") else
                                 f"{c['regs']} registers, {c['spill_bytes']} B spilled, {access}"))
    return lines


# --- commands ----------------------------------------------------------------------------------------------

def _finish(result: dict, args) -> dict:
    write(result, args.out)
    extra = (top_kernels(result, args.top) if args.top else []) + cubin_lines(result)
    if extra:
        print("\n".join(extra))
    return result


def model_decoder(args) -> dict:
    import importlib.util

    from .auto_policy import AUTO
    from .decoder import parse_contestant

    default = FP8GRAPH + (TORCHAO if importlib.util.find_spec("torchao") else [])
    contestants = contestants_of(args.contestants, default, parse_contestant)
    spec = {"workload": "decoder", "config": args.config, "batch": args.batch, "sequence": args.sequence,
            "overrides": {} if args.layers is None else {"num_hidden_layers": args.layers},
            "source": args.source, "cubin": args.cubin, "grad_accumulation": args.grad_accumulation}
    print(f"decoder ({args.config}{f', {args.layers} layers' if args.layers else ''}, {args.batch}x{args.sequence} "
          f"tokens): {len(contestants)} contestants, one process each", file=sys.stderr)
    # policies.auto() decides its sites at the rates of the --gpu named (a rate option given does not reach it).
    machine = machine_of(args)
    results = children(args)([{**spec, "contestant": c,
                               **({"policy_gpu": machine.gpu} if parse_contestant(c)[0] in AUTO else {})}
                              for c in contestants])
    accumulate(results, args.grad_accumulation)
    case = next((c["case"] for r in results for c in r.get("cases", [])), "")
    return _finish(build_result("decoder", spec, results, machine,
                                f"bench decoder's training step ({args.config}: {case})"), args)


def model_moe(args) -> dict:
    """bench moe's training step of one MoE block (models/moe.py), each contestant in a child process."""
    import importlib.util

    from .moe import AUTO, DEFAULT, FIRST_GEMM_ONLY, SWEEP, TORCHAO, UNCACHED, parse_contestant

    # The sweep judges policies.auto() too (FP8 only where the cost model says a site gains), current scaling
    # cast at every call (what gradient accumulation gains from the weights' kept copies), and each recipe on the
    # first expert GEMM alone (what the site model's table of each expert GEMM is solved from).
    default = [c for c in DEFAULT + ([*AUTO, UNCACHED, *FIRST_GEMM_ONLY] if args.sweep else [])
               if c != TORCHAO or importlib.util.find_spec("torchao")]
    contestants = contestants_of(args.contestants, default, parse_contestant)
    if args.sweep:
        given = [flag for flag, value in (("--config", args.config), ("--override", args.override),
                                          ("--tokens", args.tokens), ("--batch", args.batch)) if value is not None]
        if given:
            raise SystemExit(f"--sweep models its own shapes (bench/moe.py's SWEEP); drop {', '.join(given)}")
        spec = {"workload": "moe", "config": "bench", "batch": None, "sequence": None, "overrides": {},
                "shapes": [{"label": shape.label, "config": shape.config, "overrides": shape.overrides,
                            "batch": shape.batch, "sequence": shape.tokens} for shape in SWEEP]}
        print(f"moe sweep ({len(SWEEP)} blocks): {len(contestants)} contestants, one process each", file=sys.stderr)
    else:
        config, batch, tokens = args.config or "bench", args.batch or 1, args.tokens or 4096
        overrides = dict(_override(text) for text in args.override or ())
        spec = {"workload": "moe", "config": config, "batch": batch, "sequence": tokens, "overrides": overrides}
        print(f"moe ({config}{f' {overrides}' if overrides else ''}, {batch}x{tokens} tokens): "
              f"{len(contestants)} contestants, one process each", file=sys.stderr)
    spec.update(source=args.source, cubin=args.cubin, grad_accumulation=args.grad_accumulation)
    if args.frozen_experts:
        spec["frozen_experts"] = True
    if args.fp8graph_at == "measured":
        raise SystemExit("--fp8graph-at: 'measured' is the H100 run's commit, which had no expert GEMMs; give a "
                         "commit, or 'installed'")
    fp8graph = calibration.measured_fp8graph(args.fp8graph_at)  # "installed": this checkout
    try:
        gpu = machine_of(args).gpu
        # policies.auto() decides its sites at the rates of the --gpu named (a rate option given does not reach it).
        results = children(args)([{**spec, "contestant": c,
                                   **({"policy_gpu": gpu} if parse_contestant(c)[0] in AUTO else {})}
                                  for c in contestants], fp8graph.env)
    finally:
        fp8graph.close()
    if args.fp8graph_at != "installed":
        spec["fp8graph_at"] = args.fp8graph_at
    accumulate(results, args.grad_accumulation)
    case = next((c["case"] for r in results for c in r.get("cases", [])), "")
    blocks = f"the sweep's {len(SWEEP)} MoE blocks" if args.sweep else f"one MoE block ({spec['config']}: " \
        f"{case or 'not built'})"
    what = (f"bench moe's training step, {blocks}; BF16, forward + backward + eager SGD"
            + (f", {' or '.join(map(str, args.grad_accumulation))} micro-batches a step"
               if args.grad_accumulation != [1] else "")
            + ("; the experts' weights frozen" if args.frozen_experts else "")
            + (f"; fp8graph at {args.fp8graph_at}" if args.fp8graph_at != "installed" else ""))
    result = _finish(build_result("moe", spec, results, machine_of(args), what), args)
    # The table is of steps whose experts train: a frozen sweep has no grad_weight casts to solve for.
    if args.sweep and not args.frozen_experts and {"bf16", *site_casts.GROUPED_RECIPES} <= set(contestants) and \
            all("error" not in r for r in results):
        print("fp8graph/costs/casts.py's table of expert sites, from this sweep's kernels:")
        print(site_casts.grouped_table_source(site_casts.derive_grouped(result)))
        if all(f"{recipe} gate_up only" in contestants for recipe in site_casts.GROUPED_RECIPES):
            print(site_casts.stage_table_source(site_casts.derive_stages(result)))
    return result


def accumulate(results: list[dict], micro_batches: list[int]) -> None:
    """Each captured case as a step of ``n`` micro-batches, for each ``n``: the forward and backward kernels
    ``n`` times, then one optimizer step; after the first micro-batch autograd adds each parameter's gradient
    into the one it holds (read 2, write 1: the optimizer row's bytes). Every kernel of the forward and
    backward runs again, weight casts included, but where a case has ``reuse_rows`` (weights cast once per
    step, ``cache_weights``): micro-batches 2..n run those instead. A step of one micro-batch runs the case's
    ``per_call_rows`` where it has them: outside a declaration its weights are cast per call, as bench's step of
    one micro-batch runs (``bench.costmodel.workloads._MicroBatches``)."""
    if micro_batches == [1]:
        return
    for result in results:
        if "cases" not in result:
            continue
        result["cases"] = [{**{k: v for k, v in case.items() if k not in ("reuse_rows", "per_call_rows")},
                            "case": _with_micro_batches(case["case"], n), "micro_batches": n,
                            "rows": (case["per_call_rows"] if n == 1 and "per_call_rows" in case
                                     else _accumulated_rows(case["rows"], n, case.get("reuse_rows")))}
                           for case in result["cases"] for n in micro_batches]


def _with_micro_batches(case: str, micro_batches: int) -> str:
    """The label of ``case`` as a step of ``micro_batches`` micro-batches (``accumulate``)."""
    return f"{case}, {micro_batches} micro-batch{'es' if micro_batches > 1 else ''}"


def _accumulated_rows(rows: list[dict], micro_batches: int, reuse_rows: list[dict] | None = None) -> list[dict]:
    if reuse_rows is not None:  # the first micro-batch casts the weights, the others read its casts
        step = rows + [{**row, "count": row["count"] * (micro_batches - 1)} for row in reuse_rows
                       if micro_batches > 1]
    else:
        step = [row if row["kind"] == "optimizer" else {**row, "count": row["count"] * micro_batches}
                for row in rows]
    adds = [{**row, "name": "param.grad += the micro-batch's gradient (autograd, eager)",
             "count": row["count"] * (micro_batches - 1)} for row in rows if row["kind"] == "optimizer"]
    return step + (adds if micro_batches > 1 else [])


def _override(text: str) -> tuple[str, int]:
    """``("experts", 8)`` of ``"experts=8"``: a field of models/moe.py's config."""
    from fp8graph.models.moe import CONFIGS

    name, _, value = text.partition("=")
    fields = set(CONFIGS["bench"])
    if name not in fields or not value.isdigit() or int(value) < 1:
        raise SystemExit(f"--override takes FIELD=N with a positive N, FIELD one of {sorted(fields)}; got {text!r}")
    return name, int(value)


def model_linear(args) -> dict:
    if args.casts:
        return model_casts(args)
    from .decoder import parse_contestant

    contestants = contestants_of(args.contestants, FP8GRAPH + TORCHAO, parse_contestant)
    shapes = [_ints(s, 3) for s in args.shape] if args.shape else calibration.LINEAR_SHAPES
    spec = {"workload": "linear", "shapes": shapes, "bias": args.bias, "source": args.source, "cubin": args.cubin}
    results = children(args)([{**spec, "contestant": c} for c in contestants])
    what = "bench linear's step: nn.Linear(K, N) forward + backward on M tokens, BF16"
    return _finish(build_result("linear", spec, results, machine_of(args), what), args)


def model_casts(args) -> dict:
    """Print fp8graph.costs.casts's table as this version's kernels give it (nothing written)."""
    results = children(args)([site_casts.linear_spec(c) for c in CAST_TABLE])
    failed = [f"{c}: {r['error']}" for c, r in zip(CAST_TABLE, results) if "error" in r]
    if failed:
        raise SystemExit("bench model linear --casts: " + "\n".join(failed))
    derived = {c: site_casts.derive(r["cases"][0]["rows"], *site_casts.SHAPE) for c, r in zip(CAST_TABLE, results)}
    print(site_casts.table_source(derived))
    return {"casts": derived}


def model_quantize(args) -> dict:
    spec = {"workload": "quantize", "shapes": [_ints(s, 2) for s in args.shape],
            "variants": "all" if args.all else "four", "source": args.source, "cubin": args.cubin}
    results = children(args)([spec])
    what = ("Per-tensor FP8 casts of a BF16 tensor, each compiled alone by torch.compile (the functions of "
            "bench/results/2026-11-23-h100/quantize-structure-probe.txt)")
    return _finish(build_result("quantize", spec, results, machine_of(args), what), args)


def model_calibrate(args) -> None:
    """The captures it makes are kept (bench.costmodel.captures): the test reads them while they hold."""
    kept = captures.CapturedResults()
    lines, comparisons = calibration.calibrate(str(args.results), captures.cached(children(args), kept),
                                               machine_of(args), args.only or calibration.SECTIONS[:-1],
                                               args.fp8graph_at)
    print("\n".join(lines))
    written = kept.write()
    if written:
        print(f"{written} captures kept in {kept.path}", file=sys.stderr)


def model_compare(args) -> None:
    """A measured ``bench decoder`` or ``bench moe`` result beside the modelled one of the same configuration:
    what the next GPU run checks (``scripts/gpu-run decoder`` and ``moe`` print it)."""
    print("\n".join(compare_lines(json.loads(args.measured.read_text()), args.measured.name, args.model)))


def _newest_model(measured: dict, results: pathlib.Path) -> pathlib.Path | None:
    """The newest modelled result of the measured run's workload and configuration (the newest that models every
    measured contestant, if one does): bench moe's block (same config, batch and tokens, no overrides, the experts
    frozen or not alike) or bench decoder's stack (same config and layers)."""
    block = measured.get("workload") == "moe_block"
    matching = []
    for path in sorted(results.glob("model-moe-*.json" if block else "model-decoder-*.json"), reverse=True):
        model = json.loads(path.read_text())
        if _models_block(model, measured) if block else _models_stack(model, measured):
            matching.append(path)
            if {row.get("contestant") for row in measured.get("rows", [])} <= {
                    row.get("contestant") for row in model["rows"]}:
                return path
    return matching[0] if matching else None


def _models_block(model: dict, measured: dict) -> bool:
    """Whether a modelled ``bench model moe`` result has the measured block: its spec's, or a sweep case's."""
    spec = model["spec"]
    if not _same_experts(spec, measured):
        return False
    return ((spec.get("config"), spec.get("batch"), spec.get("sequence")) ==
            (measured.get("config"), measured.get("batch"), measured.get("sequence"))
            and not spec.get("overrides")) or _sweep_case(model, measured) is not None


def _models_stack(model: dict, measured: dict) -> bool:
    """Whether a modelled ``bench model decoder`` result has the measured stack: same config and layers."""
    cases = {row["case"] for row in model["rows"] if "case" in row}  # "4 layers, vocab 32000, 1x4096"
    return (model["spec"].get("config") == measured.get("config")
            and any(case.startswith(f"{measured.get('layers')} layers,") for case in cases))


def _same_experts(spec: dict, measured: dict) -> bool:
    """Whether a modelled spec and a measured bench moe run both froze the experts' weights, or neither did
    (``--frozen-experts``: a step without grad_weight GEMMs is no peer of one with them)."""
    return bool(spec.get("frozen_experts")) == bool(measured.get("frozen_experts"))


def _sweep_case(model: dict, measured: dict) -> str | None:
    """The case of a ``bench model moe --sweep`` result that models the measured block (same config, batch and
    tokens, no overrides, the experts frozen or not alike; one micro-batch a step, as bench moe runs it), or
    ``None``."""
    spec = model.get("spec", {})
    if 1 not in spec.get("grad_accumulation", [1]) or not _same_experts(spec, measured):
        return None
    for shape in spec.get("shapes") or ():
        if ((shape["config"], shape["batch"], shape["sequence"]) ==
                (measured.get("config"), measured.get("batch"), measured.get("sequence")) and not shape["overrides"]):
            return _with_micro_batches(shape["label"], 1) if spec.get("grad_accumulation", [1]) != [1] \
                else shape["label"]
    return None


def peer_rows(model: dict, measured: dict) -> dict[str, dict]:
    """The modelled rows, by contestant, of the step a measured ``bench moe`` or ``bench decoder`` run timed: a
    sweep's block of its shape, and one micro-batch a step (a GPU run steps the optimizer after every micro-batch:
    a modelled step of several is not its peer)."""
    case = _sweep_case(model, measured)
    accumulated = model.get("spec", {}).get("grad_accumulation", [1]) != [1]
    return {row["contestant"]: row for row in model["rows"] if "error" not in row
            and (row["case"] == case if case is not None else
                 not accumulated or row["case"].endswith(_with_micro_batches("", 1)))}


def compare_lines(measured: dict, measured_name: str, model_path: pathlib.Path | None,
                  results: pathlib.Path = pathlib.Path("bench/results")) -> list[str]:
    """Per contestant: the modelled step beside the measured one (profiled kernel time when the run
    profiled, else the wall time from tokens/s), and each one's speedup over BF16."""
    model_path = model_path or _newest_model(measured, results)
    if model_path is None:
        name = "moe" if measured.get("workload") == "moe_block" else "decoder"
        return [f"no modelled bench {name} result for {measured.get('config')} in {results}: run "
                f"`python -m bench model {name}` (CPU) and commit it"]
    model = json.loads(model_path.read_text())
    modelled = peer_rows(model, measured)
    run = gpu_runs.run_of(measured_name, results)
    gpu = gpu_runs.gpu_name(measured["environment"]["device"]) or "H100"
    modelled = _retimed(model, modelled, costs.Machine.of(gpu))  # at the measuring GPU's rates
    measured_rows = [row for row in measured["rows"] if "train_tokens_per_s" in row]
    bf16 = next((row for row in measured_rows if row["contestant"] == "bf16"), None)
    table = []
    for row in measured_rows:
        ours = modelled.get(row["contestant"])
        if ours is None:
            continue
        wall = measured["sequence"] * measured["batch"] / row["train_tokens_per_s"] * 1e3
        profile = row.get("profile")
        kernel = sum(profile["by_category_ms"].values()) if profile else None
        categories = profile["by_category_ms"] if profile else {}
        triton = categories.get("triton (fused elementwise/reduce/quantize)", categories.get("triton"))
        reference = kernel if kernel is not None else wall
        speedup = bf16["train_tokens_per_s"] and row["train_tokens_per_s"] / bf16["train_tokens_per_s"]
        table.append([row["contestant"], f"{ours['step_ms']:.2f}", f"{kernel:.2f}" if kernel else "-",
                      f"{wall:.2f}", f"{int(round((ours['step_ms'] / reference - 1) * 100)):+d}%",
                      f"{ours['triton_ms']:.2f}", f"{triton:.2f}" if triton is not None else "-",
                      f"{ours.get('vs_bf16', float('nan')):.2f}x", f"{speedup:.2f}x" if bf16 else "-",
                      *(f"{value:.2f}" if value is not None else "-" for value in (
                          ours.get("peak_gb"), row.get("peak_memory_gb"), ours.get("saved_gb"), row.get("saved_gb")))])
    ran = f", fp8graph at {run.commit}" if run else ""
    return [f"Modelled ({model_path.name}, project at {model.get('project_commit')}, at the {gpu}'s rates) against "
            f"measured ({measured_name}, {measured['environment']['device']}, torch {measured['environment']['torch']}"
            f"{ran}), ms per training step:", "",
            *markdown_table(["contestant", "model step", "measured kernel time", "measured wall", "error",
                             "model Triton", "measured Triton", "model vs bf16", "measured vs bf16", "model peak GB",
                             "measured peak GB", "model saved GB", "measured saved GB"], table), "",
            "error: model step against the measured kernel time (profiled runs), else the wall time. The model "
            "counts kernel time only; docs/cost-model.md says how close it came before. Saved GB: the model's "
            "leaves out the step's input, which the measured one counts when the backward keeps it.",
            *_fp8_own_gain(modelled, measured_rows)]


def _fp8_own_gain(modelled: dict, measured_rows: list[dict]) -> list[str]:
    """Each contestant's step over ``bench.decoder.SAME_GRAPHS_BF16``'s (the same graphs with every site in BF16:
    what FP8 itself gains), modelled beside measured, where both have that contestant."""
    # Imported here, not with the module: bench.decoder loads fp8graph, which bench model's other commands need not.
    from .decoder import SAME_GRAPHS_BF16 as reference
    measured = {row["contestant"]: row["train_tokens_per_s"] for row in measured_rows}
    if reference not in modelled or reference not in measured:
        return []
    gains = [f"{contestant} {modelled[reference]['step_ms'] / ours['step_ms']:.2f}x / "
             f"{measured[contestant] / measured[reference]:.2f}x"
             for contestant, ours in modelled.items()
             if contestant not in (reference, "bf16") and contestant in measured]
    return ["", f"What FP8 itself gains, each step over {reference}'s (the same graphs, every site in BF16), model / "
                f"measured: {', '.join(gains)}."]


def _retimed(model: dict, modelled: dict, machine: costs.Machine) -> dict:
    """``modelled``'s rows ({contestant: row}) with step, Triton ms and vs bf16 from their captured kernels at
    ``machine``'s rates (a result written before captures were kept keeps its own)."""
    retimed = {}
    for capture_ in model.get("captures", ()):
        row = modelled.get(capture_.get("contestant"))
        case = next((c for c in capture_.get("cases", ()) if row and c.get("case") == row.get("case")), None)
        if case is not None and "rows" in case:
            summary = costs.summary(costs.rows_from_json(case), machine)
            retimed[row["contestant"]] = {**row, "step_ms": summary["step_ms"], "triton_ms": summary["triton_ms"]}
    retimed = {contestant: retimed.get(contestant, row) for contestant, row in modelled.items()}
    if "bf16" in retimed:
        for row in retimed.values():
            row["vs_bf16"] = retimed["bf16"]["step_ms"] / row["step_ms"]
    return retimed


def _add_grad_accumulation(parser) -> None:
    """``--grad-accumulation``, which ``accumulate`` reads: bench decoder's and bench moe's."""
    parser.add_argument("--grad-accumulation", nargs="+", type=positive(int), default=[1], metavar="N",
                        help="model each step as N micro-batches and one optimizer step, for each N given "
                             "(default 1)")


def _ints(text: str, count: int) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if len(values) != count or any(v < 1 for v in values):
        raise SystemExit(f"expected {count} positive integers separated by commas, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="model_workload", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--timeout", type=positive(float), default=1800, help="seconds one contestant may take")
    common.add_argument("--verbose", action="store_true", help="show the child processes' output")
    common.add_argument("--gpu", choices=sorted(DEVICES), default="H100",
                        help="whose rates: H100 (fitted to its decoder runs), H200 (its Triton rate and FP8 "
                             "casts' fitted to its MoE runs, copies scaled by its data sheet); default H100")
    rates = costs.Machine()
    common.add_argument("--bandwidth", type=positive(float), help=f"copy, TB/s (H100: {rates.copy_bandwidth / 1e12})")
    common.add_argument("--triton-bandwidth", type=positive(float),
                        help=f"Inductor's kernels, TB/s (H100: {rates.triton_bandwidth / 1e12})")
    common.add_argument("--bf16-tflops", type=positive(float), help=f"H100: {rates.bf16_flops / 1e12:g}")
    common.add_argument("--fp8-tflops", type=positive(float),
                        help=f"FP8 tensorwise (H100: {rates.fp8_flops / 1e12:g})")
    common.add_argument("--grouped-bf16-tflops", type=positive(float),
                        help="torch._grouped_mm (a MoE's expert GEMMs), 512 tokens a group "
                             f"(H100: {rates.grouped_bf16_flops / 1e12:g})")
    common.add_argument("--grouped-fp8-tflops", type=positive(float),
                        help=f"torch._scaled_grouped_mm, row-wise, 512 tokens a group (H100: "
                             f"{rates.grouped_fp8_flops / 1e12:g})")
    common.add_argument("--grouped-bf16-tflops-large", type=positive(float),
                        help=f"the same, 2048 tokens a group (H100: {rates.grouped_bf16_flops_large / 1e12:g})")
    common.add_argument("--grouped-fp8-tflops-large", type=positive(float),
                        help=f"the same, 2048 tokens a group (H100: {rates.grouped_fp8_flops_large / 1e12:g})")
    outputs = argparse.ArgumentParser(add_help=False, parents=[common])
    outputs.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    outputs.add_argument("--top", type=int, default=0, metavar="N", help="list the N largest kernels per contestant")
    outputs.add_argument("--source", metavar="DIR", help="write each graph's wrapper and kernel sources under DIR")
    outputs.add_argument("--cubin", action="store_true",
                         help="compile every kernel config for sm_90: registers, spills, access widths (slow)")

    p = commands.add_parser("decoder", parents=[outputs], help="bench decoder's training step")
    p.add_argument("--contestants", nargs="+", metavar="NAME",
                   help="bench decoder's names (bf16 always runs; a name may end in '+setting' / '-setting'); "
                        "default: bf16, fp8graph's current, delayed, rowwise, block, torchao's two")
    p.add_argument("--config", choices=("bench-8b-layer", "llama3-8b"), default="bench-8b-layer")
    p.add_argument("--layers", type=positive(int), help="decoder layers (default: the config's, 4 or 32)")
    p.add_argument("--sequence", type=positive(int), default=4096)
    p.add_argument("--batch", type=positive(int), default=1)
    _add_grad_accumulation(p)
    p.set_defaults(model_run=model_decoder)

    p = commands.add_parser("moe", parents=[outputs], help="bench moe's training step of one MoE block")
    p.add_argument("--contestants", nargs="+", metavar="NAME",
                   help="bench moe's names: bf16 (always runs), rowwise, current, delayed, 'torchao moe rowwise', "
                        "auto, 'auto delayed', 'current uncached' (a name may end in '+setting' / '-setting'); "
                        "default: the first five, and with --sweep all of them")
    p.add_argument("--config", choices=("bench", "tiny", "tiny-odd"),
                   help="models/moe.py's config: bench (the default) is Qwen3-30B-A3B's MoE block (hidden 2048, "
                        "128 experts, top 8, expert width 768)")
    p.add_argument("--override", nargs="+", metavar="FIELD=N",
                   help="change fields of the config: hidden, experts, top_k, expert_width")
    p.add_argument("--tokens", type=positive(int), help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=positive(int), help="sequences (default 1)")
    p.add_argument("--sweep", action="store_true",
                   help="every block of bench/moe.py's SWEEP (Qwen3-30B-A3B at 256, 1024 and 2048 tokens an expert, "
                        "DeepSeek-V3's experts 8 a rank, Llama-4 Scout's) instead of one")
    _add_grad_accumulation(p)
    p.add_argument("--frozen-experts", action="store_true",
                   help="the experts' weights frozen (bench moe's --frozen-experts): no grad_weight GEMMs")
    p.add_argument("--fp8graph-at", default="installed", metavar="COMMIT",
                   help="fp8graph (its package, passes and models) at this commit, extracted from git; default: "
                        "the working tree")
    p.set_defaults(model_run=model_moe)

    p = commands.add_parser("linear", parents=[outputs], help="bench linear's forward + backward")
    p.add_argument("--shape", nargs="+", metavar="M,K,N",
                   help="default: bench linear's 16384-token shapes and 4096,1024,1024")
    p.add_argument("--contestants", nargs="+", metavar="NAME", help="as for decoder")
    p.add_argument("--bias", action="store_true")
    p.add_argument("--casts", action="store_true",
                   help="print fp8graph.costs.casts's table (each recipe's cast traffic) from this version's kernels")
    p.set_defaults(model_run=model_linear)

    p = commands.add_parser("quantize", parents=[outputs], help="the H100 quantize probe's amax/cast variants")
    p.add_argument("--shape", nargs="+", metavar="ROWS,COLUMNS", default=["16384,8192"])
    p.add_argument("--all", action="store_true", help="all 11 functions of the probe, not only the 4 casts")
    p.set_defaults(model_run=model_quantize)

    p = commands.add_parser("calibrate", parents=[common], help="the model against the stored H100 results")
    p.add_argument("--results", type=pathlib.Path, default=pathlib.Path("bench/results"))
    p.add_argument("--fp8graph-at", default="measured", metavar="COMMIT",
                   help="fp8graph for its contestants: 'measured' (the commit the H100 ran), a commit, 'installed'")
    p.add_argument("--only", nargs="+", choices=calibration.SECTIONS,
                   help="sections to run (default: all but llama3-8b, which adds about 6 minutes)")
    p.set_defaults(model_run=model_calibrate)


    p = commands.add_parser("compare", help="a measured bench decoder or moe result beside the modelled one")
    p.add_argument("measured", type=pathlib.Path,
                   help="a bench decoder or moe JSON (bench/results/decoder-*.json, moe-*.json)")
    p.add_argument("--model", type=pathlib.Path,
                   help="default: the newest model-decoder (model-moe) JSON of its configuration")
    p.set_defaults(model_run=model_compare)


def run(args: argparse.Namespace):
    return args.model_run(args)
