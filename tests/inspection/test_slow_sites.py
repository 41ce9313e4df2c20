"""Sites in FP8 that the cost model puts at several times their BF16 time on their GPU are named, once."""

import copy
import logging

import pytest
import torch

import fp8graph
import fp8graph.backend
from fp8graph.costs import site_times
from fp8graph.costs.gpus import H100
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.costs import SYMBOLIC_TOKENS
from fp8graph.inspection.slow_sites import SLOWDOWN_REPORTED, describe, slow_sites
from fp8graph.passes.annotate import Decision
from fp8graph.passes.sites import Site
from fp8graph.recipes.scaling import Float8CurrentScaling

CURRENT = Float8CurrentScaling()


def _decision(M, K, N, recipe=CURRENT, lowering=Lowering.SCALED_MM, path="proj") -> Decision:
    site = Site(node=None, op="linear", path=path, M=M, K=K, N=N, dtype=torch.bfloat16)
    return Decision(site, recipe, None if recipe else "kept", lowering if recipe else None)


def test_only_native_fp8_sites_modelled_at_twice_their_bf16_time_or_more_are_slow():
    small, large = _decision(32, 64, 128, path="small"), _decision(16384, 4096, 4096, path="large")
    assert site_times(small.site.info, CURRENT, H100).fp8_us >= SLOWDOWN_REPORTED * site_times(
        small.site.info, CURRENT, H100).bf16_us
    assert site_times(large.site.info, CURRENT, H100).speedup > 1  # the model's gain: never reported
    not_judged = [_decision(32, 64, 128, lowering=Lowering.EMULATED),  # the CPU's exact emulation
                  _decision(32, 64, 128, recipe=None)]  # kept in high precision
    (slow,) = slow_sites([small, large, *not_judged], H100, training=True)
    assert slow.path == "small" and slow.times == site_times(small.site.info, CURRENT, H100, training=True)
    assert slow.slowdown == pytest.approx(slow.times.fp8_us / slow.times.bf16_us) and slow.slowdown >= 2
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
    assert f"lora_A (M, K, N = s0, modelled at {SYMBOLIC_TOKENS}, 4096, 16: " in describe([slow])


def test_a_cuda_graphs_small_sites_are_named_once_with_their_modelled_times(monkeypatch, caplog):
    """The tiny MLP's two projections (32 tokens) on the native GEMM (here CPU's _scaled_mm), their graph said to
    be on a GPU: one warning names both with the H100's modelled times (no CUDA device here: running_gpu's H100);
    the next calls add none; auto() keeps them and says nothing; a CPU graph is never judged."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).bfloat16()
    x = torch.randn(32, 64, dtype=torch.bfloat16)

    def step(compiled):
        compiled(x).float().square().mean().backward()

    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        on_cpu = fp8graph.compile(copy.deepcopy(model), compiler="aot_eager", lowering="scaled_mm")
        step(on_cpu)
        assert on_cpu.fp8graph_backend.slow_sites == [] and "too small" not in caplog.text

        monkeypatch.setattr(fp8graph.backend, "cuda_device_of", lambda inputs: torch.device("cuda", 0))
        on_gpu = fp8graph.compile(copy.deepcopy(model), compiler="aot_eager", lowering="scaled_mm")
        for _ in range(3):
            step(on_gpu)
        kept = fp8graph.compile(copy.deepcopy(model), policy=fp8graph.policies.auto(gpu="H100"),
                                compiler="aot_eager", lowering="scaled_mm")
        step(kept)
    assert kept.fp8graph_backend.slow_sites == [] and not any(d.rewritten for d in kept.fp8graph_backend.decisions)
    warnings = [r.getMessage() for r in caplog.records if "too small to pay for their casts" in r.getMessage()]
    assert len(warnings) == 1, warnings
    slow = on_gpu.fp8graph_backend.slow_sites
    assert [s.path for s in slow] == ["0", "2"]
    for s, (K, N) in zip(slow, [(64, 128), (128, 64)]):
        assert (s.site.M, s.site.K, s.site.N) == (32, K, N)
        assert s.times == site_times(s.site, CURRENT, H100, training=True)
        assert f"{s.path} (M, K, N = 32, {K}, {N}: {s.times.describe()})" in warnings[0]
    assert "2 site(s) in FP8" in warnings[0] and "policies.auto()" in warnings[0]


def test_a_regions_slow_sites_are_named_for_every_instance_and_explain_adds_no_warning(monkeypatch, caplog):
    """A region compiles once for the tiny Llama's two layers: its slow sites are named under both layers'
    paths, as explain lists them; explain's own run (which shows every site's times) warns of nothing."""
    from fp8graph.models import build

    monkeypatch.setattr(fp8graph.backend, "cuda_device_of", lambda inputs: torch.device("cuda", 0))
    model = build("llama", "tiny", seed=0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    compiled = fp8graph.compile(model, compiler="aot_eager", lowering="scaled_mm")
    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        compiled(tokens, labels=tokens).loss.backward()
        caplog.clear()
        report = fp8graph.explain(compiled, tokens)
    assert "too small to pay" not in caplog.text
    slow = compiled.fp8graph_backend.slow_sites
    in_fp8 = {r.path for r in report.rewritten}
    assert {s.path for s in slow} == in_fp8  # every site of the tiny model, both layers
    assert {p.split(".")[2] for p in in_fp8 if p.startswith("model.layers.")} == {"0", "1"}
