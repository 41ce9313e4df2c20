"""The GPU libraries' rules for FP8 GEMM calls, checked on the CPU (``fp8graph.gemm.library_rules``).

First the rules themselves, call by call: a call the library runs passes, each broken rule is named. Then
every call fp8graph's native lowering makes, for every recipe, on a GQA Llama and the MoE block, training
(two optimizer steps), with frozen weights (gradients for the input only) and without gradients, run on
the CPU through the GPU's graph with the libraries stood in for (``tests/gemm_rules.py``): no call may
break a rule of SM 9.0 (SM 10.0 for MXFP8, and the per-tensor and row-wise recipes again there).

Before the scales were spaced 16 bytes apart (``fp8graph.gemm.scaled_gemm.scalars_of``), the delayed
recipe's Llama broke the scale alignment rule in 20 of its 42 calls under aot_eager and in 38 of 42 under
Inductor: the cuBLASLt failure an H200 showed (2026-11-27).
"""

import contextlib

import pytest
import torch

import fp8graph
from fp8graph.gemm import library_rules
from fp8graph.gemm.scaled_gemm import Lowering, scalars_of
from fp8graph.models import build
from gemm_rules import pretend_gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _matrix(rows, columns, dtype=E4M3, column_major=False):
    if column_major:
        return torch.zeros(columns, rows, dtype=torch.uint8).view(dtype).t()
    return torch.zeros(rows, columns, dtype=torch.uint8).view(dtype)


def _scalar_at(offset):
    """A one-element float32 view ``offset`` elements into a buffer."""
    return torch.as_strided(torch.ones(8), (1,), (1,), offset)


def test_a_call_the_library_runs_breaks_no_rule():
    a, b = _matrix(64, 128), _matrix(128, 32, column_major=True)
    assert library_rules.scaled_mm_violations(a, b, torch.ones(()), torch.ones(1), out_dtype=torch.bfloat16) == []
    assert library_rules.scaled_mm_violations(a, b, torch.ones(64, 1), torch.ones(1, 32),
                                              out_dtype=torch.bfloat16) == []
    # M need not be a multiple of 16
    assert library_rules.scaled_mm_violations(_matrix(17, 128), b, torch.ones(1), torch.ones(1),
                                              out_dtype=torch.float32) == []


@pytest.mark.parametrize("case, rule", [
    (lambda: (_matrix(64, 128), _matrix(128, 32, column_major=True), _scalar_at(0), _scalar_at(1)),
     "scale_b is not 16-byte aligned"),
    (lambda: (_matrix(64, 128), _matrix(128, 32, column_major=True), _scalar_at(3), _scalar_at(4)),
     "scale_a is not 16-byte aligned"),
    (lambda: (_matrix(64, 128, E5M2), _matrix(128, 32, E5M2, column_major=True), torch.ones(1), torch.ones(1)),
     "E5M2 x E5M2"),
    (lambda: (_matrix(128, 64).t(), _matrix(128, 32, column_major=True), torch.ones(1), torch.ones(1)),
     "a (64, 128) is not row-major"),
    (lambda: (_matrix(64, 128), _matrix(128, 32), torch.ones(1), torch.ones(1)), "b (128, 32) is not column-major"),
    (lambda: (_matrix(64, 120), _matrix(120, 32, column_major=True), torch.ones(1), torch.ones(1)),
     "K = 120 is not a multiple of 16"),
    (lambda: (_matrix(64, 128), _matrix(128, 24, column_major=True), torch.ones(1), torch.ones(1)),
     "N = 24 is not a multiple of 16"),
    (lambda: (_matrix(64, 256)[:, :128], _matrix(128, 32, column_major=True), torch.ones(1), torch.ones(1)), None),
    (lambda: (_matrix(65, 128)[1:], _matrix(128, 32, column_major=True), torch.ones(1), torch.ones(1)),
     "a is not 256-byte aligned"),
    (lambda: (_matrix(64, 128), _matrix(128, 32, column_major=True), torch.ones(64, 1), torch.ones(32, 1)),
     "scale_b has shape (32, 1), not (1, 32)"),
    (lambda: (_matrix(64, 128), _matrix(128, 32, column_major=True), torch.ones(1, 64).t(), torch.ones(1, 32)),
     None),
    (lambda: (_matrix(64, 128), _matrix(128, 32, column_major=True), torch.ones(64, 2)[:, :1], torch.ones(1, 32)),
     "scale_a is not contiguous"),
    (lambda: (_matrix(64, 128), _matrix(128, 32, column_major=True), torch.ones(1, dtype=torch.float64),
              torch.ones(1)), "scale_a is torch.float64"),
], ids=["scale 4 bytes off", "scale 12 bytes off", "E5M2 x E5M2", "a column-major", "b row-major", "K 120", "N 24",
        "a a slice of wider rows", "a a row into its storage", "row-wise scale_b transposed",
        "row-wise scale_a a column", "row-wise scale_a strided", "float64 scale"])
def test_each_broken_rule_is_named(case, rule):
    a, b, scale_a, scale_b = case()
    violations = library_rules.scaled_mm_violations(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
    if rule is None:
        assert violations == []
    else:
        assert any(rule in violation for violation in violations), violations


def test_tiled_and_grouped_rules():
    a, b = _matrix(64, 256), _matrix(256, 128, column_major=True)
    block_a = torch.ones(2, 64).t()  # 1x128: (M, K/128), strides (1, M)
    padded_b = torch.ones(1, 4).t()  # 128x128: (L4, N/128), strides (1, L4)
    assert library_rules.scaled_mm_v2_violations(a, b, [block_a], [4], [], [padded_b], [5], [], arch=90) == []
    assert "run on SM 9.x only" in " ".join(library_rules.scaled_mm_v2_violations(
        a, b, [block_a], [4], [], [padded_b], [5], [], arch=100))
    assert "scale_a has strides (2, 1), not (1, 64)" in " ".join(library_rules.scaled_mm_v2_violations(
        a, b, [torch.ones(64, 2)], [4], [], [padded_b], [5], [], arch=90))
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32)
    rows = library_rules.grouped_violations(_matrix(50, 64), _matrix(64, 32, column_major=True).expand(3, 64, 32),
                                            torch.ones(50), torch.ones(3, 32), offsets, out_dtype=torch.bfloat16)
    assert rows == []
    weights = library_rules.grouped_violations(_matrix(32, 64), _matrix(64, 16, column_major=True), torch.ones(96),
                                               torch.ones(48), torch.tensor([8, 32, 64], dtype=torch.int32),
                                               out_dtype=torch.bfloat16)
    assert any("group ends [8]" in violation for violation in weights), weights
    assert "SM 9.x only" in " ".join(library_rules.grouped_violations(
        _matrix(50, 64), _matrix(64, 32, column_major=True).expand(3, 64, 32), torch.ones(50), torch.ones(3, 32),
        offsets, out_dtype=torch.bfloat16, arch=100))


def test_scales_read_together_are_each_16_bytes_apart():
    scales = scalars_of(torch.arange(1.0, 6.0))
    for index, scale in enumerate(scales):
        assert scale.item() == index + 1
        assert library_rules._misaligned("scale", scale, library_rules.SCALE_ALIGNMENT_BYTES) == []
    assert library_rules._misaligned("scale", torch.as_strided(torch.ones(5), (1,), (1,), 1), 16)


def _recipe(name):
    return {"current": fp8graph.Float8CurrentScaling(), "delayed": fp8graph.DelayedScaling(amax_history_len=4),
            "rowwise": fp8graph.Float8RowwiseScaling(), "block": fp8graph.Float8BlockScaling(),
            "mxfp8": fp8graph.MXFP8BlockScaling()}[name]


def _llama(recipe_name):
    """A GQA Llama (2 key-value heads for 4 query heads); the tiled recipes' 128-wide shapes for block and MX."""
    if recipe_name in ("block", "mxfp8"):
        return build("llama", "tiny-blocks", num_key_value_heads=2)
    return build("llama", "tiny")


def _llama_calls(compiled, model):
    """Two optimizer steps of two micro-batches, the first step's declared unchanged (the weights' kept casts
    filled, then read), a call with every weight frozen (gradients for the embeddings only: grad_input's GEMMs
    alone), and a call without gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    for step in range(2):
        with fp8graph.weights_unchanged(compiled) if step == 0 else contextlib.nullcontext():
            for _ in range(2):
                tokens = torch.randint(0, 250, (2, 32), generator=generator)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    compiled(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        param.requires_grad_("embed" in name)
    tokens = torch.randint(0, 250, (2, 32), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(tokens, labels=tokens).loss.backward()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(tokens)


def _moe_calls(compiled, model):
    """The MoE block: an optimizer step of two micro-batches declared unchanged (kept casts), one of one, frozen
    experts (gradients for the input), no gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    for micro_batches in (2, 1):
        with fp8graph.weights_unchanged(compiled):
            for _ in range(micro_batches):
                x = torch.randn(2, 40, 64, generator=generator).to(torch.bfloat16)
                compiled(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.requires_grad_(False)
    x = torch.randn(2, 40, 64, generator=generator).to(torch.bfloat16).requires_grad_()
    compiled(x).float().square().mean().backward()
    with torch.no_grad():
        compiled(x)


# (model, recipe, the compute capability whose lowering runs, the others whose rules its calls are held to too:
# per-tensor and row-wise scales lower to the same calls on SM 9.0 and SM 10.0)
@pytest.mark.parametrize("model_name, recipe_name, arch, also", [
    ("llama", "current", 90, (100,)), ("llama", "delayed", 90, (100,)), ("llama", "rowwise", 90, (100,)),
    ("llama", "block", 90, ()), ("llama", "mxfp8", 100, ()),
    ("moe", "current", 90, ()), ("moe", "delayed", 90, ()), ("moe", "rowwise", 90, ()), ("moe", "mxfp8", 100, ()),
], ids=lambda value: "+".join(map(str, value)) if isinstance(value, tuple) else str(value))
def test_every_native_gemm_call_keeps_the_gpu_libraries_rules(monkeypatch, model_name, recipe_name, arch, also):
    torch._dynamo.reset()
    with pretend_gpu(monkeypatch, arch, also) as record:
        model = _llama(recipe_name) if model_name == "llama" else build("moe", "tiny").to(torch.bfloat16)
        compiled = fp8graph.compile(model, policy=_recipe(recipe_name), compiler="aot_eager")
        (_llama_calls if model_name == "llama" else _moe_calls)(compiled, model)
    lowerings = {d.lowering for d in compiled.fp8graph_backend.decisions if d.rewritten}
    assert lowerings == {Lowering.SCALED_MM}
    if recipe_name in ("current", "delayed") or model_name == "moe":  # the recipes "auto" keeps casts for
        assert {"per call", "fill", "reuse"} <= _cache_modes(compiled)
    expected_op = {"moe": "_scaled_grouped_mm"}.get(model_name, "_scaled_mm_v2" if recipe_name in ("block", "mxfp8")
                                                    else "_scaled_mm")
    assert record.ops() == {expected_op}
    record.assert_every_rule_kept()


def _cache_modes(compiled) -> set[str]:
    """The weight-cache modes the compiled graphs were traced in (their targets' names say it)."""
    names = [str(node.target.__name__) for gm in compiled.fp8graph_backend.graph_modules for node in gm.graph.nodes
             if node.op == "call_function" and getattr(node.target, "__name__", "").startswith("fp8graph_")]
    return {"fill" if "_fill_" in name else "reuse" if "_reuse_" in name else "per call" for name in names}


@pytest.mark.parametrize("recipe_name, arch", [("current", 90), ("delayed", 90), ("rowwise", 90), ("block", 90),
                                               ("mxfp8", 100)])
def test_weights_fsdp2_gathered_in_fp8_keep_the_rules(monkeypatch, recipe_name, arch):
    """A weight FSDP2 all-gathered in FP8 (fp8graph.fsdp.shard_casts: the shards' casts, gathered) read by the
    native GEMMs: forward and both backward GEMMs."""
    from fp8graph.fsdp.gathered_weight import GatheredFP8Weight
    from fp8graph.targets.linear_tensorwise import linear_fp8_target
    from fp8graph.targets.linear_tiled import linear_tiled_target
    from helpers import gathered_by_two_ranks

    recipe = _recipe(recipe_name)
    generator = torch.Generator().manual_seed(0)
    weight_hp, x = torch.randn(256, 128, generator=generator), torch.randn(96, 128, generator=generator)
    with pretend_gpu(monkeypatch, arch) as record:
        if recipe.tiled:
            weight = gathered_by_two_ranks(recipe, weight_hp, requires_grad=True)
            output = linear_tiled_target(recipe, Lowering.SCALED_MM)(x.requires_grad_(), weight)
        else:
            amax = weight_hp.abs().amax()
            scale = 448.0 / amax
            weight = GatheredFP8Weight((weight_hp * scale).to(torch.float8_e4m3fn), scale, torch.float32,
                                       form="tensor", amax=amax).requires_grad_()
            state = ((torch.zeros(2, 4), torch.ones(2), torch.zeros(1, 4), torch.ones(1)) if recipe.stateful
                     else (None,) * 4)
            output = linear_fp8_target(recipe, Lowering.SCALED_MM)(x.requires_grad_(), weight, None, None, *state)
        output.backward(torch.randn(output.shape, generator=generator))
    assert len(record.calls) == 3  # output, grad_input, grad_weight
    record.assert_every_rule_kept()


@pytest.mark.inductor
def test_inductors_generated_code_keeps_the_rules_for_delayed_scaling(monkeypatch):
    """The GEMM calls of Inductor's wrapper code (``extern_kernels._scaled_mm(..., out=buf)``, scales as
    ``reinterpret_tensor`` views into the buffers its kernels write), where the delayed recipe failed first."""
    torch._dynamo.reset()
    with pretend_gpu(monkeypatch, 90) as record:
        model = _llama("delayed")
        compiled = fp8graph.compile(model, policy=_recipe("delayed"), compiler="inductor")
        tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                compiled(tokens, labels=tokens).loss.backward()
    assert record.ops() == {"_scaled_mm"}
    record.assert_every_rule_kept()
