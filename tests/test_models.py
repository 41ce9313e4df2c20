"""Exact rewrite counts for every model of the zoo.

The expected sites are derived independently from ``named_modules()``: every
``nn.Linear`` and GPT-2 ``Conv1D`` is a site, rewritten when both its K and N
are multiples of 16. The fixed totals guard against both sides drifting together.
"""

import logging

import pytest
import torch
from transformers.pytorch_utils import Conv1D

import fp8graph
from fp8graph.models import FAMILIES, build

# family: (sites, rewritten, activation x activation matmuls)
EXPECTED_COUNTS = {
    "llama": (15, 14, 0),   # 7 per layer + lm_head (N=250 kept)
    "gpt2": (13, 9, 4),     # 4 Conv1D per layer + lm_head; eager attention's 2 matmuls per layer
    "bert": (14, 13, 0),    # 6 per layer + pooler + classifier (N=3 kept)
    "qwen2": (15, 15, 0),   # 7 per layer + tied lm_head
    "mlp": (3, 2, 0),       # up, mid, head (N=10 kept)
}


def example_input(family):
    if family == "mlp":
        return torch.randn(2, 16, 64)
    return torch.randint(0, 250, (2, 16))


def linear_modules(model):
    """``{path: (K, N)}`` of the model's linear layers."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            found[path] = (module.in_features, module.out_features)
        elif isinstance(module, Conv1D):
            found[path] = tuple(module.weight.shape)  # stored (in, out)
    return found


# The MoE block's sites (a router and two expert GEMMs) are checked in tests/passes/test_expert_sites.py.
@pytest.mark.parametrize("family", [family for family in FAMILIES if family != "moe"])
def test_rewrite_counts_and_reasons(family):
    model = build(family, "tiny")
    report = fp8graph.explain(model, example_input(family))
    sites, rewritten, activation_matmuls = EXPECTED_COUNTS[family]
    assert len(report) == sites
    assert len(report.rewritten) == rewritten
    assert sum("activation x activation" in (r.reason or "") for r in report) == activation_matmuls
    assert report.graph_breaks == []  # none but the region boundaries fp8graph makes itself

    expected = linear_modules(model)
    linear_records = {r.path: r for r in report if "activation" not in (r.reason or "")}
    assert set(linear_records) == set(expected)
    for path, (K, N) in expected.items():
        record = linear_records[path]
        assert (record.K, record.N) == (K, N)
        if K % 16 == 0 and N % 16 == 0:
            assert str(record.recipe) == "current(HYBRID)" and record.lowering == "emulated"
        else:
            assert record.recipe is None and "not a multiple of 16" in record.reason
    named = dict(model.named_modules())
    assert all(r.path in named for r in report)


def test_bare_backend_names_sites_like_named_modules(caplog):
    """Without the model at hand, paths come from Dynamo's source names; they must agree."""
    model = build("llama", "tiny")
    with caplog.at_level(logging.INFO, logger="fp8graph"):
        torch.compile(model, backend="fp8", options={"compiler": "eager"})(example_input("llama"))
    logged = [r.getMessage() for r in caplog.records if r.name == "fp8graph"]
    assert len(logged) == 15
    report_paths = [r.path for r in fp8graph.explain(model, example_input("llama"))]
    assert [m.split("fp8graph: ")[1].split(" (")[0] for m in logged] == report_paths


def test_report_prints_a_table():
    report = fp8graph.explain(build("mlp", "tiny"), example_input("mlp"))
    text = str(report)
    assert "2 of 3 sites in FP8" in text
    for piece in ("up", "mid", "head", "current(HYBRID)", "N=10 is not a multiple of 16"):
        assert piece in text


def test_explain_unwraps_a_model_compiled_with_the_backend_string():
    model = build("mlp", "tiny")
    compiled = torch.compile(model, backend="fp8")
    report = fp8graph.explain(compiled, example_input("mlp"))
    assert [r.path for r in report] == ["up", "mid", "head"]


def test_explain_leaves_what_the_process_compiled_before_it_alone():
    """explain compiles the model for its own backend: a function and a model compiled before it, plainly
    and by fp8graph, run on after it without recompiling (no reset of Dynamo's caches)."""
    from torch._dynamo.testing import CompileCounter

    model, x = build("mlp", "tiny"), example_input("mlp")
    counter = CompileCounter()
    plain_function = torch.compile(lambda a: torch.sin(a) + 1, backend=counter)
    plain_model = torch.compile(build("mlp", "tiny"), backend=counter)
    fp8_model = fp8graph.compile(model, compiler="aot_eager")
    for _ in range(2):  # outside fp8graph.weights_unchanged both calls cast their weights: one graph
        plain_function(torch.randn(4)), plain_model(x), fp8_model(x)
    frames, fp8_graphs = counter.frame_count, fp8_model.fp8graph_backend.graph_count
    assert frames == 2 and fp8_graphs == 1

    report = fp8graph.explain(model, x)
    assert [r.path for r in report] == ["up", "mid", "head"]  # explain saw the graph the compiled model holds
    plain_function(torch.randn(4)), plain_model(x), fp8_model(x)
    assert counter.frame_count == frames and fp8_model.fp8graph_backend.graph_count == fp8_graphs


@pytest.mark.parametrize("family", ["llama", "moe"])
def test_build_honours_the_default_device_and_an_explicit_one(family):
    """Without ``device``, ``build`` creates the parameters where torch's default device says: inside ``with
    torch.device("meta")`` a model planned without memory, and on the CPU outside it; ``device`` overrides both."""
    with torch.device("meta"):
        on_meta = build(family, "tiny")
        on_cpu = build(family, "tiny", device="cpu")
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}
    assert {p.device.type for p in build(family, "tiny").parameters()} == {"cpu"}
