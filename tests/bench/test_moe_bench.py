"""``python -m bench model moe`` and ``python -m bench moe``: the MoE block's step, modelled and measured.

The modelled tests compile a small block (models/moe.py's ``tiny`` with 8 experts: hidden 64, top 2, expert
width 32; 64 tokens) for the fake H100 in child processes, as ``bench model moe`` does, and check what
cannot come out right by accident: each grouped GEMM is costed as a GEMM with the FLOPs of its form, BF16's
step runs ``torch._grouped_mm`` and fp8graph's row-wise step ``torch._scaled_grouped_mm``, three per expert
site (forward, grad_input, grad_weight), and a step the model cannot decide is an error row, never a number.
The GPU benchmark cannot run here: its argument checks and its refusal without CUDA are tested, and torchao's
contestant's token groups, padded as torchtitan pads them, with plain ``torch._grouped_mm`` in place of torchao's
FP8 grouped GEMM (its Triton casts need CUDA).
"""

import json
import pathlib

import pytest
import torch

from bench import model as bench_model
from bench.costmodel import costs
from bench.targets import judge

import forked

REPO = pathlib.Path(__file__).resolve().parents[2]

TINY = {"hidden": 64, "experts": 8, "top_k": 2, "expert_width": 32}
TOKENS = 64
S = TOKENS * TINY["top_k"]  # rows of the sorted tokens: every grouped GEMM's S


def _spec(contestant: str, overrides: dict | None = None) -> dict:
    return {"workload": "moe", "config": "tiny", "batch": 1, "sequence": TOKENS, "grad_accumulation": [1, 4],
            "overrides": {"experts": TINY["experts"]} if overrides is None else overrides, "contestant": contestant}


def _run_kept(specs: list[dict]) -> list[dict]:
    """The specs' modelled results in one child process, or kept captures of them (bench.costmodel.captures)."""
    return bench_model.kept_children(600)(specs)


def _model(contestant: str, overrides: dict | None = None) -> dict:
    (result,) = _run_kept([_spec(contestant, overrides)])
    return result


HALF_TOKENS = {"label": "half the tokens", "config": "tiny", "overrides": {"experts": TINY["experts"]}, "batch": 1,
               "sequence": TOKENS // 2}


@pytest.fixture(scope="module")
def steps() -> dict:
    """bf16's, fp8graph row-wise's, current's and delayed's (each keeping the weights' casts between calls:
    cache_weights="auto"), and current's and delayed's cast at every call, modelled steps, one after another in one
    child process; bf16's spec is a sweep of two blocks (the second on half the tokens), as
    ``bench model moe --sweep`` runs them."""
    contestants = ("bf16", "rowwise", "current", "current uncached", "delayed", "delayed uncached")
    specs = [_spec(c) for c in contestants]
    specs[0]["shapes"] = [{"label": None, "config": "tiny", "overrides": specs[0]["overrides"], "batch": 1,
                           "sequence": TOKENS}, HALF_TOKENS]
    results = dict(zip(contestants, _run_kept(specs)))
    for contestant, result in results.items():
        assert "error" not in result, (contestant, result["error"])
    costs.summarize(list(results.values()), costs.Machine())
    return {**{c: r["cases"][0] for c, r in results.items()}, "bf16 cases": results["bf16"]["cases"]}


def test_a_sweep_spec_models_each_of_its_blocks_as_a_case(steps):
    first, second = steps["bf16 cases"]
    assert first["case"].endswith(f"1x{TOKENS}") and second["case"] == "half the tokens"
    assert len(steps["bf16 cases"]) == 2
    # Every grouped GEMM's FLOPs are linear in the routed rows: half the tokens, half the FLOPs.
    assert sum(r["flops"] for r in _grouped(second)) * 2 == pytest.approx(sum(r["flops"] for r in _grouped(first)))


def test_gradient_accumulation_repeats_the_micro_batch_and_adds_gradients_before_one_optimizer_step():
    rows = [{"graph": "0:forward", "kind": "triton", "name": "cast", "count": 1, "read": 10, "written": 5},
            {"graph": "1:backward", "kind": "gemm", "name": "mm", "count": 2, "flops": 1e9},
            {"graph": "optimizer", "kind": "optimizer", "name": "sgd", "count": 3, "read": 8, "written": 4}]
    results = [{"contestant": "bf16", "cases": [{"case": "block", "rows": rows}]}, {"contestant": "x", "error": "e"}]
    bench_model.accumulate(results, [1, 4])
    one, four = results[0]["cases"]
    assert (one["case"], four["case"]) == ("block, 1 micro-batch", "block, 4 micro-batches")
    assert one["rows"] == rows
    assert [(r["name"], r["count"]) for r in four["rows"]] == [
        ("cast", 4), ("mm", 8), ("sgd", 3), ("param.grad += the micro-batch's gradient (autograd, eager)", 9)]
    assert four["rows"][-1]["read"] == 8 and four["rows"][-1]["written"] == 4  # the optimizer row's bytes
    assert results[1] == {"contestant": "x", "error": "e"}


def test_micro_batches_after_the_first_run_the_reusing_graphs_where_weights_are_cast_once_a_step():
    fill = [{"graph": "0:forward", "kind": "triton", "name": "cast weight", "count": 1},
            {"graph": "optimizer", "kind": "optimizer", "name": "sgd", "count": 3, "read": 8, "written": 4}]
    reuse = [{"graph": "2:forward", "kind": "triton", "name": "read copy", "count": 1}]
    results = [{"contestant": "current", "cases": [{"case": "block", "rows": fill, "reuse_rows": reuse}]}]
    bench_model.accumulate(results, [1, 4])
    one, four = results[0]["cases"]
    assert one["rows"] == fill and "reuse_rows" not in one and "reuse_rows" not in four
    assert [(r["name"], r["count"]) for r in four["rows"]] == [
        ("cast weight", 1), ("sgd", 3), ("read copy", 3),
        ("param.grad += the micro-batch's gradient (autograd, eager)", 9)]


def test_a_graph_both_micro_batches_run_is_counted_once_in_each():
    """A regional model's graphs without FP8 weights run in the micro-batch that fills the weight copies, in the
    one that reuses them and in a call outside the declaration (a step of one micro-batch, which casts per call):
    their runs split between ``rows``, ``reuse_rows`` and ``per_call_rows``, where counting them all in the first
    would charge a step of n micro-batches their kernels n + 2 times. Each call's own graphs go to it alone."""
    import types

    from bench.costmodel import workloads

    rows = [{"graph": "0:forward", "kind": "triton", "name": "norm", "count": 3},
            {"graph": "1:forward", "kind": "triton", "name": "cast weight", "count": 4},
            {"graph": "2:forward", "kind": "triton", "name": "read copy", "count": 4},
            {"graph": "3:forward", "kind": "triton", "name": "cast per call", "count": 4},
            {"graph": "optimizer", "kind": "optimizer", "name": "sgd", "count": 3}]
    # The graphs' runs after each call: the shared graph ran once in each, each other graph 4 times in its own.
    micro_batches = workloads._MicroBatches(None, None, None, None, runs=[
        {"0:forward": 1, "1:forward": 4}, {"0:forward": 2, "1:forward": 4, "2:forward": 4},
        {"0:forward": 3, "1:forward": 4, "2:forward": 4, "3:forward": 4}], kinds=["first", "reuse", "per call"])
    case = {"rows": rows}
    micro_batches.split(case, grouped=False)
    assert [(r["name"], r["count"]) for r in case["rows"]] == [("norm", 1), ("cast weight", 4), ("sgd", 3)]
    assert [(r["name"], r["count"]) for r in case["reuse_rows"]] == [("norm", 1), ("read copy", 4)]
    assert [(r["name"], r["count"]) for r in case["per_call_rows"]] == [("norm", 1), ("cast per call", 4),
                                                                        ("sgd", 3)]
    # A reusing call that compiled nothing of its own: the declaration was not seen.
    stale = workloads._MicroBatches(None, None, None, None, runs=[{"0:forward": 1}, {"0:forward": 2}],
                                    kinds=["first", "reuse"])
    with pytest.raises(Exception, match="the reuse micro-batch compiled no graph of its own"):
        stale.split({"rows": rows[:1]}, grouped=False)


def test_each_micro_batch_of_frozen_experts_has_the_grouped_gemms_of_grad_input_alone():
    """``split`` checks every micro-batch's expert GEMMs: six where the experts train (the forward's, grad_input's
    and grad_weight's of both sites), four where they are frozen (``bench model moe --frozen-experts
    --grad-accumulation 1 4``, whose reusing micro-batch has no grad_weight GEMM to find)."""
    from bench.costmodel import workloads

    def step(gemms: int) -> tuple[list[dict], object]:
        rows = [{"graph": f"{graph}:forward", "kind": "gemm", "name": f"fp8 grouped {gemm}", "count": 1}
                for graph in range(3) for gemm in range(gemms)]
        return rows, workloads._MicroBatches(None, None, None, None, runs=[
            {"0:forward": 1}, {"0:forward": 1, "1:forward": 1}, {"0:forward": 1, "1:forward": 1, "2:forward": 1}],
            kinds=["first", "reuse", "per call"])

    rows, micro_batches = step(4)
    micro_batches.split({"rows": rows}, frozen_experts=True)
    with pytest.raises(Exception, match="the reusing micro-batch: 4 grouped GEMMs .* expected 6"):
        step(4)[1].split({"rows": rows})
    with pytest.raises(Exception, match="the reusing micro-batch: 3 grouped GEMMs .* expected 4"):
        rows, micro_batches = step(3)
        micro_batches.split({"rows": rows}, frozen_experts=True)


def _triton_bytes(case: dict, graph: str | None = None, key: str = "rows") -> tuple[int, int]:
    """Bytes the Triton kernels of ``case[key]`` read and write, in ``graph`` or in all of them."""
    kernels = [r for r in case[key] if r["kind"] == "triton" and graph in (None, r["graph"])]
    return (sum(r.get("read", 0) * r["count"] for r in kernels), sum(r.get("written", 0) * r["count"] for r in kernels))


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_per_call_the_backward_casts_each_expert_weight_again_for_grad_input(steps, recipe):
    """Cast per call, a per-tensor expert GEMM keeps no FP8 copy of the weights for its backward
    (``recipe.save_transposes``): the forward casts each expert weight for its own GEMM only, and the backward
    casts it again with the forward's scales in grad_input's layout by one ``fp8graph::quantize_transposed``
    launch a weight, reading the BF16 weight once and writing the transposed bytes. A step of one micro-batch of
    the contestant that keeps weight casts (outside a declaration) runs the same kernels as the one without."""
    per_call, cached = steps[f"{recipe} uncached"], steps[recipe]
    experts, hidden, width = TINY["experts"], TINY["hidden"], TINY["expert_width"]
    weight_elements = sorted([experts * 2 * width * hidden, experts * hidden * width])  # gate_up, down
    casts = [r for r in per_call["rows"] if "quantize_transposed" in r["name"]]
    assert [r["graph"] for r in casts] == ["1:backward"] * 2
    assert sorted(r["read"] for r in casts) == [2 * n + experts * 4 for n in weight_elements]  # BF16, a scale each
    assert sorted(r["written"] for r in casts) == weight_elements
    assert [r for r in per_call["rows"] if "transpose_fp8" in r["name"] and r["detail"].startswith(f"{experts}x")] \
        == []
    assert _moved(per_call) == _moved({"rows": cached["per_call_rows"]})
    assert sorted(r["name"] for r in cached["per_call_rows"] if r["kind"] == "extern") == \
        sorted(r["name"] for r in per_call["rows"] if r["kind"] == "extern")


def test_row_wise_casts_each_expert_weight_along_n_for_grad_input_by_one_kernel(steps):
    """Row-wise's grad_input GEMM reads each expert weight cast along N, one scale per expert and column: one
    ``fp8graph::quantize_expert_columns`` launch a weight casts it, reading the BF16 weight once and writing the
    transposed bytes (E, K, N) and the scales (E, K) (``fp8graph.targets.grouped._cast_expert_columns``), where an
    amax reduction and a transposing cast read it twice: in the backward of a step cast at every call, in the
    forward of a fill (the first micro-batch of a step that keeps the casts), written straight into the kept copy
    (``fp8graph::quantize_expert_columns_into_``: no kernel copies it there), and never in a micro-batch reading
    the copies."""
    experts, hidden, width = TINY["experts"], TINY["hidden"], TINY["expert_width"]
    weights = sorted([(2 * width, hidden), (hidden, width)])  # gate_up (E, 2 width, hidden), down (E, hidden, width)
    rowwise = steps["rowwise"]
    for key, graph in (("per_call_rows", "backward"), ("rows", "forward")):
        casts = sorted((r for r in rowwise[key] if "quantize_expert_columns" in r["name"]), key=lambda r: r["read"])
        assert [r["graph"].split(":")[1] for r in casts] == [graph] * 2, key
        assert [r["read"] for r in casts] == [2 * experts * n * k for n, k in weights], key
        assert [r["written"] for r in casts] == [experts * n * k + experts * k * 4 for n, k in weights], key
        assert all(("_into_" in r["name"]) is (key == "rows") for r in casts), key
    assert [r for r in rowwise["reuse_rows"] if "quantize_expert_columns" in r["name"]] == []
    # The fill's Triton kernels move no more bytes than a step casting at every call, but for the copies' scales
    # (written, read again with their inverses): no kernel of its own copies a cast.
    scales = 4 * experts * sum(n + k for n, k in weights)
    assert sum(_triton_bytes(rowwise)) <= sum(_triton_bytes(rowwise, key="per_call_rows")) + 4 * scales


def test_grad_weight_s_operands_are_laid_out_by_one_pass_each(steps):
    """The weight-gradient GEMM reads each operand transposed, each group zero-padded to 16 tokens: the per-tensor
    recipes' operands are laid out by the kernels that cast them, pads included, in tiles
    (``fp8graph.gemm.grouped_gemm``), with no ``fp8graph::transpose_fp8`` pass of their own; row-wise's operands, cast per group and
    column, are cast and laid out by one ``fp8graph::quantize_group_columns_placed`` launch each, reading the
    high-precision rows where they lie (the input's through the gather's index). No Triton kernel stores a byte a row apart
    that BF16's step does not (the router's top-k backward scatters a row's few gradients; scattering the
    operands' columns in place cost 28 ms a step on the H200: ``bench.costmodel.coalescing``), none scatters
    the rows, and none fills a whole padded buffer."""
    experts, hidden, width = TINY["experts"], TINY["hidden"], TINY["expert_width"]
    padded_rows = -(-(S + experts * 16) // 16) * 16
    operand_widths = (hidden, width, 2 * width, hidden)  # down: grad_output, input; gate_up: grad_output, input
    # gate_up's gathered input and its grad_output (SwiGLU's gradient) are placed by the kernels that cast them, so
    # are the down projection's grad_output (the combine's gradient, gathered and weighted) and its input (SwiGLU)
    for contestant in ("current", "delayed"):
        assert [r for r in steps[contestant]["rows"] if r["kind"] == "extern" and "transpose_fp8" in r["name"]] == []
    # fp8graph::swiglu_forward_placed: gate_up's BF16 output (S, 2 width), the scale and the offsets read; SwiGLU's
    # FP8 rows, their placed copy and each group's amaxes (a block of 64 columns) written.
    [swiglu] = [r for r in steps["current"]["rows"] if r["kind"] == "extern" and "swiglu_forward_placed" in r["name"]]
    assert swiglu["read"] == S * 2 * width * 2 + 4 + experts * 4
    assert swiglu["written"] == S * width + padded_rows * width + (experts + 1) * -(-width // 64) * 4
    # fp8graph::quantize_rows_placed: S rows of the TOKENS source through the gather's index (S,), the scale and
    # the offsets read; the FP8 rows, their placed copy and each group's amaxes (a block of 64 columns each) written.
    [rows_placed] = [r for r in steps["current"]["rows"] if r["kind"] == "extern" and "quantize_rows_placed" in r["name"]]
    assert rows_placed["read"] == S * hidden * 2 + S * 8 + 4 + experts * 4
    assert rows_placed["written"] == S * hidden + padded_rows * hidden + (experts + 1) * -(-hidden // 64) * 4
    # Of those reads, the source's rows read again (a token's top_k times, less one): where bytes are counted as
    # Inductor counts its own gathers (the source once), they are not.
    assert rows_placed["regathered"] == (S - TOKENS) * hidden * 2
    # fp8graph::swiglu_backward_placed: gate_up's BF16 output (S, 2 width) and h's gradient (S, width), the scale and
    # the offsets read; the gradient's FP8 rows, their placed copy and each group's amaxes (a block of 64 columns of
    # each half) written.
    [swiglu] = [r for r in steps["current"]["rows"] if r["kind"] == "extern" and "swiglu_backward_placed" in r["name"]]
    assert swiglu["read"] == S * 2 * width * 2 + S * width * 2 + 4 + experts * 4
    assert swiglu["written"] == S * 2 * width + padded_rows * 2 * width + (experts + 1) * 2 * -(-width // 64) * 4
    # fp8graph::quantize_weighted_rows_placed: S rows of the combine's gradient (TOKENS, hidden) through the index
    # of each row's token (S,), the routing weights (S,), the GEMM's output (S, hidden) for their gradient, the
    # scale and the offsets read; the FP8 rows, their placed copy, each group's amaxes and each row's dot written.
    [weighted] = [r for r in steps["current"]["rows"]
                  if r["kind"] == "extern" and "quantize_weighted_rows_placed" in r["name"]]
    assert weighted["read"] == S * hidden * 2 + S * 8 + S * 2 + S * hidden * 2 + 4 + experts * 4
    assert weighted["written"] == S * hidden + padded_rows * hidden + (experts + 1) * -(-hidden // 64) * 4 + S * 4
    assert weighted["regathered"] == (S - TOKENS) * hidden * 2
    placed = [r for r in steps["rowwise"]["rows"] if r["kind"] == "extern"]
    assert [r for r in placed if "transpose_fp8" in r["name"]] == []
    # fp8graph::quantize_weighted_rows_rowwise: the combine's gradient as quantize_weighted_rows_placed reads it,
    # with a scale a row (S,) for the one scale; the FP8 rows, their placed copy cast per group and column, its
    # scales (E, hidden) and each row's dot written.
    [weighted] = [r for r in placed if "quantize_weighted_rows_rowwise" in r["name"]]
    assert weighted["read"] == S * hidden * 2 + S * 8 + S * 2 + S * hidden * 2 + S * 4 + experts * 4
    assert weighted["written"] == S * hidden + (padded_rows + experts * 4) * hidden + S * 4
    placed = [r for r in placed if "quantize_group_columns_placed" in r["name"]]
    # fp8graph::swiglu_backward_rowwise: gate_up's BF16 output (S, 2 width) and h's gradient (S, width), a scale a
    # row, the column scales (E + 1, 2 width) and the offsets read; the gradient's FP8 rows and its placed copy
    # written (and its amax walk before it reads the same operands).
    [swiglu] = [r for r in steps["rowwise"]["rows"] if r["kind"] == "extern"
                and "fp8graph.swiglu_backward_rowwise.default" in r["name"]]
    assert swiglu["read"] == S * 2 * width * 2 + S * width * 2 + S * 4 + (experts + 1) * 2 * width * 4 + experts * 4
    assert swiglu["written"] == S * 2 * width + padded_rows * 2 * width
    # Each BF16 operand and the offsets: down's input (S, width), gate_up's input its S rows gathered from the
    # TOKENS source rows (bench.costmodel.costs.GATHERING_OPS) and the gather's index (S,).
    offsets = experts * 4
    assert sorted(r["read"] for r in placed) == sorted([S * width * 2 + offsets, S * hidden * 2 + S * 8 + offsets]), \
        [r["detail"] for r in placed]
    assert sorted(r["written"] for r in placed) == sorted((padded_rows + experts * 4) * w for w in operand_widths[1::2])
    for contestant in ("rowwise", "current"):
        rows = steps[contestant]["rows"]
        triton = [r for r in rows if r["kind"] == "triton"]
        assert _scattered(steps[contestant]) == _scattered(steps["bf16"]), contestant
        scatters = [r["name"] for r in triton if ("index_copy" in r["name"] or "index_fill" in r["name"])
                    and r["written"] > padded_rows * 8]  # beyond the sources' (padded_rows,) int64
        assert scatters == [], contestant
        whole_fills = [r["name"] for r in triton if r["graph"].endswith("backward") and r["read"] == 0
                       and r["largest_numel"] in {padded_rows * w for w in operand_widths}]
        assert whole_fills == [], contestant


def _scattered(case: dict) -> int:
    return sum(r.get("scattered", 0) * r["count"] for r in case["rows"] if r["kind"] == "triton")


def test_current_scaling_lays_the_input_out_for_grad_weight_in_the_forward(steps):
    """grad_weight's right operands, the inputs' casts in groups padded to 16 tokens, are laid out in the forward
    (``fp8graph.targets.grouped._placed_in_the_forward``): the gathered input of gate_up by the kernel that casts
    it (``fp8graph::quantize_rows_placed``), the down projection's by the kernel that computes SwiGLU and casts it
    (``fp8graph::swiglu_forward_placed``); the
    backward lays out only the grad_outputs' casts, each by the kernel that computes and casts it (the down
    projection's from the combine's gradient, gate_up's SwiGLU's gradient): it never moves a saved cast. Each FP8
    operand is stored once for its GEMM and its transpose."""
    assert [r for r in steps["current"]["rows"] if r["kind"] == "extern" and "transpose_fp8" in r["name"]] == []
    placing = {name: [r["graph"] for r in steps["current"]["rows"] if f"fp8graph.{name}." in r["name"]]
               for name in ("quantize_rows_placed", "swiglu_forward_placed", "quantize_weighted_rows_placed",
                            "swiglu_backward_placed")}
    assert placing == {"quantize_rows_placed": ["0:forward"], "swiglu_forward_placed": ["0:forward"],
                       "quantize_weighted_rows_placed": ["1:backward"], "swiglu_backward_placed": ["1:backward"]}, \
        placing
    assert sum(r.get("duplicate_written", 0) * r["count"] for r in steps["current"]["rows"]) == 0


def test_a_fill_writes_the_weight_copies_where_it_casts_them(steps):
    """The first micro-batch of ``current`` casts each expert weight into the copies the other
    micro-batches read, and its GEMMs read those copies: the cast kernel stores each FP8 value once
    (``fp8graph.targets.kept_copies``), both layouts from one read of the weight. Its forward stores what casting
    per call stores there, plus grad_input's layout (which a step casting per call casts in its backward) and
    each copy's scales, and reads no more; the whole fill moves no more than casting per call."""
    cached, current = steps["current"], steps["current uncached"]
    assert sum(r.get("duplicate_written", 0) * r["count"] for r in cached["rows"]) == 0
    scales = 2 * TINY["experts"] * 4  # an fp32 scale an expert, for each of the two expert weights
    transposed = TINY["experts"] * 3 * TINY["hidden"] * TINY["expert_width"]  # an FP8 byte an element of both
    assert _triton_bytes(cached, "0:forward")[1] <= _triton_bytes(current, "0:forward")[1] + transposed + scales
    assert _triton_bytes(cached, "0:forward")[0] <= _triton_bytes(current, "0:forward")[0] + scales
    assert _moved(cached) <= _moved(current)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_at_many_tokens_an_expert_the_forward_writes_grad_inputs_copy_with_its_cast(recipe):
    """Where a site routes enough rows that FP8's saving on its input pays for the weights' copy for grad_input
    (S >= E x (N + 16): 8 experts of 64 output rows each, 512 tokens routed twice), the forward keeps it
    (``fp8graph.targets.grouped._recasts_weight``): one ``fp8graph::quantize_both_layouts`` launch a weight casts
    it into both GEMMs' layouts from one read of the BF16 weight (delayed scaling's amaxes with it, a partial a
    64 x 64 tile), and the backward casts no weight again."""
    (result,) = _run_kept([{**_spec(f"{recipe} uncached"), "sequence": 8 * TOKENS}])
    assert "error" not in result, result["error"]
    rows = result["cases"][0]["rows"]
    experts, hidden, width = TINY["experts"], TINY["hidden"], TINY["expert_width"]
    weight_elements = sorted([experts * 2 * width * hidden, experts * hidden * width])  # gate_up, down
    casts = sorted((r for r in rows if r["kind"] == "extern" and "quantize_both_layouts" in r["name"]),
                   key=lambda r: r["written"])
    assert [r["graph"] for r in casts] == ["0:forward"] * 2
    tiles = [experts, experts]  # each (N, K) matrix is one 64 x 64 tile: gate_up's 64 x 64, down's 64 x 32
    amaxes = [4 * t for t in tiles] if recipe == "delayed" else [0, 0]
    assert [r["read"] for r in casts] == [2 * n + experts * 4 for n in weight_elements]  # BF16, a scale each
    assert [r["written"] for r in casts] == [2 * n + a for n, a in zip(weight_elements, amaxes)]
    assert [r for r in rows if "quantize_transposed" in r["name"]] == []
    assert [r for r in rows if "transpose_fp8" in r["name"] and r["detail"].startswith(f"{experts}x")] == []


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_a_fill_writes_both_copies_by_the_kernel_that_casts_and_moves_no_more_than_casting_per_call(steps, recipe):
    """A fill casts each expert weight straight into both copies, the forward GEMM's layout and grad_input's, by
    one ``fp8graph::quantize_both_layouts_into_`` launch a weight (delayed scaling's amaxes taken with it, a
    partial a 64 x 64 tile; ``fp8graph.targets.grouped``): one read of the BF16 weight, each FP8 byte stored once,
    never a transpose of its own, and the fill moves no more bytes than a step that casts at every call (which
    casts the weight again for grad_input in its backward), so a call after each optimizer step loses nothing by
    keeping the copies. Calls that reuse the copies cast no weight."""
    cached, per_call = steps[recipe], steps[f"{recipe} uncached"]
    experts, hidden, width = TINY["experts"], TINY["hidden"], TINY["expert_width"]
    weight_elements = sorted([experts * 2 * width * hidden, experts * hidden * width])  # gate_up, down
    fills = sorted((r for r in cached["rows"] if r["kind"] == "extern" and "quantize_both_layouts_into_" in r["name"]),
                   key=lambda r: r["read"])
    assert [r["graph"] for r in fills] == ["0:forward"] * 2
    amaxes = [experts * 4] * 2 if recipe == "delayed" else [0, 0]  # one 64 x 64 tile a matrix: 64 x 32, 64 x 64
    assert [r["read"] for r in fills] == [2 * n + experts * 4 for n in weight_elements]  # BF16, a scale each
    assert [r["written"] for r in fills] == [2 * n + a for n, a in zip(weight_elements, amaxes)]
    for rows in (cached["rows"], cached["reuse_rows"], per_call["rows"]):
        assert [r for r in rows if "transpose_fp8_into_" in r["name"]] == []
    assert [r for r in cached["reuse_rows"] if "quantize_both_layouts" in r["name"]] == []
    assert sum(r.get("duplicate_written", 0) * r["count"] for r in cached["rows"]) == 0
    # Casting per call casts grad_input's layout again in the backward, from the BF16 weight
    # (fp8graph::quantize_transposed): the fill moves fewer bytes, though it writes the copies' scales and reads
    # them again with their inverses.
    scales = 2 * experts * 4
    assert _moved(cached) <= _moved(per_call) + 4 * scales
    assert [r["graph"] for r in per_call["rows"] if "quantize_transposed" in r["name"]] == ["1:backward"] * 2


def _moved(case: dict) -> int:
    """Bytes read and written by a step's Triton kernels and fp8graph's own ops (its GEMMs and SGD left out)."""
    return sum((r["read"] + r["written"]) * r["count"] for r in case["rows"]
               if r["kind"] == "triton" or (r["kind"] == "extern" and "fp8graph" in r["name"]))


@pytest.mark.parametrize("contestant", ["current", "rowwise"])
def test_a_step_that_keeps_the_weights_cast_reads_them_once_and_its_other_micro_batches_never(steps, contestant):
    """The first micro-batch casts the weights as a step casting at every call does, writing a copy in each GEMM's
    layout (row-wise: along K and along N); the others read the copies instead of the BF16 expert weights."""
    cached = steps[contestant]
    expert_weight_bytes = TINY["experts"] * 3 * TINY["hidden"] * TINY["expert_width"] * 2  # BF16 gate_up + down
    # The others read no BF16 weight element (at least once fewer: Inductor fuses amax and cast where they fit;
    # row-wise reads each weight twice to cast it, once each way: Inductor's cast along K,
    # fp8graph::quantize_expert_columns along N).
    reads = 2 if contestant == "rowwise" else 1
    # What the others read instead: the copies' fp32 scales (an expert's, or a row's of each layout).
    scale_bytes = 4 * TINY["experts"] * (2 if contestant == "current" else 3 * (TINY["hidden"] + TINY["expert_width"]))

    def read(key):  # by Triton kernels and fp8graph's ops
        return sum(r["read"] * r["count"] for r in cached[key]
                   if r["kind"] == "triton" or (r["kind"] == "extern" and "fp8graph" in r["name"]))

    assert read("rows") - read("reuse_rows") >= reads * expert_weight_bytes - scale_bytes
    assert len(_grouped(cached)) == len(_grouped({"rows": cached["reuse_rows"]})) == 6


def test_the_sweep_has_the_shapes_people_train_at_and_refuses_shape_options():
    from bench.__main__ import main
    from bench.moe import SWEEP

    assert [shape.tokens_per_expert for shape in SWEEP] == [256, 1024, 2048, 4096, 512]
    assert SWEEP[3].label == "DeepSeek-V3 experts, 8 a rank, 8x4096, 4096 tokens an expert"
    with pytest.raises(SystemExit, match="--sweep models its own shapes.*drop --override, --batch"):
        main(["model", "moe", "--sweep", "--override", "experts=8", "--batch", "2"])


def test_the_sweep_targets_take_each_case_s_best_recipe():
    case = "Qwen3-30B-A3B, 8x4096, 2048 tokens an expert, 4 micro-batches"
    small = "Qwen3-30B-A3B, 1x4096, 256 tokens an expert, 4 micro-batches"
    rows = [{"contestant": "bf16", "case": case, "vs_bf16": 1.0},
            {"contestant": "rowwise", "case": case, "vs_bf16": 1.1, "vs_torchao_moe_rowwise": 1.2},
            {"contestant": "delayed", "case": case, "vs_bf16": 1.3, "vs_torchao_moe_rowwise": 1.1},
            {"contestant": "current", "case": small, "vs_bf16": 0.8},
            {"contestant": "auto", "case": small, "vs_bf16": 1.0},       # a policy's row, not a recipe's
            {"contestant": "auto delayed", "case": case, "vs_bf16": 0.99}]
    verdicts = [(v["target"], v["case"], v["measured"], v["met"])
                for v in judge({"workload": "model_moe", "rows": rows}) if v["target"].startswith("best recipe")]
    assert verdicts == [
        ("best recipe: step over BF16, >= 2048 tokens an expert (modelled)", f"delayed ({case})", 1.3, True),
        ("best recipe: step over torchao moe rowwise, >= 2048 tokens an expert (modelled)", f"rowwise ({case})",
         1.2, True),
        ("best recipe: step over BF16, Qwen3 at 256 tokens an expert, 4 micro-batches (modelled)",
         f"current ({small})", 0.8, False),
        ("best recipe: step over BF16, >= 2048 tokens an expert, 4 micro-batches (modelled)", f"delayed ({case})",
         1.3, True)]
    auto = [(v["case"], v["met"]) for v in judge({"workload": "model_moe", "rows": rows})
            if v["target"] == "policies.auto(): step over BF16 (modelled)"]
    assert auto == [(f"auto ({small})", True), (f"auto delayed ({case})", False)]


def _grouped(case: dict) -> list[dict]:
    """The grouped GEMM calls (Triton kernels that feed one carry its name among their fused ops)."""
    return [row for row in case["rows"] if row["kind"] != "triton" and "grouped_mm" in row["name"]]


def test_bf16_runs_grouped_mm_costed_as_gemms_with_their_flops(steps):
    grouped = _grouped(steps["bf16"])
    assert {row["name"] for row in grouped} == {"extern_kernels._grouped_mm"}
    assert all(row["kind"] == "gemm" and row["gemm"] == "bf16 grouped" for row in grouped)
    h, i = TINY["hidden"], TINY["expert_width"]
    gate_up, down = 2.0 * S * h * (2 * i), 2.0 * S * i * h
    # Each site: forward and grad_input in the rows form, grad_weight in the weights form, all 2 S K N.
    assert sorted(row["flops"] for row in grouped) == sorted([gate_up] * 3 + [down] * 3)
    forms = sorted(row["detail"].split("(")[1].split(")")[0] for row in grouped)
    assert forms == ["rows"] * 4 + ["weights"] * 2
    assert [row["graph"].split(":")[1] for row in grouped].count("forward") == 2
    summary = steps["bf16"]["summary"]
    router = 3 * 2.0 * TOKENS * h * TINY["experts"]  # the router's forward, grad_input and grad_weight
    assert summary["gemm_tflop"] * 1e12 == pytest.approx(3 * (gate_up + down) + router)


def test_fp8graph_rowwise_runs_three_scaled_grouped_gemms_per_expert_site(steps):
    grouped = _grouped(steps["rowwise"])
    assert {row["name"] for row in grouped} == {"extern_kernels._scaled_grouped_mm"}
    assert all(row["kind"] == "gemm" and row["gemm"] == "fp8 rowwise grouped" for row in grouped)
    assert len(grouped) == 6 and [row["graph"].split(":")[1] for row in grouped].count("forward") == 2
    h, i = TINY["hidden"], TINY["expert_width"]
    rows_form = sorted(row["flops"] for row in grouped if "(rows)" in row["detail"])
    assert rows_form == sorted([2.0 * S * h * 2 * i] * 2 + [2.0 * S * i * h] * 2)
    # grad_weight reduces over each group's tokens zero-padded to 16 (fp8graph.numerics.groups): its operand
    # has S + 16 E rows, rounded up to 16, and the GEMM is costed on them.
    padded = -(-(S + TINY["experts"] * 16) // 16) * 16
    weights_form = sorted(row["flops"] for row in grouped if "(weights)" in row["detail"])
    assert weights_form == sorted([2.0 * 2 * i * padded * h, 2.0 * h * padded * i])
    assert not any(row["name"] == "extern_kernels._grouped_mm" for row in steps["rowwise"]["rows"])
    assert steps["rowwise"]["note"].startswith("fp8graph: 2 of 3 sites in FP8; kept: gate (linear): MoE router")


def test_the_gathered_tokens_are_cast_on_the_way_and_never_stored_in_bf16(steps):
    """The sm_90 forward of current scaling: the amax reads the T hidden rows, and the kernel that gathers the S
    sorted rows casts them on the way (``fp8graph::quantize_rows_placed``: the hidden states read through the
    gather's index, FP8 stores in the forward GEMM's layout and grad_weight's); no kernel stores the gathered rows
    in BF16 (fp8graph.passes.expert_sites.read_gather)."""
    forward = [row for row in steps["current"]["rows"] if row["graph"].endswith("forward")]
    tokens, hidden = TOKENS, TINY["hidden"]
    source_amax = [r for r in forward if r["kind"] == "triton" and "amax" in r["name"] and "index" not in r["name"]
                   and r["read"] == tokens * hidden * 2]
    gather_cast = [r for r in forward if "quantize_rows_placed" in r["name"]
                   and "x".join(map(str, (tokens, hidden))) + ":bfloat16" in r["detail"]]
    assert len(source_amax) == 1 and len(gather_cast) == 1, [(r["name"], r["read"], r["written"]) for r in forward]
    assert not any(r["written"] == S * hidden * 2 for r in forward if r["kind"] == "triton"), \
        "gathered rows stored in BF16"


def test_rowwise_gathers_the_fp8_bytes_of_its_rows_not_their_scaled_values_in_fp32(steps):
    """Row-wise casts the TOKENS source rows, a scale a row, before the S sorted rows are gathered: the cast stores
    the FP8 bytes and the row scales, and the gather reads those bytes (and the index). Left to itself, Inductor
    folded the FP8 conversion into the gather and stored the scaled rows in fp32: four bytes an element written,
    and gathered, where FP8 takes one."""
    forward = [r for r in steps["rowwise"]["rows"] if r["graph"].endswith("forward") and r["kind"] == "triton"]
    tokens, hidden = TOKENS, TINY["hidden"]
    casts = [r for r in forward if "amax" in r["name"] and "index" not in r["name"] and r["read"] == tokens * hidden * 2]
    gathers = [r for r in forward if "index" in r["name"] and "sum" not in r["name"] and r["written"] == S * hidden]
    assert len(casts) == 1 and len(gathers) == 1, [(r["name"], r["read"], r["written"]) for r in forward]
    assert casts[0]["written"] == tokens * hidden + tokens * 4
    assert gathers[0]["read"] == tokens * hidden + S * 8


@pytest.mark.parametrize("contestant", ["current", "delayed", "rowwise"])
def test_swiglus_gradient_is_computed_and_cast_by_one_kernel(steps, contestant):
    """The per-tensor recipes' backward computes SwiGLU's gradient inside ``fp8graph::swiglu_backward_placed``, which
    casts it and lays it out for gate_up's grad_weight (current scaling reads the operands once before it, for
    the amax: ``fp8graph::swiglu_backward_amax``), row-wise's inside ``fp8graph::swiglu_backward_rowwise`` (a scale
    a row and a scale a group and column, their amaxes from ``swiglu_backward_rowwise_amax`` before it): no Triton
    kernel of the backward computes silu's derivative or stores the gradient, in BF16 or in FP8."""
    backward = [r for r in steps[contestant]["rows"] if r["graph"].endswith("backward")]
    derivative = [r["name"] for r in backward if r["kind"] == "triton" and "sigmoid" in r["name"]]
    ops = sorted(r["name"].split(".")[3] for r in backward if r["kind"] == "extern" and "swiglu" in r["name"])
    expected = {"current": ["swiglu_backward_amax", "swiglu_backward_placed"], "delayed": ["swiglu_backward_placed"],
                "rowwise": ["swiglu_backward_rowwise", "swiglu_backward_rowwise_amax"]}[contestant]
    assert derivative == [] and ops == expected, (derivative, ops)


def test_rowwise_casts_the_combines_gradient_for_both_down_projection_gemms_in_one_kernel(steps):
    """Row-wise's backward gathers the combine's gradient, weighs it and casts it per row (grad_input's operand)
    and per group and column, laid out (grad_weight's), in one kernel (``fp8graph::quantize_weighted_rows_rowwise``)
    that reads the (TOKENS, hidden) gradient through the index: no Triton kernel of the backward stores the
    weighted (S, hidden) gradient, in BF16 or FP8, and ``quantize_group_columns_placed`` casts nothing there (gate_up's
    gradient is SwiGLU's kernel's)."""
    backward = [r for r in steps["rowwise"]["rows"] if r["graph"].endswith("backward")]
    hidden, width = TINY["hidden"], TINY["expert_width"]
    combine = [r["detail"] for r in backward if "fp8graph.quantize_weighted_rows_rowwise." in r["name"]]
    assert len(combine) == 1 and combine[0].startswith(f"{TOKENS}x{hidden}:bfloat16"), combine
    group_columns = [r["detail"] for r in backward if "fp8graph.quantize_group_columns_placed." in r["name"]]
    assert group_columns == [], group_columns
    # (The gather's backward zeroes and scatter-adds grad_input into (TOKENS, hidden) fp32: S hidden 2 bytes too.)
    stored = [r["name"] for r in backward if r["kind"] == "triton" and r["written"] in (S * hidden, S * hidden * 2)
              and "index_put" not in r["name"] and not ("new_zeros" in r["name"] and r["read"] == 0)]
    assert stored == [], stored


def test_the_swiglu_between_the_expert_gemms_lives_only_in_the_cast_kernels(steps):
    """silu(gate) * up, the down projection's input, is computed inside the kernels that take its amax and cast it
    (reading the gate_up GEMM's BF16 output), never by a kernel of its own that would store it in BF16: current
    scaling's amax in an Inductor reduction, the cast for both of the down projection's GEMMs in
    ``fp8graph::swiglu_forward_placed``; delayed scaling's cast alone, its scale from the history."""
    gate_up_bytes = S * 2 * TINY["expert_width"] * 2
    for contestant, reductions in (("current", 1), ("delayed", 0)):
        forward = [row for row in steps[contestant]["rows"] if row["graph"].endswith("forward")]
        swiglu = [r for r in forward if r["kind"] == "triton" and "silu" in r["name"]]
        assert len(swiglu) == reductions and all("amax" in r["name"] and r["written"] < S * TINY["expert_width"]
                                                 for r in swiglu), \
            [r["name"] for r in swiglu]
        assert all(r["read"] >= gate_up_bytes for r in swiglu)
        [cast] = [r for r in forward if r["kind"] == "extern" and "swiglu_forward_placed" in r["name"]]
        assert cast["read"] >= gate_up_bytes


@pytest.fixture(scope="module")
def frozen_steps() -> dict:
    """current's and row-wise's modelled steps with the experts' weights frozen (``--frozen-experts``), one after
    the other in one child process."""
    contestants = ("current", "rowwise")
    specs = [{**_spec(c), "grad_accumulation": [1], "frozen_experts": True} for c in contestants]
    results = dict(zip(contestants, _run_kept(specs)))
    for contestant, result in results.items():
        assert "error" not in result, (contestant, result["error"])
    return {c: r["cases"][0] for c, r in results.items()}


_LAYING_OUT = ("quantize_group_columns_placed", "quantize_rows_placed", "transpose_fp8")


@pytest.mark.parametrize("contestant", ["current", "rowwise"])
def test_frozen_experts_cast_their_neighbours_gradients_for_grad_input_alone(frozen_steps, steps, contestant):
    """With the experts' weights frozen the step runs no grad_weight GEMM (four grouped GEMMs, not six) and lays
    nothing out for one: the kernels that cast SwiGLU's and the combine's gradients store the rows alone, a byte a
    routed-token element where the trained step's store two, no other kernel lays an operand out, and the SGD
    step leaves the experts alone."""
    frozen, trained = frozen_steps[contestant], steps[contestant]
    grouped = _grouped(frozen)
    assert len(grouped) == 4 and all(row["kind"] == "gemm" for row in grouped)
    assert all("(rows)" in row["detail"] for row in grouped)
    laying_out = [r["name"] for r in frozen["rows"]
                  if r["kind"] == "extern" and r["name"].split(".")[3] in _LAYING_OUT]
    assert laying_out == [], laying_out

    def neighbours(case):  # the fused neighbours' backward casts by op
        return {r["name"].split(".")[3]: r for r in case["rows"] if r["kind"] == "extern"
                and r["graph"].endswith("backward") and r["name"].split(".")[3].startswith(
                    ("swiglu_backward_placed", "swiglu_backward_rowwise", "quantize_weighted_rows"))
                and not r["name"].split(".")[3].endswith("_amax")}

    # Priced as stores of rows (copy bandwidth), not of transposed tiles, where they laid nothing out.
    machine = costs.Machine()
    for op, row in neighbours(frozen).items():
        assert row["lays_out_nothing"] and not neighbours(trained)[op]["lays_out_nothing"], op
        large = {**row, "read": row["read"] * 10**4, "written": row["written"] * 10**4}  # past the launch floor
        assert costs.time_us(costs.Row(**large), machine) == pytest.approx(
            costs.time_us(costs.Row(**{**large, "lays_out_nothing": False}), machine)
            * machine.transposed_store_fraction), op
    frozen_written = {op: row["written"] for op, row in neighbours(frozen).items()}
    trained_written = {op: row["written"] for op, row in neighbours(trained).items()}
    rows_bytes = {"swiglu": S * 2 * TINY["expert_width"], "weighted": S * TINY["hidden"]}  # E4M3 rows, a byte each
    assert frozen_written.keys() == trained_written.keys() and len(frozen_written) == 2, (frozen_written,
                                                                                          trained_written)
    for op, written in frozen_written.items():
        rows = rows_bytes["swiglu" if op.startswith("swiglu") else "weighted"]
        assert rows <= written < rows + 4 * S + 1024, (op, written)  # the rows, and amaxes or dots (fp32)
        assert trained_written[op] >= written + rows, (op, trained_written[op])  # the layout: S' >= S bytes more
    expert_weights = {TINY["experts"] * n * k * 2 for n, k in ((2 * TINY["expert_width"], TINY["hidden"]),
                                                               (TINY["hidden"], TINY["expert_width"]))}
    sgd = [r for r in frozen["rows"] if r["kind"] == "optimizer"]
    assert sgd and not any(r["written"] in expert_weights for r in sgd), sgd


def test_a_step_the_model_cannot_decide_is_an_error_row_not_a_number():
    """4 experts: the router's mm (N = 4) is misaligned, and Inductor would time it padded and unpadded on the
    device to decide; the child refuses with the reason."""
    result = _model("bf16", overrides={})
    assert "error" in result and "pad_mm" in result["error"] and "cases" not in result


def test_grouped_gemm_flops_of_each_form():
    assert costs.grouped_gemm_flops((128, 64), (8, 64, 32)) == (2.0 * 128 * 64 * 32, "rows")
    assert costs.grouped_gemm_flops((32, 128), (128, 64)) == (2.0 * 32 * 128 * 64, "weights")
    assert costs.grouped_gemm_flops((8, 16, 64), (8, 64, 32)) == (2.0 * 8 * 16 * 64 * 32, "batched")
    with pytest.raises(ValueError):
        costs.grouped_gemm_flops((4,), (8, 64, 32))


def test_grouped_gemms_run_at_the_grouped_rates():
    machine = costs.Machine()
    flops = 2.0 * 32768 * 2048 * 1536  # the bench block's gate_up projection, forward
    for gemm, rate in (("bf16 grouped", machine.grouped_bf16_flops), ("fp8 rowwise grouped", machine.grouped_fp8_flops),
                       ("bf16", machine.bf16_flops)):
        row = costs.Row("0:forward", "gemm", "g", flops=flops, gemm=gemm)
        assert costs.time_us(row, machine) == pytest.approx(flops / rate * 1e6)
    assert machine.grouped_bf16_flops < machine.bf16_flops and machine.grouped_fp8_flops < machine.fp8_rowwise_flops


def test_an_expanded_extern_operand_is_counted_once():
    """scatter_reduce's index broadcast over each row (stride 0) is read as its distinct elements."""
    from bench.costmodel.capture import ExternRecord

    extern = ExternRecord("buf1", "aten.scatter_reduce_.two", [((9, 64), "bfloat16"), ((128, 64), "int64"),
                                                               ((128, 64), "bfloat16")], [], [None, 128, None])
    row = costs._extern_row("0:forward", extern)
    assert row.kind == "extern" and row.read == 9 * 64 * 2 + 128 * 8 + 128 * 64 * 2


def test_a_moe_result_is_judged_against_its_targets(tmp_path):
    def capture(contestant, step_ms, duplicate=0):
        rows = [{"graph": "0:forward", "kind": "gemm", "name": "extern_kernels._grouped_mm", "flops": step_ms * 524e9,
                 "gemm": "bf16 grouped"}]
        if duplicate:
            rows.append({"graph": "0:forward", "kind": "triton", "name": "k", "duplicate_written": duplicate})
        return {"contestant": contestant, "cases": [{"case": "c", "note": "", "rows": rows}], "versions": {}}

    captures = [capture("bf16", 10.0), capture("rowwise", 7.0, duplicate=10**9), capture("torchao moe rowwise", 8.0)]
    result = bench_model.build_result("moe", {}, captures, costs.Machine(), "a MoE step")
    verdicts = {(v["target"], v["case"]): v for v in judge(result)}
    over_bf16 = verdicts[("row-wise: step over BF16 (modelled)", "rowwise (c)")]
    assert over_bf16["measured"] == pytest.approx(10 / 7, rel=1e-2) and over_bf16["met"]  # + one 3 us launch
    over_torchao = verdicts[("row-wise: step over torchao moe rowwise (modelled)", "rowwise (c)")]
    assert over_torchao["measured"] == pytest.approx(8 / 7, rel=1e-2) and over_torchao["met"]
    twice = verdicts[("FP8 GB stored twice (modelled)", "rowwise (c)")]
    assert not twice["met"] and twice["missed_by"] == pytest.approx(1.0)
    text = bench_model.summary(result)
    assert "vs torchao moe rowwise" in text and "attention ms" not in text and "SGD ms" in text


def test_bench_moe_refuses_without_cuda_and_checks_its_names(capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit, match="measures on a CUDA GPU.*python -m bench model moe"):
        main(["moe"])
    with pytest.raises(SystemExit, match="unknown contestant 'torchao rowwise'"):
        main(["moe", "--contestants", "torchao rowwise"])
    with pytest.raises(SystemExit, match="unknown Inductor setting"):
        main(["moe", "--contestants", "rowwise +nothing"])
    with pytest.raises(SystemExit):
        main(["moe", "--tokens", "0"])
    assert "must be > 0" in capsys.readouterr().err


def test_bench_moe_frozen_experts_reach_the_child_and_its_sgd_steps_what_trains():
    """``--frozen-experts``: the child that measures a contestant is told; the block's experts take no gradient,
    and the step's SGD moves the router alone."""
    import argparse

    from bench.moe import add_arguments, child_command, freeze_experts, sgd_step
    from fp8graph.models import build

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "--frozen-experts" in child_command("current", parser.parse_args(["--frozen-experts"]))
    assert "--frozen-experts" not in child_command("current", parser.parse_args([]))
    block = build("moe", "tiny")
    freeze_experts(block)
    x = torch.randn(2, 8, block.gate.in_features, requires_grad=True)
    block(x).sum().backward()
    before = {name: p.detach().clone() for name, p in block.named_parameters()}
    sgd_step(block, lr=1.0)
    moved = {name for name, p in block.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all(name.startswith("gate") for name in moved), moved
    assert all(p.grad is None for p in block.parameters()) and x.grad is not None


def _step(module, x, grad_output) -> tuple:
    """The module's output, and the gradients of x and of its parameters, of one forward and backward."""
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad_output)
    return out, x.grad, [p.grad for p in module.parameters()]


def _group_sizes(offsets) -> list[int]:
    import torch

    return torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()


@pytest.mark.parametrize("config", ["tiny", "tiny-odd"])
def test_torchao_s_experts_hand_the_grouped_gemms_token_groups_padded_to_16_and_compute_the_block(config, monkeypatch):
    """torchao's FP8 grad_weight GEMM needs every expert's token group a multiple of 16 rows, or the GPU fails a
    device-side assert (as the H200 run of 2026-11-27 did): its contestant's experts pad the groups as torchtitan
    does, gather in, scatter back out. With plain ``torch._grouped_mm`` the padded experts compute the block's
    output and gradients, while every group they hand the GEMMs is a multiple of 16 (the block's are not)."""
    import copy

    import torch

    from bench.moe import TORCHAO_GROUP_ALIGNMENT, PaddedExperts
    from fp8graph.models import build

    block = build("moe", config, dtype=torch.float32)
    padded = copy.deepcopy(block)
    padded.experts = PaddedExperts(padded.experts)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, block.gate.in_features, generator=generator)
    grad_output = torch.randn(x.shape, generator=generator)
    offsets_seen = {}
    grouped_mm = torch._grouped_mm

    def recording(name):
        def run(a, b, offs=None, **kwargs):
            offsets_seen.setdefault(name, []).append(offs.clone())
            return grouped_mm(a, b, offs=offs, **kwargs)
        return run

    monkeypatch.setattr(torch, "_grouped_mm", recording("block"))
    expected = _step(block, x, grad_output)
    monkeypatch.setattr(torch, "_grouped_mm", recording("padded"))
    out, grad_x, grad_parameters = _step(padded, x, grad_output)
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close(grad_x, expected[1])
    for grad, grad_expected in zip(grad_parameters, expected[2], strict=True):
        torch.testing.assert_close(grad, grad_expected)
    counts = _group_sizes(offsets_seen["block"][0])  # tokens an expert
    assert any(count % TORCHAO_GROUP_ALIGNMENT for count in counts)
    assert len(offsets_seen["padded"]) == 2  # gate_up's and down's; their backward GEMMs take the same offsets
    for offsets in offsets_seen["padded"]:
        assert offsets.dtype == torch.int32
        sizes = _group_sizes(offsets)
        assert all(size % TORCHAO_GROUP_ALIGNMENT == 0 and size >= max(count, 1) for size, count in zip(sizes, counts))


def test_torchao_s_contestant_builds_on_cpu_and_its_padding_compiles_as_one_graph(monkeypatch):
    """``swap_in_torchao`` converts the padded experts' weights (torchao's conversion only swaps tensors: it
    runs on CPU). With torchao's FP8 grouped GEMM stood in for by ``torch._grouped_mm`` after checking what
    ``_Float8GroupedMM`` asserts (2-D row-major input, 3-D column-major weight, int32 offsets) and the groups'
    alignment, the converted block, compiled with ``fullgraph=True`` (the padding never copies the counts to
    the host), computes the BF16 block's output and gradients."""
    import copy

    import torch

    torchao_tensor = pytest.importorskip("torchao.prototype.moe_training.tensor")
    from torchao.prototype.moe_training.utils import _is_column_major

    from bench.moe import TORCHAO_GROUP_ALIGNMENT, PaddedExperts, fp8_note, swap_in_torchao
    from fp8graph.models import build

    block = build("moe", "tiny", dtype=torch.bfloat16)
    converted = copy.deepcopy(block)
    assert swap_in_torchao(converted) == 2 and isinstance(converted.experts, PaddedExperts)
    assert "token groups padded to multiples of 16 rows" in fp8_note(None, converted)
    groups_checked = []

    def torchao_fp8_grouped_mm_stand_in(input_hp, weight_t_hp, config, offs=None, bias=None):
        assert input_hp.ndim == 2 and not _is_column_major(input_hp)
        assert weight_t_hp.ndim == 3 and _is_column_major(weight_t_hp) and offs.dtype == torch.int32
        if not torch.compiler.is_compiling():  # the sizes are data: only the eager run reads them
            groups_checked.append(_group_sizes(offs))
        return torch._grouped_mm(input_hp, weight_t_hp, offs=offs)

    monkeypatch.setattr(torchao_tensor, "_quantize_then_scaled_grouped_mm", torchao_fp8_grouped_mm_stand_in)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 24, block.gate.in_features, dtype=torch.bfloat16, generator=generator)
    grad_output = torch.randn(x.shape, dtype=torch.bfloat16, generator=generator)
    expected = _step(block, x, grad_output)
    _step(converted, x, grad_output)
    assert len(groups_checked) == 2 and all(size % TORCHAO_GROUP_ALIGNMENT == 0 for sizes in groups_checked
                                            for size in sizes)
    for parameter in converted.parameters():
        parameter.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(converted, backend="aot_eager", fullgraph=True)
    out, grad_x, grad_parameters = _step(compiled, x, grad_output)
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close(grad_x, expected[1])
    for grad, grad_expected in zip(grad_parameters, expected[2], strict=True):
        torch.testing.assert_close(grad, grad_expected)


@pytest.mark.gpu
def test_torchao_s_contestant_trains_the_tiny_block_on_the_gpu():
    """The contestant as ``bench moe`` runs it (``swap_in_torchao``, then Inductor) on the tiny block, whose 256
    routed rows fall into groups of any size: torchao's FP8 grouped GEMMs run without a device-side assert (the
    unpadded groups failed one on the H200), and the output and gradients are the BF16 block's to FP8's
    precision."""
    import copy

    import torch

    pytest.importorskip("torchao.prototype.moe_training")
    from helpers import sqnr_db

    from bench.moe import swap_in_torchao
    from fp8graph.models import build

    torch._dynamo.reset()
    block = build("moe", "tiny", device="cuda", dtype=torch.bfloat16)
    converted = copy.deepcopy(block)
    swap_in_torchao(converted)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 64, block.gate.in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
    grad_output = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    out, grad_x, grad_parameters = _step(block, x, grad_output)
    fp8_out, fp8_grad_x, fp8_grad_parameters = _step(torch.compile(converted), x, grad_output)
    torch.cuda.synchronize()  # a device-side assert surfaces here at the latest
    for name, reference, fp8 in [("out", out, fp8_out), ("grad x", grad_x, fp8_grad_x),
                                 *zip([n for n, _ in block.named_parameters()], grad_parameters, fp8_grad_parameters)]:
        assert sqnr_db(reference, fp8) > 20, name


def test_a_gpu_run_of_the_moe_block_is_shown_beside_the_committed_modelled_step():
    """``scripts/gpu-run moe`` prints its measurement beside the newest committed model-moe result of the same
    configuration (``bench model compare``): here a measured result written like bench moe's."""
    import json
    import pathlib

    results = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results"
    shape = {"workload": "moe_block", "config": "bench", "batch": 1, "sequence": 4096}
    path = bench_model._newest_model(shape, results)
    assert path is not None and path.name.startswith("model-moe-")
    model = json.loads(path.read_text())
    modelled = bench_model.peer_rows(model, shape)  # a sweep's block of that shape, one micro-batch a step
    assert modelled and not any(row["case"].endswith("micro-batches") for row in modelled.values())
    # compare re-times the captured kernels at today's rates of the measuring GPU
    modelled = bench_model._retimed(model, modelled, costs.Machine.of("H100"))
    fp8 = next(name for name in modelled if name != "bf16")  # a contestant the newest result modelled
    measured = {**shape, "environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"},
                "rows": [{"contestant": name, "train_tokens_per_s": 4096 / (modelled[name]["step_ms"] / 1e3)}
                         for name in ("bf16", fp8)]}
    lines = bench_model.compare_lines(measured, "moe-test.json", None, results)
    row = next(line for line in lines if line.startswith(f"| {fp8} |"))
    assert path.name in lines[0] and "+0%" in row and f"{modelled[fp8]['vs_bf16']:.2f}x" in row
    assert bench_model.compare_lines({**measured, "sequence": 1024}, "x", None, results)[0].startswith(
        "no modelled bench moe result")
    # A step with the experts frozen is modelled by a frozen spec only, and the other way round.
    for frozen in (False, True):
        for batch in (1, 8):
            path = bench_model._newest_model({**shape, "batch": batch, "frozen_experts": frozen}, results)
            assert path is None or bool(json.loads(path.read_text())["spec"].get("frozen_experts")) == frozen
    frozen_model = bench_model._newest_model({**shape, "batch": 8, "frozen_experts": True}, results)
    assert frozen_model is not None and frozen_model != bench_model._newest_model({**shape, "batch": 8}, results)


def test_the_tokens_order_is_restored_without_storing_the_sorted_gradient(steps):
    """The backward of ``out = rows[inverse]`` (the tokens back in their order, after the down projection) is a
    gather inside the down projection's grad_output kernels (fp8graph.passes.unpermute), not an index_put that
    stores the sorted gradient, S x hidden in BF16, for the cast to read again."""
    sorted_gradient_bytes = S * TINY["hidden"] * 2
    for contestant in ("rowwise", "current"):
        backward = [row for row in steps[contestant]["rows"]
                    if row["graph"].endswith("backward") and row["kind"] == "triton"]
        stored = [r["name"] for r in backward if "index_put" in r["name"] and r["written"] == sorted_gradient_bytes]
        assert not stored, (contestant, stored)


def test_bench_moe_decode_smoke_times_the_frozen_batched_mm_block(tmp_path):
    """``bench moe --decode`` (the GPU run's moe-decode step) on CPU: BF16 and fp8graph row-wise decode the tiny
    batched_mm block with frozen weights, each in its own process; fp8graph's expert sites are in FP8, and
    ``bench show`` reads the result back."""
    import json
    forked.run_python(["-m", "bench", "moe", "--smoke", "--decode", "--contestants", "rowwise", "--out",
                       str(tmp_path)], cwd=REPO, check=True)
    [path] = tmp_path.glob("moe-decode-*.json")
    result = json.loads(path.read_text())
    assert result["workload"] == "moe_decode" and result["sequence"] == 1
    rows = {row["contestant"]: row for row in result["rows"]}
    assert list(rows) == ["bf16", "rowwise"] and not any("error" in row for row in rows.values()), rows
    assert rows["rowwise"]["note"].startswith("fp8graph: 2 of 3 sites in FP8")
    assert all(row["decode_tokens_per_s"] > 0 for row in rows.values())
    shown = forked.run_python(["-m", "bench", "show", str(path)], cwd=REPO, check=True).stdout
    assert "| contestant | decode tokens/s | vs bf16 |" in shown


def test_bench_moe_smoke_measures_steps_of_micro_batches_that_share_the_weights_casts(tmp_path):
    """``--grad-accumulation 3``: each timed step runs three micro-batches, an fp8graph contestant's declared to
    see the same weights (fp8graph.weights_unchanged), so the last reads the casts the first kept; tokens/s count
    every micro-batch."""
    forked.run_python(["-m", "bench", "moe", "--smoke", "--contestants", "current", "--grad-accumulation", "3",
                       "--out", str(tmp_path)], cwd=REPO, check=True)
    (path,) = tmp_path.glob("moe-*.json")
    result = json.loads(path.read_text())
    assert result["grad_accumulation"] == 3 and [r["contestant"] for r in result["rows"]] == ["bf16", "current"]
    bf16, current = result["rows"]
    assert "error" not in current and current["last_micro_batch_weight_casts"] == "reuse"
    assert bf16["last_micro_batch_weight_casts"] is None and current["train_tokens_per_s"] > 0
