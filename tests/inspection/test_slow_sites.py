"""Sites in FP8 that the cost model puts at several times their BF16 time on their GPU are named, once."""

import copy
import logging

import pytest
import torch

import fp8graph
import fp8graph.backend
from fp8graph.buffers.weight_cache import FILL, PER_CALL, REUSE
from fp8graph.costs import SYMBOLIC_TOKENS, site_times
from fp8graph.costs.gpus import H100
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.inspection import slow_sites as slow_sites_module
from fp8graph.inspection.slow_sites import (SLOWDOWN_REPORTED, casts_weights_per_call, slow_sites, warn_once,
                                            warning_text)
from fp8graph.models import build
from fp8graph.passes.annotate import Decision
from fp8graph.passes.sites import ExpertSite, Site
from fp8graph.recipes.scaling import PRESETS, Float8CurrentScaling

CURRENT = Float8CurrentScaling()
WARNED = "too small to pay for their casts"


@pytest.fixture(autouse=True)
def nothing_warned_yet(monkeypatch):
    """Each test starts from a process that has warned of no site."""
    monkeypatch.setattr(slow_sites_module, "_warned", set())


@pytest.fixture
def graphs_on_a_gpu(monkeypatch):
    """The backend takes its graphs to run on a CUDA device (the cost model's H100: no CUDA device here)."""
    monkeypatch.setattr(fp8graph.backend, "graph_device", lambda inputs: torch.device("cuda", 0))


def _decision(M, K, N, recipe=CURRENT, lowering=Lowering.SCALED_MM, path="proj", experts=None) -> Decision:
    kind = ExpertSite if experts else Site
    site = kind(node=None, op="grouped_mm" if experts else "linear", path=path, M=M, K=K, N=N, dtype=torch.bfloat16)
    if experts:
        site.experts = experts
    return Decision(site, recipe, None if recipe else "kept", lowering if recipe else None)


def test_only_native_fp8_sites_modelled_at_twice_their_bf16_time_or_more_are_slow():
    small, large = _decision(32, 64, 128, path="small"), _decision(16384, 4096, 4096, path="large")
    small_times = site_times(small.site.info, CURRENT, H100)
    assert small_times.fp8_us >= SLOWDOWN_REPORTED * small_times.bf16_us
    assert site_times(large.site.info, CURRENT, H100).speedup > 1  # the model's gain: never reported
    not_judged = [_decision(32, 64, 128, lowering=Lowering.EMULATED),  # the CPU's exact emulation
                  _decision(32, 64, 128, recipe=None),  # kept in high precision
                  _decision(32, 64, 128, recipe=PRESETS["mxfp8"])]  # no FP8 GEMM on the H100 the model knows
    # The same module called twice in a graph: one site
    (slow,) = slow_sites([small, large, *not_judged, _decision(32, 64, 128, path="small")], H100, training=True)
    assert slow.path == "small" and slow.times == site_times(small.site.info, CURRENT, H100, training=True)
    # an inference graph's forward alone is modelled so
    (forward,) = slow_sites([small], H100, training=False)
    assert forward.times == site_times(small.site.info, CURRENT, H100, training=False)


def test_a_symbolic_token_count_is_judged_at_the_tokens_auto_decides_it_at():
    """dynamic=True: a LoRA adapter's down projection (4096 to 16) is slow at SYMBOLIC_TOKENS tokens, a
    4096-square projection is not; the warning says the count was symbolic and what it was modelled at."""
    lora, square = _decision("s0", 4096, 16, path="lora_A"), _decision("s0", 4096, 4096, path="q_proj")
    (slow,) = slow_sites([lora, square], H100, training=True)
    assert slow.path == "lora_A" and slow.times.M == SYMBOLIC_TOKENS
    assert slow.times == site_times(lora.site.info, CURRENT, H100, tokens=SYMBOLIC_TOKENS)
    assert f"lora_A (M, K, N = s0, modelled at {SYMBOLIC_TOKENS}, 4096, 16: " in warning_text([slow])


def test_a_warning_names_an_expert_sites_experts_and_counts_what_it_does_not_name(caplog):
    experts = _decision(64, 64, 128, path="block.experts", experts=8)
    dense = [_decision(32, 64, 128, path=f"head{i}") for i in range(6)]
    slow = slow_sites([experts, *dense], H100, training=True)
    assert [s.path for s in slow] == ["block.experts", *(f"head{i}" for i in range(6))]
    text = warning_text(slow)
    assert "block.experts (E = 8, M, K, N = 64, 64, 128: " in text and "head3 (M, K, N = 32, 64, 128: " in text
    assert "head4" not in text and text.count("; and 2 more.") == 1 and text.startswith("fp8graph: 7 site(s)")
    log = logging.getLogger("fp8graph")
    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        assert warn_once(slow, log) == slow and warn_once(slow, log) == []  # once a process
        assert warn_once(slow_sites([_decision(48, 64, 128, path="head0")], H100, True), log)  # a new shape
    assert caplog.text.count(WARNED) == 2


def test_graphs_that_read_kept_or_folded_weight_copies_are_not_judged():
    """The site model prices a weight's cast at every call: a graph reading the kept copies, or an inference graph
    whose weights Inductor's freezing folded, would be judged on casts it does not make."""
    assert casts_weights_per_call(PER_CALL, grad_enabled=True, freezing=False)
    assert casts_weights_per_call(FILL, grad_enabled=False, freezing=False)
    assert casts_weights_per_call(PER_CALL, grad_enabled=True, freezing=True)  # freezing folds no trained weight
    assert not casts_weights_per_call(REUSE, grad_enabled=True, freezing=False)
    assert not casts_weights_per_call(PER_CALL, grad_enabled=False, freezing=True)


def test_a_cuda_graphs_small_sites_are_named_once_with_their_modelled_times(monkeypatch, caplog):
    """An nn.Sequential's two projections at 32 tokens on the native GEMM (here CPU's _scaled_mm): on CPU they are
    not judged; their graph said to be on a GPU, one warning names both with the H100's modelled times (no CUDA
    device here: running_gpu's H100); a second compile of the same model lists them without warning again, and a
    reusing call's graph (kept copies) is not judged; auto() keeps them and says nothing."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).bfloat16()
    x = torch.randn(32, 64, dtype=torch.bfloat16)

    def step(compiled):
        compiled(x).float().square().mean().backward()

    def compile_(policy=None):
        return fp8graph.compile(copy.deepcopy(model), policy=policy, compiler="aot_eager", lowering="scaled_mm")

    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        on_cpu = compile_()
        step(on_cpu)
        assert on_cpu.fp8graph_backend.slow_sites == [] and WARNED not in caplog.text

        monkeypatch.setattr(fp8graph.backend, "graph_device", lambda inputs: torch.device("cuda", 0))
        on_gpu = compile_()
        for _ in range(2):
            step(on_gpu)
        again = compile_()
        with fp8graph.weights_unchanged(again):
            for _ in range(2):  # fill (its graph judged, nothing new to warn of), then reuse (not judged)
                step(again)
        kept = compile_(fp8graph.policies.auto(gpu="H100"))
        step(kept)
        inference = compile_()
        with torch.no_grad():
            inference(x)
    assert kept.fp8graph_backend.slow_sites == [] and not any(d.rewritten for d in kept.fp8graph_backend.decisions)
    warnings = [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]
    assert len(warnings) == 1, warnings
    slow = on_gpu.fp8graph_backend.slow_sites
    assert [s.path for s in slow] == ["0", "2"] and again.fp8graph_backend.slow_sites == slow
    assert again.fp8graph_backend.weight_cache.mode == REUSE
    # an inference graph's sites are timed forward only (already warned of: listed, not warned again)
    assert [s.times for s in inference.fp8graph_backend.slow_sites] == [
        site_times(s.site, CURRENT, H100, training=False) for s in slow]
    for s, (K, N) in zip(slow, [(64, 128), (128, 64)]):
        assert (s.site.M, s.site.K, s.site.N) == (32, K, N)
        assert s.times == site_times(s.site, CURRENT, H100, training=True)
        assert f"{s.path} (M, K, N = 32, {K}, {N}: {s.times.describe()})" in warnings[0]
    assert "2 site(s) in FP8" in warnings[0] and "policies.auto()" in warnings[0]


def test_a_regions_slow_sites_are_named_for_every_instance_and_explain_adds_no_warning(graphs_on_a_gpu, caplog):
    """A region compiles once for the tiny Llama's two layers: its slow sites are listed under both layers'
    paths, as explain lists them, beside the root graph's lm_head (a vocabulary of 256 puts it in FP8), a warning
    for each graph; explain's own run (which shows every site's times) warns of nothing."""
    model = build("llama", "tiny", seed=0, vocab_size=256)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    compiled = fp8graph.compile(model, compiler="aot_eager", lowering="scaled_mm")
    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        compiled(tokens, labels=tokens).loss.backward()
        assert caplog.text.count(WARNED) == 2
        caplog.clear()
        report = fp8graph.explain(compiled, tokens)
    assert WARNED not in caplog.text
    slow = compiled.fp8graph_backend.slow_sites
    in_fp8 = {r.path for r in report.rewritten}
    assert {s.path for s in slow} == in_fp8 and "lm_head" in in_fp8  # every site of the tiny model, both layers
    assert {p.split(".")[2] for p in in_fp8 if p.startswith("model.layers.")} == {"0", "1"}
