"""``bench model calibrate``: the cost model against the H100 results stored in the project (bench/results/).

    quantize       2026-11-23-h100/quantize-structure-probe.txt   the probe's compiled casts: kernels, us per call
    linear         linear-2026-11-23T081002Z.json (bench linear, median ms)
                   2026-11-23-h100/probe_linear.json (the same step through torch.compile, do_bench)
    decoder        2026-11-23-h100/profile-decoder-4layers-*.json  kernel time per step by category, top kernels
    bench-decoder  decoder-2026-11-23T075705Z.json, decoder-2026-11-23T080527Z.json  training tokens/s, 2 layers
    llama3-8b      2026-11-23-h100/profile-llama3-8b-32layers-bf16-current.json (only when asked)

The H100 ran torch 2.11 and fp8graph at commit 1fda4ce; the model runs torch 2.13, and by default models
the fp8graph contestants at that commit too (extracted with ``git archive`` into a temporary folder that the
child processes import first), so that a difference is the model's, not the code's. BF16 and torchao do
not depend on fp8graph's version.

Every section returns its Markdown lines and the :class:`Comparison` records behind them;
``tests/bench/test_cost_model.py`` holds those to the tolerances ``docs/cost-model.md`` states.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import tarfile
import tempfile
from typing import Callable

from . import costs, peak_memory
from .costs import markdown, summarize
from .costs import rows_from_json as rows_of

MEASURED_COMMIT = "1fda4ce"  # the fp8graph the H100 ran on 2026-11-23
H100_DIR = "2026-11-23-h100"
LINEAR_FILE = "linear-2026-11-23T081002Z.json"
LINEAR_CONTESTANTS = ["bf16", "current", "delayed", "rowwise", "block", "torchao tensorwise", "torchao rowwise"]
# bench linear's shapes that the stored H100 run measured (bench model linear's default too).
LINEAR_SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (4096, 1024, 1024)]
BENCH_DECODER = ["decoder-2026-11-23T075705Z.json", "decoder-2026-11-23T080527Z.json"]
PROFILES = ["profile-decoder-4layers-bf16-current.json", "profile-decoder-4layers-torchao-delayed-current.json"]
LLAMA3_PROFILE = "profile-llama3-8b-32layers-bf16-current.json"
SECTIONS = ("quantize", "linear", "decoder", "bench-decoder", "moe", "decoder-runs", "llama3-8b")
_TRITON = "triton (fused elementwise/reduce/quantize)"

# run(specs, env) -> one result per spec, from child processes (bench.model.children: one a spec;
# bench.model.run_children: one for them all)
Runner = Callable[[list[dict], "dict | None"], list[dict]]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One number the model predicted beside the H100's."""

    section: str  # quantize | linear | decoder | bench-decoder | llama3-8b
    case: str  # the shape, variant or profile
    contestant: str
    quantity: str  # "kernels", "step ms", "Triton ms", "vs bf16", ...
    model: float
    measured: float

    @property
    def error(self) -> float:
        """Relative error of the model: +0.05 is 5% high."""
        return self.model / self.measured - 1


def _package_dirs(commit: str) -> dict[str, str]:
    """Where each package of ``commit`` lies: pyproject.toml's ``[tool.setuptools.package-dir]`` (the commit
    the H100 ran), or setup.py's ``FOLDER_OF_PACKAGE`` (since the packages are found, not listed)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, check=True, text=True).stdout

    pyproject = show("pyproject.toml")
    if "[tool.setuptools.package-dir]" in pyproject:
        section = pyproject.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section, re.M))
    for node in ast.parse(show("setup.py")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FOLDER_OF_PACKAGE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise IndexError(f"no package folders in {commit}'s pyproject.toml or setup.py")


def extract_fp8graph(commit: str) -> str:
    """fp8graph's packages at ``commit`` laid out as installed (fp8graph.passes from passes/, ...), from the
    current directory's git repository, into a new temporary folder."""
    package_dirs = _package_dirs(commit)  # {"fp8graph.passes": "passes", ...}
    archive = subprocess.run(["git", "archive", "--format=tar", commit, *package_dirs.values()],
                             capture_output=True, check=True).stdout
    root = tempfile.mkdtemp(prefix="costmodel-fp8graph-")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            for package, directory in sorted(package_dirs.items(), key=lambda kv: -len(kv[1])):
                if member.name.startswith(directory.rstrip("/") + "/"):
                    target = os.path.join(root, package.replace(".", os.sep), member.name[len(directory) + 1:])
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(target, "wb") as f:
                        f.write(tar.extractfile(member).read())
                    break
    return root


def _pct(model: float, measured: float | None) -> str:
    return f"{(model / measured - 1) * 100:+.0f}%" if measured else "-"


def _strip(name: str) -> str:
    """A kernel's name without Inductor's index (and cut as the profile cut it): comparable across versions."""
    return re.sub(r"_\d*$", "", name[:110])


def _is_fp8graph(contestant: str) -> bool:
    return contestant.split()[0] not in ("bf16", "torchao")


class Calibration:
    """Runs the sections against the results in ``results_dir``; ``comparisons`` collects what they compared.

    ``run`` starts the child processes; ``fp8graph_env`` is the environment that makes a child import the
    measured commit's fp8graph (``None``: the installed one); ``machine`` holds the model's rates.
    """

    def __init__(self, results_dir: str, run: Runner, machine: costs.Machine, fp8graph_env: dict | None):
        self.results_dir, self.run, self.machine, self.fp8graph_env = results_dir, run, machine, fp8graph_env
        self.comparisons: list[Comparison] = []

    def _compare(self, *fields) -> None:
        comparison = Comparison(*fields)
        if comparison.measured:
            self.comparisons.append(comparison)

    def _run_one(self, spec: dict) -> dict:
        (result,) = self._run_many([spec])
        return result

    def _run_many(self, specs: list[dict]) -> list[dict]:
        """Each spec's summarized result, in order: fp8graph's contestants in the measured commit's environment,
        the others (BF16, torchao) in this one; one ``run`` per environment, which may share a process."""
        by_env: dict[bool, list[int]] = {}
        for index, spec in enumerate(specs):
            by_env.setdefault(_is_fp8graph(spec.get("contestant", "bf16")), []).append(index)
        results: list[dict] = [{} for _ in specs]
        for fp8graph_contestants, indices in by_env.items():
            env = self.fp8graph_env if fp8graph_contestants else None
            for index, result in zip(indices, self.run([specs[i] for i in indices], env)):
                if "error" not in result:
                    summarize([result], self.machine)
                results[index] = result
        return results

    def _run_at(self, commit: str, specs: list[dict]) -> list[dict]:
        """Each spec's result with fp8graph (its package, passes and models) at ``commit``, for every contestant:
        a recorded run's block and decoder are the ones that ran too."""
        fp8graph = measured_fp8graph(commit)
        try:
            return self.run(specs, fp8graph.env)
        finally:
            fp8graph.close()

    def _path(self, *parts: str) -> str:
        return os.path.join(self.results_dir, *parts)

    # --- quantize ----------------------------------------------------------------------------------------

    def quantize(self) -> list[str]:
        probe = read_probe(self._path(H100_DIR, "quantize-structure-probe.txt"))
        result = self._run_one({"workload": "quantize", "shapes": list(probe), "variants": "all"})
        if "error" in result:
            return [f"quantize: not modelled: {result['error']}"]
        table = []
        for case in result["cases"]:
            rows, s = rows_of(case), case["summary"]
            shape_text, variant = case["case"].split(" ", 1)
            us, kernels = probe.get(tuple(int(v) for v in shape_text.split("x")), {}).get(variant, (None, None))
            model_kernels = sum(r.count for r in rows if r.kind != "memset")
            copy_us, model_us = (s["triton_ms_copy"] + s["other_ms"]) * 1e3, s["step_ms"] * 1e3
            self._compare("quantize", case["case"], "inductor", "kernels", model_kernels, kernels)
            self._compare("quantize", case["case"], "inductor", "us at the H100 rate", model_us, us)
            table.append([case["case"], f"{model_kernels} / {kernels}", f"{copy_us:.0f}", f"{model_us:.0f}",
                          f"{us:.0f}" if us else "-", _pct(copy_us, us), _pct(model_us, us)])
        return ["### Quantize probe (16384x8192 and 4096x14336 BF16, one compiled function each, us per call)", "",
                *markdown(["case", "kernels model / H100", "model us @copy", "model us @H100 rate", "H100 us",
                           "error @copy", "error @H100 rate"], table)]

    # --- linear ------------------------------------------------------------------------------------------

    def linear(self, contestants=LINEAR_CONTESTANTS, shapes=LINEAR_SHAPES) -> list[str]:
        with open(self._path(LINEAR_FILE)) as f:
            bench = {(r["M"], r["K"], r["N"], r["contestant"]): r["median_ms"] for r in json.load(f)["rows"]
                     if "median_ms" in r}
        probe = {}
        if os.path.exists(self._path(H100_DIR, "probe_linear.json")):
            with open(self._path(H100_DIR, "probe_linear.json")) as f:
                probe = {(r["M"], r["K"], r["N"], r["kind"]): r["ms"] for r in json.load(f)["rows"] if "ms" in r}
        bench_name = {"bf16": "bf16 torch.compile (inductor)", "torchao tensorwise": "torchao tensorwise (inductor)",
                      "torchao rowwise": "torchao rowwise (inductor)"}
        probe_name = {"bf16": "bf16", "current": "fp8", "torchao tensorwise": "torchao tensorwise",
                      "torchao rowwise": "torchao rowwise"}
        # A spec a shape: a kept capture (bench.costmodel.captures) serves any subset of the shapes.
        pairs = [(contestant, shape) for shape in shapes for contestant in contestants]
        results = self._run_many([{"workload": "linear", "shapes": [shape], "bias": False, "contestant": contestant}
                                  for contestant, shape in pairs])
        table, errors = [], []
        for (contestant, (m, k, n)), result in zip(pairs, results):
            case = next((c for c in result.get("cases", []) if c["case"] == f"{m}x{k}x{n}"), None)
            if case is None:
                errors.append(f"{contestant}: not modelled: {result.get('error', '?')[:300]}")
                continue
            s = case["summary"]
            measured = bench.get((m, k, n, bench_name.get(contestant, f"fp8graph {contestant} (inductor)")))
            probed = probe.get((m, k, n, probe_name.get(contestant)))
            self._compare("linear", f"{m}x{k}x{n}", contestant, "step ms (bench)", s["step_ms"], measured)
            self._compare("linear", f"{m}x{k}x{n}", contestant, "step ms (probe)", s["step_ms"], probed)
            table.append([f"{m}x{k}x{n}", contestant, f"{s['triton_ms']:.3f}", f"{s['gemm_ms']:.3f}",
                          f"{s['other_ms']:.3f}", f"{s['step_ms']:.3f}", f"{measured:.3f}" if measured else "-",
                          _pct(s["step_ms"], measured), f"{probed:.3f}" if probed else "-",
                          _pct(s["step_ms"], probed)])
        return ["### Linear forward + backward (ms per step)", "",
                *markdown(["shape", "contestant", "model Triton", "model GEMM", "model other", "model step",
                           "H100 bench", "error", "H100 probe", "error"], table), *sorted(set(errors)), "",
                "H100 bench: bench linear's median; H100 probe: the same step through torch.compile, timed by "
                "do_bench. Known misses: 4096x1024x1024 is CPU- and launch-bound on the H100 (the model counts "
                "kernel time only); rowwise and block at 1fda4ce quantized with fp8graph::quantize_tiles, a custom "
                "kernel the model times at copy bandwidth and the H100 ran far slower; bench linear's torchao rows "
                "are 3x the probe's at the same shapes (and torchao matched fp8graph current in the decoder)."]

    # --- decoder -----------------------------------------------------------------------------------------

    def _model_decoder(self, contestants, overrides) -> tuple[dict, list[str]]:
        """{contestant: (summary, case)} of bench decoder's step (bench-8b-layer's shapes, 1x4096), and errors."""
        spec = {"workload": "decoder", "config": "bench-8b-layer", "overrides": overrides, "batch": 1,
                "sequence": 4096}
        summaries, errors = {}, []
        contestants = list(dict.fromkeys(contestants))
        for contestant, result in zip(contestants, self._run_many([{**spec, "contestant": c} for c in contestants])):
            if "error" in result:
                errors.append(f"{contestant}: not modelled: {result['error']}")
                continue
            summaries[contestant] = (result["cases"][0]["summary"], result["cases"][0])
        return summaries, errors

    def decoder(self, files=PROFILES, overrides=None, title=None, section="decoder", contestants=None) -> list[str]:
        """Each profiled contestant modelled once, beside each profile of it: kernel time per category."""
        overrides = {"num_hidden_layers": 4} if overrides is None else overrides
        title = title or "Decoder training step, 4 Llama-3-8B layers, vocab 32000, 1x4096 (ms per step)"
        profiles = []  # (file, contestant, profile)
        for name in files:
            with open(self._path(H100_DIR, name)) as f:
                profiles += [(name, key.replace("_", " "), value) for key, value in json.load(f).items()
                             if contestants is None or key.replace("_", " ") in contestants]
        summaries, lines = self._model_decoder([c for _, c, _ in profiles], overrides)
        table, kernels, ratios = [], [], []
        bf16_profile = {file: p for file, c, p in profiles if c == "bf16"}
        for file, contestant, profile in profiles:
            if contestant not in summaries:
                continue
            (s, case), h = summaries[contestant], profile["by_category_ms"]
            h_triton = h.get(_TRITON, 0.0)
            h_gemm = h.get("gemm fp8", 0.0) + h.get("gemm other", 0.0)
            h_other = h.get("other", 0.0) + h.get("memcpy/memset", 0.0)
            h_total = sum(h.values())
            triton_gb = s["triton_read_gb"] + s["triton_written_gb"]
            where = f"{_short(file)}"
            self._compare(section, where, contestant, "kernel ms", s["step_ms"], h_total)
            self._compare(section, where, contestant, "Triton ms", s["triton_ms"], h_triton)
            self._compare(section, where, contestant, "GEMM ms", s["gemm_ms"], h_gemm)
            table.append([contestant, where, f"{s['triton_ms']:.2f} / {h_triton:.2f}",
                          f"{s['gemm_ms']:.2f} / {h_gemm:.2f}", f"{s['attention_ms']:.2f} / {h['attention']:.2f}",
                          f"{s['other_ms'] + s['optimizer_ms']:.2f} / {h_other:.2f}",
                          f"{s['step_ms']:.2f} / {h_total:.2f}", _pct(s["step_ms"], h_total),
                          f"{profile['step_ms']:.2f}", f"{triton_gb / h_triton:.2f}"])
            # Ratios against the BF16 of the same profile file (else of another: both ran the same day).
            reference = bf16_profile.get(file) or next(iter(bf16_profile.values()), None)
            if contestant != "bf16" and reference and "bf16" in summaries:
                model_ratio = summaries["bf16"][0]["step_ms"] / s["step_ms"]
                kernel_ratio = sum(reference["by_category_ms"].values()) / h_total
                self._compare(section, where, contestant, "vs bf16 (kernel time)", model_ratio, kernel_ratio)
                ratios.append(f"- {contestant} vs bf16: model {model_ratio:.2f}x; H100 "
                              f"{reference['step_ms'] / profile['step_ms']:.2f}x wall, {kernel_ratio:.2f}x kernel "
                              f"time ({where})")
            kernels += self._kernel_matches(contestant, file, case, profile)
        columns = ["contestant", "H100 profile", "Triton ms model / H100", "GEMM", "attention",
                   "other (SGD, custom ops)", "kernel total", "error", "H100 step ms (wall)",
                   "H100 Triton TB/s on model bytes"]
        return [f"### {title}", "", *markdown(columns, table), *lines, "",
                "Model / H100, ms per step. H100 other: ATen's kernels (the eager SGD step) and cuDNN's helpers; "
                "wall: the whole step, CPU included.", "", *ratios, *kernels]

    def llama3_8b(self) -> list[str]:
        return self.decoder([LLAMA3_PROFILE], {"num_hidden_layers": 32, "vocab_size": 128256},
                            "Llama-3-8B training step, 32 layers, vocab 128256, 1x4096 (ms per step)", "llama3-8b")

    def bench_decoder(self) -> list[str]:
        """bench decoder's own runs (training tokens/s): the only H100 numbers for rowwise, block and torchao
        rowwise in a decoder. At 1fda4ce bench-8b-layer had 2 layers and bench built the config's, so 2 here."""
        runs = []  # (file, row)
        for name in BENCH_DECODER:
            with open(self._path(name)) as f:
                runs += [(name, row) for row in json.load(f)["rows"] if "train_tokens_per_s" in row]
        summaries, errors = self._model_decoder([row["contestant"] for _, row in runs], {"num_hidden_layers": 2})
        bf16 = {file: 4096 / row["train_tokens_per_s"] * 1e3 for file, row in runs if row["contestant"] == "bf16"}
        table = []
        for file, row in runs:
            if row["contestant"] not in summaries:
                continue
            model, measured = summaries[row["contestant"]][0]["step_ms"], 4096 / row["train_tokens_per_s"] * 1e3
            self._compare("bench-decoder", file.removesuffix(".json"), row["contestant"], "step ms (wall)", model,
                          measured)
            table.append([row["contestant"], file.removesuffix(".json"), f"{model:.2f}", f"{measured:.2f}",
                          _pct(model, measured),
                          f"{summaries['bf16'][0]['step_ms'] / model:.2f}x" if "bf16" in summaries else "-",
                          f"{bf16[file] / measured:.2f}x"])
        return ["### bench decoder's training step, 2 layers, vocab 32000, 1x4096 (ms per step)", "",
                *markdown(["contestant", "H100 run", "model step ms", "H100 step ms (wall, from tokens/s)", "error",
                           "model vs bf16", "H100 vs bf16"], table), *errors, "",
                "The H100 step is the wall time of a timed step (CPU overhead included); the model counts kernel "
                "time."]

    def decoder_runs(self) -> list[str]:
        """Each recorded ``bench decoder`` run since 1fda4ce's (``bench/results/gpu-runs.json``), modelled at its
        commit with its GPU's rates: the step (wall time from tokens/s; the model counts kernel time) and the
        step against BF16's. Those runs recorded no profile."""
        from bench.gpu_runs import gpu_runs

        table, lines, memory_table = [], [], []
        for run in gpu_runs(pathlib.Path(self.results_dir)):
            if run.workload != "decoder" or run.commit == MEASURED_COMMIT:
                continue
            measured = run.measured(pathlib.Path(self.results_dir))
            timed = [row for row in measured["rows"] if "train_tokens_per_s" in row]
            spec = {"workload": "decoder", "config": measured["config"], "batch": measured["batch"],
                    "sequence": measured["sequence"], "overrides": {"num_hidden_layers": measured["layers"]},
                    "fp8graph_at": run.commit}  # the commit keeps each run's captures apart
            results = self._run_at(run.commit, [{**spec, "contestant": row["contestant"]} for row in timed])
            machine = costs.Machine.of(run.gpu)
            tokens = measured["batch"] * measured["sequence"]
            steps = {}
            case = f"{run.file.removesuffix('.json')} ({run.gpu}, {run.commit})"
            for row, result in zip(timed, results):
                if "error" in result:
                    lines.append(f"- {run.file} {row['contestant']}: not modelled: {result['error'][:300]}")
                    continue
                steps[row["contestant"]] = (costs.summary(rows_of(result["cases"][0]), machine)["step_ms"],
                                            tokens / row["train_tokens_per_s"] * 1e3)
                memory_table.append(self._memory("decoder-runs-memory", case, row["contestant"],
                                                 result["cases"][0], row))
            for contestant, (model, wall) in steps.items():
                self._compare("decoder-runs", case, contestant, "step ms (wall)", model, wall)
                ratios = ("-", "-")
                if contestant != "bf16" and "bf16" in steps:
                    ratios = (steps["bf16"][0] / model, steps["bf16"][1] / wall)
                    self._compare("decoder-runs", case, contestant, "vs bf16 (wall)", *ratios)
                table.append([case, contestant, f"{model:.2f}", f"{wall:.2f}", _pct(model, wall),
                              *(f"{ratio:.2f}x" if ratio != "-" else ratio for ratio in ratios)])
        return ["### bench decoder's training step: every recorded GPU run since 1fda4ce, at its commit and on its "
                "GPU (ms per step)", "",
                *markdown(["run (GPU, fp8graph)", "contestant", "model step ms", "measured step ms (wall)", "error",
                           "model vs bf16", "measured vs bf16"], table), *lines, "",
                "The measured step is the wall time of a timed step (CPU overhead included); the model counts "
                "kernel time.", "", *self._memory_lines(memory_table)]

    def _memory(self, section: str, case: str, contestant: str, modelled_case: dict, row: dict) -> list[str]:
        """The modelled step's peak memory and saved activations (``bench.costmodel.peak_memory``, one micro-batch)
        beside ``row``'s measured ``peak_memory_gb`` and ``saved_gb``: a row of :meth:`_memory_lines`' table."""
        memory = peak_memory.step_memory(modelled_case["memory"]["persistent"], modelled_case["memory"]["calls"], 1)
        peak, saved = memory["peak_bytes"] / 1e9, memory["saved_bytes"] / 1e9
        self._compare(section, case, contestant, "peak GB", peak, row.get("peak_memory_gb"))
        self._compare(section, case, contestant, "saved GB", saved, row.get("saved_gb"))
        measured_peak = row.get("peak_memory_gb")
        return [case, contestant, f"{peak:.2f}", "-" if measured_peak is None else f"{measured_peak:.2f}",
                "-" if measured_peak is None else _pct(peak, measured_peak), f"{saved:.2f}",
                "-" if row.get("saved_gb") is None else f"{row['saved_gb']:.2f}"]

    @staticmethod
    def _memory_lines(table: list[list[str]]) -> list[str]:
        return ["Peak memory and memory saved for the backward, modelled (the wrappers' allocations replayed, one "
                "micro-batch) and measured (torch.cuda.max_memory_allocated over the timed steps; bench.memory: the "
                "storages autograd saves, parameters excluded, the step's input included):", "",
                *markdown(["run (GPU, fp8graph)", "contestant", "model peak GB", "measured peak GB", "error",
                           "model saved GB", "measured saved GB"], table)]

    def _kernel_matches(self, contestant, file, case, profile) -> list[str]:
        """The profile's largest Triton kernels beside the model's kernels of the same (index-stripped) name."""
        machine = self.machine
        model: dict[str, list] = {}
        for r in rows_of(case):
            if r.kind == "triton":
                entry = model.setdefault(_strip(r.name), [0, 0.0, 0])
                entry[0] += r.count
                entry[1] += costs.time_us(r, machine, machine.triton_bandwidth) * r.count / 1e3
                entry[2] += r.bytes * r.count
        measured: dict[str, list] = {}
        for name, ms, calls in profile["top"]:
            if name.startswith("triton"):
                entry = measured.setdefault(_strip(name), [0.0, 0])
                entry[0] += ms
                entry[1] += calls
        table, matched_model, matched_h100 = [], 0.0, 0.0
        for name, (ms, calls) in sorted(measured.items(), key=lambda kv: -kv[1][0])[:8]:
            ours = model.get(name)
            if ours:
                matched_model += ours[1]
                matched_h100 += ms
            # A rate only where the launches agree: otherwise the cut name covers different kernels on each side.
            table.append([f"`{name}`", f"{calls:g}", f"{ms:.3f}",
                          *((str(ours[0]), f"{ours[1]:.3f}", f"{ours[2] / 1e9:.3f}",
                             f"{ours[2] / 1e9 / ms:.2f}" if ours[0] == calls else "-") if ours
                            else ("-", "-", "-", "-"))])
        return ["", f"{contestant} ({_short(file)}): the H100's largest Triton kernels (names cut at 110 characters "
                    f"by the profile), and the model's of the same name (matched: H100 {matched_h100:.2f} ms, model "
                    f"{matched_model:.2f} ms):", "",
                *markdown(["kernel", "H100 calls", "H100 ms", "model calls", "model ms", "model GB",
                           "H100 TB/s on model bytes (same launches)"], table)]

    # --- the MoE block: every recorded GPU run, at the commit and on the GPU it ran -------------------------

    def moe(self, files: list[str] | None = None) -> list[str]:
        """Each profiled contestant of each recorded ``bench moe`` run (``bench/results/gpu-runs.json``), modelled
        at the run's fp8graph commit with its GPU's rates, beside the profile: the step's kernel time, each class
        of kernels, and the step against BF16's."""
        from bench.gpu_runs import gpu_runs

        runs = [run for run in gpu_runs(pathlib.Path(self.results_dir)) if run.workload == "moe"
                and (files is None or run.file in files)]
        table, lines, memory_table = [], [], []
        for run in runs:
            measured = run.measured(pathlib.Path(self.results_dir))
            profiled = {row["contestant"]: row["profile"] for row in measured["rows"] if "profile" in row}
            spec = {"workload": "moe", "config": measured["config"], "batch": measured["batch"],
                    "sequence": measured["sequence"], "overrides": {}, "grad_accumulation": [1],
                    "fp8graph_at": run.commit}  # the commit keeps each run's captures apart
            results = self._run_at(run.commit, [{**spec, "contestant": contestant} for contestant in profiled])
            machine = costs.Machine.of(run.gpu)
            modelled, memory = {}, []
            case = f"{run.file.removesuffix('.json')} ({run.gpu}, {run.commit})"
            for contestant, result in zip(profiled, results):
                if "error" in result:
                    lines.append(f"- {run.file} {contestant}: not modelled: {result['error'][:300]}")
                    continue
                modelled[contestant] = moe_classes(rows_of(result["cases"][0]), machine)
                row = next(row for row in measured["rows"] if row["contestant"] == contestant)
                memory.append(self._memory("moe-memory", case, contestant, result["cases"][0], row))
            measured_classes = {contestant: measured_moe_classes(profile) for contestant, profile in profiled.items()}
            memory_table += memory
            for contestant, model in modelled.items():
                h = measured_classes[contestant]
                for quantity in MOE_CLASSES:
                    self._compare("moe", case, contestant, f"{quantity} ms", model[quantity], h[quantity])
                ratios = ("-", "-")
                if contestant != "bf16" and "bf16" in modelled:
                    ratios = (modelled["bf16"]["step"] / model["step"], measured_classes["bf16"]["step"] / h["step"])
                    self._compare("moe", case, contestant, "vs bf16 (kernel time)", *ratios)
                table.append([case, contestant, *(f"{model[q]:.2f} / {h[q]:.2f}" for q in MOE_CLASSES),
                              _pct(model["step"], h["step"]),
                              *(f"{ratio:.2f}x" if ratio != "-" else ratio for ratio in ratios)])
        return ["### The MoE block's training step: every recorded GPU run, at its commit and on its GPU (ms of "
                "kernels a step, model / measured)", "",
                *markdown(["run (GPU, fp8graph)", "contestant", *(f"{q} ms" for q in MOE_CLASSES), "step error",
                           "model vs bf16", "measured vs bf16"], table), *lines, "",
                "Classes: GEMM the (grouped) GEMMs; Triton Inductor's kernels and the custom ops' Triton kernels "
                "(fp8graph's, torchao's: the profile names them as Triton); other ATen's kernels (routing, "
                "segment_reduce, SGD), copies and memsets.", "", *self._memory_lines(memory_table)]


MOE_CLASSES = ("step", "GEMM", "Triton", "other")
_TRITON_CUSTOM_OPS = ("torch.ops.fp8graph.", "torch.ops.torchao.")  # custom ops that launch Triton kernels


def moe_classes(rows: list, machine: costs.Machine) -> dict[str, float]:
    """The modelled ms of a step's kernels by :data:`MOE_CLASSES`."""
    def ms(selected, bandwidth=None):
        return sum(costs.time_us(r, machine, bandwidth) * r.count for r in selected) / 1e3

    custom = [r for r in rows if r.kind == "extern" and r.name.startswith(_TRITON_CUSTOM_OPS)]
    classes = {"GEMM": ms([r for r in rows if r.kind == "gemm"]),
               "Triton": ms([r for r in rows if r.kind == "triton"], machine.triton_bandwidth) + ms(custom),
               "other": ms([r for r in rows if r.kind not in ("gemm", "triton") and r not in custom])}
    return {"step": sum(classes.values()), **classes}


def measured_moe_classes(profile: dict) -> dict[str, float]:
    """A profile's ms by :data:`MOE_CLASSES` (``bench.profile``'s categories, as told today)."""
    from bench.profile import recategorized

    h = recategorized(profile)
    classes = {"GEMM": h.get("gemm fp8", 0.0) + h.get("gemm other", 0.0),
               "Triton": h.get("triton", h.get(_TRITON, 0.0)),
               "other": h.get("other", 0.0) + h.get("memcpy/memset", 0.0) + h.get("attention", 0.0)}
    return {"step": sum(classes.values()), **classes}


def _short(file: str) -> str:
    return file.removeprefix("profile-").removesuffix(".json")


def read_probe(path: str) -> dict:
    """{(rows, columns): {variant: (us, kernels)}} from the probe's text (its first block: the casts)."""
    result, shape = {}, None
    with open(path) as f:
        for line in f:
            if line.startswith("Transposed casts"):  # a later block of other functions
                break
            start = re.match(r"shape \((\d+), (\d+)\): copy", line)
            if start:
                shape = (int(start.group(1)), int(start.group(2)))
                result[shape] = {}
                continue
            entry = re.match(r"\s+(\S.*?)\s+(\d+) us\s+\d+% of copy\s+(\d+) kernels", line)
            if entry and shape:
                result[shape][entry.group(1)] = (float(entry.group(2)), int(entry.group(3)))
            elif line.startswith("Reading"):
                shape = None
    return result


@dataclasses.dataclass
class MeasuredFP8graph:
    """The environment that makes child processes import fp8graph at the measured commit, and its cleanup."""

    env: dict | None
    description: str
    root: str | None = None

    def close(self) -> None:
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)


def measured_fp8graph(at: str) -> MeasuredFP8graph:
    """``at``: ``"measured"`` (the commit the H100 ran), a commit, or ``"installed"`` (this checkout).

    Raises:
        RuntimeError: the commit cannot be extracted (a shallow clone): calibrating today's code against
            another commit's measurements would compare two different programs.
    """
    commit = MEASURED_COMMIT if at == "measured" else at
    if commit == "installed":
        return MeasuredFP8graph(None, "the installed fp8graph")
    try:
        root = extract_fp8graph(commit)
    except (subprocess.CalledProcessError, FileNotFoundError, IndexError) as error:
        raise RuntimeError(f"cannot extract fp8graph at {commit} from this repository ({error}): the H100 "
                           "results were measured on it. Fetch the full history, or pass --fp8graph-at "
                           "installed to model this checkout instead") from None
    return MeasuredFP8graph({"FP8GRAPH_COSTMODEL_ROOT": root}, f"fp8graph at {commit}", root)


def calibrate(results_dir: str, run: Runner, machine: costs.Machine, sections=SECTIONS[:-1],
              fp8graph_at: str = "measured") -> tuple[list[str], list[Comparison]]:
    """The sections' Markdown and every comparison they made."""
    if not os.path.isdir(os.path.join(results_dir, H100_DIR)):
        raise FileNotFoundError(f"no {os.path.join(results_dir, H100_DIR)}: run it from the project's root")
    # the recorded runs are each modelled at their own commit
    needs_fp8graph = bool(set(sections) - {"quantize", "moe", "decoder-runs"})
    fp8graph = measured_fp8graph(fp8graph_at) if needs_fp8graph else MeasuredFP8graph(None, "none")
    calibration = Calibration(results_dir, run, machine, fp8graph.env)
    h100_sections = [section for section in sections if section not in ("moe", "decoder-runs")]
    lines = [f"**bench model calibrate**: the cost model (torch 2.13, fake sm_90, nothing run on a GPU) against the "
             f"GPU results under {results_dir}: " + (f"{', '.join(h100_sections)} against the H100's of 2026-11-23 "
             f"(torch 2.11, fp8graph at {MEASURED_COMMIT}; modelled with {fp8graph.description}); "
             if h100_sections else "") + ("moe against every recorded GPU run of the MoE block, each at the "
             "commit and with the GPU's rates it ran (gpu-runs.json); " if "moe" in sections else "")
             + ("decoder-runs against the later recorded runs of bench decoder, likewise; "
                if "decoder-runs" in sections else "")
             + f"H100 rates: copy {machine.copy_bandwidth / 1e12:.2f} "
             f"TB/s, Inductor's kernels {machine.triton_bandwidth / 1e12:.2f} TB/s, GEMMs "
             f"{machine.bf16_flops / 1e12:.0f} / {machine.fp8_flops / 1e12:.0f} TFLOP/s (BF16 / FP8); these rates "
             "were fitted to these same results.", ""]
    runs = {"quantize": calibration.quantize, "linear": calibration.linear, "decoder": calibration.decoder,
            "bench-decoder": calibration.bench_decoder, "moe": calibration.moe,
            "decoder-runs": calibration.decoder_runs, "llama3-8b": calibration.llama3_8b}
    try:
        for section in sections:
            lines += runs[section]() + [""]
    finally:
        fp8graph.close()
    return lines, calibration.comparisons
