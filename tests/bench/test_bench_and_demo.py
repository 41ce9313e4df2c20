"""The benchmark and the demo run end to end in their smallest CPU configurations."""

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

import forked

REPO = pathlib.Path(__file__).resolve().parents[2]


def _run_bench(workload, out_dir, *options):
    """``python -m bench WORKLOAD --smoke OPTIONS``; the raw result it wrote."""
    forked.run_python(["-m", "bench", workload, "--smoke", *options, "--out", str(out_dir)], cwd=REPO, check=True)
    [path] = out_dir.glob("*.json")
    return json.loads(path.read_text())


def _errors(result):
    """Failed contestants: the benchmark records them and goes on; a smoke run must have none."""
    return [(row["contestant"], row["error"]) for row in result["rows"] if "error" in row]


def test_linear_benchmark_smoke_writes_raw_results(tmp_path):
    result = _run_bench("linear", tmp_path)
    assert _errors(result) == [] and result["complete"]  # written after each shape, then completed
    assert result["environment"]["torch"] and result["environment"]["date"]
    assert {r["contestant"] for r in result["rows"]} == {
        "bf16 eager", "bf16 torch.compile (aot_eager)", "fp8graph current (aot_eager)",
        "fp8graph rowwise (aot_eager)", "fp8graph block (aot_eager)", "fp8graph mxfp8 (aot_eager)",
        "fp8graph delayed (aot_eager)", "fp8graph current, cached weight (aot_eager)",
        "torchao tensorwise (aot_eager)", "torchao rowwise (aot_eager)"}
    assert all(len(r["timings_ms"]) == result["repeats"] for r in result["rows"])
    assert result["targets"] == []  # the smoke shape is none of the Llama-3-8B shapes the target names


def test_quantize_smoke_writes_results_bench_show_prints(tmp_path):
    result = _run_bench("quantize", tmp_path)
    assert _errors(result) == []
    contestants = [r["contestant"] for r in result["rows"]]
    # The copy; the RMSNorm alone and the current and delayed casts (one layout; two, transposed by Inductor's
    # code and by fp8graph's FP8 transpose; after the RMSNorm, in one and two layouts); four tilings by Inductor
    # in one and two layouts (no kernel off CUDA).
    assert contestants[0] == "device-to-device copy" and len(contestants) == 20
    assert all(r["gb_per_s"] > 0 and len(r["timings_ms"]) == result["repeats"] for r in result["rows"])
    # Judged: what fp8graph runs on CUDA (here the code Inductor writes for per-tensor, row-wise and MX).
    assert [v["case"] for v in result["targets"]] == [
        "current (per tensor)", "delayed (per tensor)",
        "delayed (per tensor), both layouts, transposed by fp8graph::transpose_fp8",
        "rmsnorm + delayed cast", "rowwise (aot_eager)", "mxfp8 1x32 (aot_eager)"]
    # bench show reads the stored result back (one smoke run serves both checks).
    [path] = tmp_path.glob("quantize-*.json")
    shown = forked.run_python(["-m", "bench", "show", str(path)], cwd=REPO, check=True).stdout
    assert "| contestant | median ms |" in shown
    assert "Targets (smoke run: not meaningful):" in shown and "fraction of copy bandwidth" in shown


@pytest.mark.parametrize("steps", [4])
def test_demo_trains_both_runs_and_writes_the_plot(tmp_path, steps):
    completed = forked.run_python(["-m", "fp8graph", "demo", "--steps", str(steps), "--batch-size", "2",
                                   "--seq-len", "32", "--out", str(tmp_path)], check=True)
    # The high precision follows this CPU's features (BF16 only with AMX): named with the features read.
    [chosen] = re.findall(r"high precision: (BF16|FP32) \((.*?)\)", completed.stdout.replace("\n", " "))
    reference, reason = chosen
    assert reason.startswith("this CPU has ") and ("AMX BF16" in reason) == (reference == "BF16")
    assert "FP8: final training loss" in completed.stdout
    assert f"{reference}: final training loss" in completed.stdout
    assert "29 of 29 sites in FP8" in completed.stdout
    for phase in ("build the models", "FP8: compile, first 2 steps", "FP8: other 2 steps",
                  f"{reference}: compile, first 1 step", "explain and the HTML report", "sum of the phases"):
        assert phase in completed.stdout
    assert (tmp_path / "loss_curve.png").stat().st_size > 10_000
    assert (tmp_path / "fp8_health.png").stat().st_size > 10_000
    # The trained FP8 model, as transformers' FP8 loader reads it: every projection and lm_head in FP8.
    assert "fp8graph export: 29 FP8 weights, 1 kept in high precision, format 'compressed-tensors'" in completed.stdout
    load_line = f"load it with: transformers.AutoModelForCausalLM.from_pretrained('{tmp_path / 'fp8_checkpoint'}')"
    assert load_line in completed.stdout.splitlines()
    config = json.loads((tmp_path / "fp8_checkpoint" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"  # per-tensor scales
    # A quiet start: torchao (which transformers imports) and torch's enum warnings stay out of the output.
    assert completed.stderr == "", completed.stderr


def test_demo_baseline_comes_from_the_cpu_features_and_says_why():
    from fp8graph.apps.demo_baseline import CpuFeatures, choose_baseline

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    base_flags = {"sse4_2", "avx", "avx2", "fma"}
    avx2_only = CpuFeatures(frozenset(base_flags), "AVX2")
    avx512_bf16_no_amx = CpuFeatures(frozenset(base_flags | {"avx512f", "avx512_bf16"}), "AVX512")
    amx = CpuFeatures(frozenset(base_flags | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}), "AVX512")
    assert choose_baseline(cpu, "auto", avx2_only).dtype == torch.float32
    no_amx = choose_baseline(cpu, "auto", avx512_bf16_no_amx)
    assert no_amx.dtype == torch.float32 and "no AMX, AVX-512 BF16" in no_amx.reason
    with_amx = choose_baseline(cpu, "auto", amx)
    assert with_amx.dtype == torch.bfloat16 and with_amx.name == "BF16" and "AMX BF16" in with_amx.reason
    # AMX that ATen or oneDNN were told not to use (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2): fp32.
    assert choose_baseline(cpu, "auto", dataclasses.replace(amx, aten_capability="AVX2")).dtype == torch.float32
    limited = choose_baseline(cpu, "auto", dataclasses.replace(amx, onednn_max_isa="AVX512_CORE_BF16"))
    assert limited.dtype == torch.float32 and "oneDNN limited to AVX512_CORE_BF16" in limited.reason
    assert choose_baseline(cpu, "auto", dataclasses.replace(amx, onednn_max_isa="AVX512_CORE_AMX")).dtype \
        == torch.bfloat16
    assert choose_baseline(cuda, "auto", avx2_only).dtype == torch.bfloat16  # a GPU's choice ignores the CPU
    assert choose_baseline(cpu, "bf16", avx2_only).name == "BF16"  # asked for: honoured
    assert isinstance(choose_baseline(cpu, "fp32", amx).autocast(cpu), contextlib.nullcontext)
    with pytest.raises(ValueError, match="--precision must be auto, bf16 or fp32"):
        choose_baseline(cpu, "fp16", amx)


def test_demo_reads_this_machines_features_and_the_isa_limits_it_is_given():
    # ATen and oneDNN limited to AVX2, as the README's second demo run was: fp32 whatever this CPU has.
    avx2_only = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    completed = subprocess.run(
        [sys.executable, "-c", "import torch; from fp8graph.apps.demo_baseline import choose_baseline, cpu_features; "
                               "print(cpu_features()); print(choose_baseline(torch.device('cpu'), 'auto'))"],
        env=avx2_only, check=True, capture_output=True, text=True)
    assert "aten_capability='AVX2'" in completed.stdout and "onednn_max_isa='AVX2'" in completed.stdout
    assert "dtype=torch.float32" in completed.stdout


def test_decoder_benchmark_smoke_writes_raw_results(tmp_path):
    # One contestant of each kind of code path: fp8graph with state (under an Inductor setting named with
    # it), torchao. Each contestant in a process of its own, profiled.
    result = _run_bench("decoder", tmp_path, "--contestants", "delayed +combo_kernels", "torchao tensorwise",
                        "--profile")
    assert _errors(result) == [] and result["complete"] and result["process_per_contestant"]
    assert [r["contestant"] for r in result["rows"]] == ["bf16", "delayed +combo_kernels", "torchao tensorwise"]
    assert result["rows"][1]["inductor_settings"] == {"combo_kernels": True}
    assert result["layers"] == 2  # the tiny config's
    for row in result["rows"]:
        assert row["train_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
        assert row["compile_cold_s"] > 0 and row["compile_warm_s"] > 0
        assert row["saved_gb"] > 0
        assert len(row["train_timings_ms"]) == result["repeats"]
        assert row["profile"]["by_category_ms"]["gemm other"] > 0 and row["profile"]["top"]
    judged = {(v["target"], v["case"]) for v in result["targets"]}
    assert ("training tokens/s over torchao tensorwise", "delayed +combo_kernels") in judged
    assert not any("peak memory" in target for target, _ in judged)  # no peak memory off CUDA


def test_decoder_contestant_names_carry_inductor_settings_and_bad_ones_are_refused():
    from bench.decoder import parse_contestant

    assert parse_contestant("torchao tensorwise -loop_ordering_after_fusion") == (
        "torchao tensorwise", {"loop_ordering_after_fusion": False})
    assert parse_contestant("delayed +cooperative_reductions +combo_kernels") == (
        "delayed", {"triton.cooperative_reductions": True, "combo_kernels": True})
    # The like-for-like references of regional compilation.
    assert parse_contestant("bf16 per-block") == ("bf16 per-block", {})
    assert parse_contestant("fp8graph bf16") == ("fp8graph bf16", {})
    assert parse_contestant("current whole +combo_kernels") == ("current whole", {"combo_kernels": True})
    with pytest.raises(ValueError, match="unknown contestant 'currant'"):
        parse_contestant("currant +combo_kernels")
    with pytest.raises(ValueError, match="unknown Inductor setting 'fast'"):
        parse_contestant("current +fast")


def test_the_decoder_benchmark_shows_each_step_over_fp8graphs_bf16_where_it_ran():
    """FP8's own gain: a recipe's step over ``fp8graph bf16``'s (the same graphs, every site in BF16), beside the
    step over whole-model BF16; no such column when that contestant did not run or failed."""
    from bench.decoder import add_ratios

    def row(contestant, tokens_per_s):
        return {"contestant": contestant, "train_tokens_per_s": tokens_per_s, "compile_cold_s": 1.0, "saved_gb": 1.0}

    rows = [row("bf16", 100.0), row("fp8graph bf16", 115.0), row("current", 138.0), {"contestant": "delayed",
                                                                                      "error": "died"}]
    add_ratios(rows)
    assert rows[2]["train_speedup_vs_bf16_compile"] == pytest.approx(1.38)
    assert rows[2]["train_speedup_vs_fp8graph_bf16"] == pytest.approx(1.2)
    assert rows[1]["train_speedup_vs_fp8graph_bf16"] == 1.0 and "train_speedup_vs_fp8graph_bf16" not in rows[3]
    without = [row("bf16", 100.0), row("current", 138.0), {"contestant": "fp8graph bf16", "error": "died"}]
    add_ratios(without)
    assert all("train_speedup_vs_fp8graph_bf16" not in r for r in without)


def test_fp8graphs_bf16_reference_is_its_own_compile_with_every_site_kept():
    """``fp8graph bf16``, the like-for-like reference of fp8graph's recipes, compiles through fp8graph (its regions)
    and keeps every site in BF16: its loss and gradients equal plain ``torch.compile``'s bit for bit."""
    import copy

    import torch

    from bench.decoder import _compile
    from fp8graph.models import build

    model = build("llama", "tiny", dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    compiled = _compile(model, "fp8graph bf16", "aot_eager")
    loss = compiled(tokens, labels=tokens).loss
    loss.backward()
    decisions = compiled.fp8graph_backend.decisions
    assert decisions and not any(decision.rewritten for decision in decisions)
    expected = torch.compile(reference, backend="aot_eager")(tokens, labels=tokens).loss
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, parameter), (_, reference_parameter) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(parameter.grad, reference_parameter.grad), name


def test_the_decoders_auto_contestants_decide_at_the_gpu_they_are_given():
    """``auto`` and ``auto delayed`` compile with ``policies.auto()`` of their recipe, their sites timed on the GPU
    named (the cost model's --gpu) and each kept site's reason naming it; the tiny model's GEMMs gain nothing."""
    import torch

    from bench.decoder import _compile, parse_contestant
    from fp8graph.models import build

    tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    for contestant, recipe in (("auto", "current"), ("auto delayed", "delayed")):
        assert parse_contestant(contestant) == (contestant, {})
        compiled = _compile(build("llama", "tiny"), contestant, "aot_eager", policy_gpu="H200")
        compiled(tokens, labels=tokens).loss.backward()
        decisions = compiled.fp8graph_backend.decisions
        assert decisions and not any(decision.rewritten for decision in decisions)
        linears = [decision for decision in decisions if decision.site.op == "linear"]
        assert linears and all(f"{recipe} " in d.reason and "on H200, modelled" in d.reason for d in linears)


@pytest.mark.parametrize("config,layers,expected", [("bench-8b-layer", None, 4), ("bench-8b-layer", 6, 6),
                                                     ("llama3-8b", None, 32)])
def test_the_decoder_benchmark_builds_the_layers_it_is_asked_for(config, layers, expected):
    import torch

    from bench.decoder import build_model

    model = build_model({"config": config, "layers": layers, "device": torch.device("meta"), "dtype": torch.bfloat16})
    assert len(model.model.layers) == expected and model.config.num_hidden_layers == expected
    assert next(model.parameters()).dtype == torch.bfloat16
    if config == "llama3-8b":  # the whole model: 8.03 billion parameters, its 128256-token vocabulary
        assert model.config.vocab_size == 128256
        assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.03


def test_the_per_block_compile_backends_are_refused_for_a_model_without_layers(tmp_path):
    import argparse

    from bench.compile_time import run

    args = argparse.Namespace(smoke=True, deep=False, backends=["inductor", "inductor per-block"], repeats=1,
                              out=tmp_path)
    with pytest.raises(SystemExit, match="decoder layers"):
        run(args)


def test_deep_compile_time_benchmark_smoke_compares_regions_with_whole_model_compiles(tmp_path):
    """The deep case's machinery (2 layers here: the second reuses the first's region): every backend measured
    cold and warm, ratios to the first.

    Smoke timings mean nothing (one sample, tiny model); the 12-layer figure is ``--deep`` without ``--smoke``.
    "fp8 whole" (fp8 with regions=None: an option of the same code) is left out to keep the suite short.
    """
    result = _run_bench("compile", tmp_path, "--deep", "--backends", "inductor", "fp8", "inductor per-block")
    assert result["layers"] == 2 and result["model"] == "llama tiny, 2 layers, sequence 16"
    assert result["step"] == "first forward"  # the smoke compiles no backward: half the compiling
    rows = {row["backend"]: row for row in result["rows"]}
    assert list(rows) == ["inductor", "fp8", "inductor per-block"]
    for row in rows.values():
        assert 0 < row["compile_warm_s"] < row["compile_cold_s"]  # a warm start reuses the cache the cold one filled
        assert row["cold_vs_inductor"] == pytest.approx(row["compile_cold_s"] / rows["inductor"]["compile_cold_s"])
    assert [v["case"] for v in result["targets"]] == ["cold", "warm"]  # held to 1.30x below 12 layers


@pytest.mark.parametrize("option", ["--steps", "--stats-every", "--batch-size"])
def test_demo_refuses_counts_below_one(option, capsys):
    import argparse

    from fp8graph.apps import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([option, "0"])
    assert f"argument {option}: must be at least 1, not 0" in capsys.readouterr().err


def test_demo_refuses_a_one_byte_sequence(capsys):
    import argparse

    from fp8graph.apps import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--seq-len", "1"])
    assert "argument --seq-len: must be at least 2 (each byte is trained to predict the next), not 1" in \
        capsys.readouterr().err


def test_demo_refuses_an_unwritable_out_before_training(tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    started = time.perf_counter()
    result = forked.run_python(["-m", "fp8graph", "demo", "--out", str(blocker / "x")])
    assert result.returncode == 1 and time.perf_counter() - started < 60
    assert f"fp8graph demo: cannot write the results to --out {blocker / 'x'}" in result.stderr
    assert "Traceback" not in result.stderr and "fp8graph demo" not in result.stdout  # nothing trained


def test_loss_figure_shows_the_gap_and_single_steps():
    import matplotlib

    matplotlib.use("Agg")
    from fp8graph.inspection.loss_plot import loss_figure

    fp8, reference = [3.0 - 0.01 * i for i in range(40)], [3.0 - 0.012 * i for i in range(40)]
    loss_axis, gap_axis = loss_figure(fp8, reference, "FP32").axes
    assert [line.get_label() for line in loss_axis.get_lines()] == ["FP8 (final 2.610)", "FP32 (final 2.532)"]
    per_step, mean = [line for line in gap_axis.get_lines() if not line.get_label().startswith("_")]
    assert list(per_step.get_ydata()) == pytest.approx([f - r for f, r in zip(fp8, reference)])
    assert mean.get_label() == "mean of 2 steps"
    assert mean.get_ydata()[-1] == pytest.approx((0.002 * 39 + 0.002 * 38) / 2)
    # One step: points, not invisible one-point lines; no "mean of 1 step" repeating the raw gap.
    loss_axis, gap_axis = loss_figure([3.0], [2.5], "BF16").axes
    assert all(line.get_marker() == "o" for line in loss_axis.get_lines())
    assert [line.get_label() for line in gap_axis.get_lines() if not line.get_label().startswith("_")] == ["per step"]


@pytest.mark.parametrize("content,message", [
    ("not json", r"is not a readable JSON result: Expecting value"),
    ('{"workload": "linear_fwd_bwd"}', r"is not a bench result \(it needs a 'workload' among .* and a list of 'rows'\)"),
    ("[1, 2]", r"is not a bench result"),
])
def test_show_names_a_file_that_is_not_a_result(tmp_path, content, message):
    from bench.__main__ import main

    path = tmp_path / "result.json"
    path.write_text(content)
    with pytest.raises(SystemExit, match=rf"python -m bench show: {re.escape(str(path))} {message}"):
        main(["show", str(path)])


@pytest.mark.parametrize("argv", [["linear", "--repeats", "-5"], ["quantize", "--repeats", "0"],
                                  ["decoder", "--layers", "-1"], ["compile", "--repeats", "-1"]])
def test_counts_below_one_are_refused(argv, capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit):
        main(argv)
    assert f"argument {argv[1]}: must be > 0, got {argv[2]}" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("workload", ["linear", "quantize", "decoder"])
def test_a_gpu_measurement_without_a_gpu_says_what_runs_instead(workload):
    from bench.__main__ import main

    with pytest.raises(SystemExit, match=rf"bench {workload} measures on a CUDA GPU.*--smoke.*bench model {workload}"):
        main([workload])


def test_demo_policy_auto_refuses_a_model_whose_every_site_would_stay_in_high_precision():
    """The demo's Llama (hidden 128) gains nothing from FP8 on an H100 at any batch: --policy auto would
    train nothing in FP8, so the demo says so before training instead of comparing BF16 with BF16."""
    import argparse

    from fp8graph.apps import demo
    from fp8graph.models import build

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--policy", "auto", "--batch-size", "2", "--seq-len", "16"])
    with pytest.raises(SystemExit) as refused:
        demo._policy(args, "H100", torch.device("cpu"), build("llama", "demo", seed=0))
    message = str(refused.value)
    assert message.startswith("fp8graph demo --policy auto: the cost model keeps all 29 sites of Llama 'demo' in "
                              "high precision on H100 at 2x16 tokens (the largest, ")
    assert "modelled), so the FP8 run would train nothing in FP8" in message
    assert demo._policy(parser.parse_args([]), "H100", torch.device("cpu"), None) is None  # --policy fp8


def test_a_contestant_child_that_fails_or_outlives_its_time_is_an_error_row(tmp_path):
    """bench decoder and bench moe run each contestant in a fork (bench.forked): a child that exits without
    its row becomes the contestant's error row with the end of its output; one that outlives its time is
    killed."""
    from bench import forked

    failed = forked.row_in_child("delayed", ["decoder", "--no-such-option"], timeout=300)
    assert failed["contestant"] == "delayed" and failed["error"].startswith("exited with code 2:")
    assert "unrecognized arguments: --no-such-option" in failed["error"]
    never_written = tmp_path / "fifo.json"
    os.mkfifo(never_written)  # opening it for reading waits for a writer that never comes
    code, _ = forked.run_bench(["show", str(never_written)], timeout=2)
    assert code is None


def test_the_demo_models_sites_on_the_gpu_it_trains_on(monkeypatch):
    """--policy auto times sites on --gpu, else on the CUDA device the demo trains on, else (on the CPU) the H100."""
    import argparse

    from fp8graph.apps.demo import policy_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert policy_gpu(argparse.Namespace(gpu=None), torch.device("cuda", 0)) == "H200"
    assert policy_gpu(argparse.Namespace(gpu="B200"), torch.device("cuda", 0)) == "B200"
    assert policy_gpu(argparse.Namespace(gpu=None), torch.device("cpu")) == "H100"
