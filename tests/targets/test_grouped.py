"""The FP8 expert GEMM against a plain-torch fp64 reference: SQNR floors per recipe and GEMM, routing edge cases,
and the same numbers through AOTAutograd.

Reference: each expert's rows times its weight in fp64 (``torch._grouped_mm`` semantics), and autograd's
gradients of that. Floors on Gaussian data: output >= 27 dB, grad_input and grad_weight >= 23 dB.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.numerics.health import sqnr_db
from fp8graph.recipes.scaling import (NATIVE_GROUPED_GRANULARITIES, DelayedScaling, Float8CurrentScaling,
                                     Float8RowwiseScaling, MXFP8BlockScaling)
from fp8graph.targets.grouped import _combine, _swiglu, grouped_fp8_target
from helpers import group_bounds

RECIPES = [Float8RowwiseScaling(), Float8RowwiseScaling(power_2_scales=False), Float8CurrentScaling(),
           MXFP8BlockScaling()]
OUTPUT_FLOOR_DB, GRAD_FLOOR_DB = 27.0, 23.0


def _reference(x, w, offsets):
    """(S, N): rows of group e times expert e's (N, K) weight transposed; rows in no group are zero."""
    ends = offsets.tolist()
    pieces = [x[start:end] @ w[e].T for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends))]
    pieces.append(x.new_zeros(x.shape[0] - ends[-1], w.shape[1]))
    return torch.cat(pieces)


def _run(recipe, x, w, offsets, grad, lowering=Lowering.EMULATED):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    output = grouped_fp8_target(recipe, lowering)(x, w, offsets)
    output.backward(grad)
    return output, x.grad, w.grad


def _case(offsets, K=64, N=96, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    offsets = torch.tensor(offsets, dtype=torch.int32)
    S = int(offsets[-1]) + 3  # three rows in no group, as expert-parallel sentinels
    x, w = torch.randn(S, K, dtype=dtype), torch.randn(len(offsets), N, K, dtype=dtype)
    return x, w, offsets, torch.randn(S, N, dtype=dtype)


def _mean_sqnr(reference, actual) -> float:
    """The mean of each row's SQNR (of each expert's rows, for a 3-D tensor)."""
    reference, actual = reference.reshape(-1, reference.shape[-1]), actual.reshape(-1, actual.shape[-1])
    return sum(sqnr_db(r, a).item() for r, a in zip(reference, actual)) / len(reference)


def _sqnrs(recipe, x, w, offsets, grad):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    reference = _reference(x64, w64, offsets)
    reference.backward(grad.double())
    output, grad_input, grad_weight = _run(recipe, x, w, offsets, grad)
    rows = slice(0, int(offsets[-1]))
    assert torch.all(output[rows.stop:] == 0) and torch.all(grad_input[rows.stop:] == 0), "rows in no group"
    return (sqnr_db(reference[rows], output[rows].double()).item(),
            sqnr_db(x64.grad[rows], grad_input[rows].double()).item(),
            sqnr_db(w64.grad, grad_weight.double()).item())


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("offsets", [
    [40, 40, 100, 160],          # an empty expert
    [0, 0, 0, 128],              # every token on one expert
    [13, 51, 52, 97, 140],       # odd E, groups of sizes no FP8 kernel takes (1, 13, 38, ...)
], ids=["empty-expert", "one-expert", "odd-E-ragged"])
def test_every_gemm_above_its_floor(recipe, offsets):
    output_db, grad_input_db, grad_weight_db = _sqnrs(recipe, *_case(offsets))
    assert output_db >= OUTPUT_FLOOR_DB and grad_input_db >= GRAD_FLOOR_DB and grad_weight_db >= GRAD_FLOOR_DB, (
        output_db, grad_input_db, grad_weight_db)


def test_delayed_expert_gemms_scale_from_each_experts_history():
    """State (1 + E forward rows: the input, then each expert's weight): the first call casts at scale 1 and records
    the amaxes; the second casts with the scales they give and is above the floors."""
    x, w, offsets, grad = _case([40, 40, 100, 160])
    experts = w.shape[0]
    state = (torch.zeros(1 + experts, 4), torch.ones(1 + experts), torch.zeros(1, 4), torch.ones(1))
    target = grouped_fp8_target(DelayedScaling(amax_history_len=4), Lowering.EMULATED)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    reference = _reference(x64, w64, offsets)
    reference.backward(grad.double())
    for call in range(2):
        x_run, w_run = x.clone().requires_grad_(), w.clone().requires_grad_()
        output = target(x_run, w_run, offsets, None, *state)
        output.backward(grad)
    history, scale, grad_history, grad_scale = state
    # The newest amax in slot 0, the one before rolled to the end.
    assert torch.equal(history[0, [0, 3]], x.abs().amax().expand(2)), "the input's amax, recorded by both calls"
    assert torch.equal(history[1:, 0], w.abs().amax(dim=(1, 2)))
    assert torch.equal(scale[1:], 448 / w.abs().amax(dim=(1, 2))), "the second call's scales, from the first's"
    assert torch.equal(grad_history[0, 0], grad.abs().amax()) and grad_scale[0] == 448 / grad.abs().amax()
    rows = slice(0, 160)
    assert sqnr_db(reference[rows], output[rows].double()) >= OUTPUT_FLOOR_DB
    assert sqnr_db(x64.grad[rows], x_run.grad[rows].double()) >= GRAD_FLOOR_DB
    assert sqnr_db(w64.grad, w_run.grad.double()) >= GRAD_FLOOR_DB


def test_empty_experts_get_zero_weight_gradients():
    x, w, offsets, grad = _case([40, 40, 100, 100])
    for recipe in RECIPES:
        _, _, grad_weight = _run(recipe, x, w, offsets, grad)
        assert torch.all(grad_weight[[1, 3]] == 0) and torch.all(grad_weight[[0, 2]] != 0)


@pytest.mark.parametrize("lowering", [Lowering.EMULATED, Lowering.SCALED_MM], ids=["emulated", "native"])
@pytest.mark.parametrize("recipe", [*RECIPES, DelayedScaling(amax_history_len=4)], ids=str)
def test_an_expert_rank_that_got_no_tokens_gets_zeros(monkeypatch, recipe, lowering):
    """Expert parallelism can route no token to a rank: S = 0 gives an empty output, an empty grad_input and zero
    weight gradients; delayed scaling records an amax of 0 and keeps its scales (nothing to fit)."""
    if lowering is Lowering.SCALED_MM:
        if recipe.granularity not in NATIVE_GROUPED_GRANULARITIES:
            pytest.skip(f"{recipe} has no native grouped GEMM")
        monkeypatch.setattr(torch, "_scaled_grouped_mm", _read_scaled_grouped_mm)
    offsets = torch.zeros(4, dtype=torch.int32)
    x, w = torch.randn(0, 64, requires_grad=True), torch.randn(4, 96, 64, requires_grad=True)
    state = (torch.zeros(5, 4), torch.ones(5), torch.zeros(1, 4), torch.ones(1)) if recipe.stateful else ()
    output = grouped_fp8_target(recipe, lowering)(x, w, offsets, None, *state)
    output.backward(torch.randn(0, 96))
    assert output.shape == (0, 96) and x.grad.shape == (0, 64)
    assert torch.equal(w.grad, torch.zeros_like(w))
    if recipe.stateful:
        history, scale, grad_history, grad_scale = state
        assert torch.all(history[0] == 0) and torch.all(grad_history == 0)
        assert torch.all(scale[:1] == 1) and torch.all(grad_scale == 1)


def test_rowwise_beats_per_tensor_on_imbalanced_experts():
    """Token rows spanning 6 decades (the design notes' 6.5), gradient rows 6 and input channels 6: one scale per
    tensor leaves the small ones in FP8's subnormals; row-wise scales each row, and each group's channel for
    grad_weight. Measured as the mean SQNR of each output and grad_input row and of each grad_weight column
    (what one input channel receives): large ones would hide the small ones' error."""
    x, w, offsets, grad = _case([40, 80, 120, 160], seed=3)
    x = x * torch.logspace(-6, 0, x.shape[0])[torch.randperm(x.shape[0])][:, None] \
        * torch.logspace(-6, 0, x.shape[1])[torch.randperm(x.shape[1])]
    grad = grad * torch.logspace(-6, 0, grad.shape[0])[torch.randperm(grad.shape[0])][:, None]
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    reference = _reference(x64, w64, offsets)
    reference.backward(grad.double())
    rows = slice(0, int(offsets[-1]))
    measured = {}
    for recipe in (Float8RowwiseScaling(), Float8CurrentScaling()):
        output, grad_input, grad_weight = _run(recipe, x, w, offsets, grad)
        measured[recipe.name] = (_mean_sqnr(reference[rows], output[rows].double()),
                                 _mean_sqnr(x64.grad[rows], grad_input[rows].double()),
                                 _mean_sqnr(w64.grad.transpose(-2, -1), grad_weight.double().transpose(-2, -1)))
    rowwise, current = measured.values()
    for name, row, tensor in zip(("output", "grad_input", "grad_weight"), rowwise, current):
        assert row > tensor + 3, (name, row, tensor)


@pytest.mark.parametrize("recipe", RECIPES[1:], ids=str)
def test_aot_autograd_computes_what_eager_does(recipe):
    x, w, offsets, grad = _case([13, 51, 52, 97, 140], dtype=torch.bfloat16)
    target = grouped_fp8_target(recipe, Lowering.EMULATED)
    compiled = torch.compile(lambda x, w, offsets: target(x, w, offsets), backend="aot_eager", fullgraph=True)
    eager = _run(recipe, x, w, offsets, grad)
    x_c, w_c = x.detach().requires_grad_(), w.detach().requires_grad_()
    output = compiled(x_c, w_c, offsets)
    output.backward(grad)
    for expected, actual in zip(eager, (output, x_c.grad, w_c.grad)):
        assert torch.equal(expected, actual)


def test_no_gradients_no_backward_casts():
    x, w, offsets, _ = _case([40, 80, 120, 160])
    with torch.no_grad():
        output = grouped_fp8_target(Float8RowwiseScaling(), Lowering.EMULATED)(x, w, offsets)
    with_grad, _, _ = _run(Float8RowwiseScaling(), x, w, offsets, torch.zeros(x.shape[0], w.shape[1]))
    assert not output.requires_grad and torch.equal(output, with_grad.detach())



def _read_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False, **_):
    """torch._scaled_grouped_mm's E4M3 forms as SM 9.0 runs them, read back on the CPU: only the rows (columns)
    inside the groups are read. Rows form: a (S, K) row-major, b (E, K, N) column-major, scales (S,) and (E, N).
    Weights form: a (N, S') row-major, b (S', K) column-major, scales (E N,) and (E K,), every group of S' a
    multiple of 16 tokens."""
    if b.dim() == 3:
        assert a.stride(1) == 1 and b.stride(1) == 1
        output = torch.zeros(a.shape[0], b.shape[2])
        for expert, (start, end) in enumerate(group_bounds(offs)):
            output[start:end] = ((a[start:end].float() * scale_a[start:end, None])
                                 @ (b[expert].float() * scale_b[expert][None, :]))
        return output.to(out_dtype)
    assert a.stride(1) == 1 and b.stride(0) == 1 and all(end % 16 == 0 for end in offs.tolist())
    experts, rows, columns = len(offs), a.shape[0], b.shape[1]
    scale_a, scale_b = scale_a.reshape(experts, rows), scale_b.reshape(experts, columns)
    output = torch.zeros(experts, rows, columns)
    for expert, (start, end) in enumerate(group_bounds(offs)):
        output[expert] = (a[:, start:end].float() @ b[start:end].float()) * scale_a[expert][:, None] \
            * scale_b[expert][None, :]
    return output.to(out_dtype)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8RowwiseScaling(), DelayedScaling(amax_history_len=4)],
                         ids=str)
@pytest.mark.parametrize("gathered", [False, True], ids=["sorted input", "gathered input"])
def test_the_native_lowering_computes_what_the_emulation_does(monkeypatch, recipe, gathered):
    """The SM 9.0 path on the CPU, its kernel replaced by a reader that reads only inside the groups: the padded
    operands of grad_weight (zeros only where a group ends, the rest of the buffer left as allocated), the input
    laid out for it in the forward, the transposed weight copy (delayed scaling's laid out from its FP8 bytes),
    against the exact emulation: equal up to the kernel's BF16 output, with ragged groups, an empty expert and rows
    in no group. Delayed scaling's second call, cast with the scales the first recorded, is the one compared, and
    the states both lowerings recorded are equal."""
    torch.manual_seed(0)
    offsets = torch.tensor([13, 13, 90, 150], dtype=torch.int32)
    source = torch.randn(120, 64)
    gather_index = torch.randint(0, 120, (155,)) if gathered else None
    x = source if gathered else torch.randn(155, 64)
    w, grad = torch.randn(4, 96, 64), torch.randn(155, 96)
    results, states = [], []
    for lowering in (Lowering.SCALED_MM, Lowering.EMULATED):
        if lowering is Lowering.SCALED_MM:
            monkeypatch.setattr(torch, "_scaled_grouped_mm", _read_scaled_grouped_mm)
        state = (torch.zeros(5, 4), torch.ones(5), torch.zeros(1, 4), torch.ones(1)) if recipe.stateful else ()
        for _ in range(2 if recipe.stateful else 1):
            x_run, w_run = x.clone().requires_grad_(), w.clone().requires_grad_()
            output = grouped_fp8_target(recipe, lowering)(x_run, w_run, offsets, None, *state,
                                                          gather_index=gather_index)
            output.backward(grad)
        results.append((output[:150], x_run.grad, w_run.grad))
        monkeypatch.undo()
        if recipe.stateful:
            assert not torch.all(state[1] == 1), ("the compared call cast with the recorded scales", lowering)
        states.append(state)
    # Delayed scaling records the same amaxes whichever kernel cast the input (the native gathered input's are
    # fp8graph::quantize_rows_placed's table of group-column amaxes).
    for native, emulated in zip(*states):
        assert torch.equal(native, emulated)
    for native, emulated in zip(*results):
        torch.testing.assert_close(native, emulated, rtol=1e-2, atol=1e-2 * emulated.abs().max().item())


@pytest.mark.parametrize("recipe", [Float8RowwiseScaling(), Float8RowwiseScaling(power_2_scales=False)], ids=str)
def test_the_rowwise_call_that_takes_the_combine_casts_its_gradient_as_autograds_combine_and_the_call_would(
        monkeypatch, recipe):
    """Row-wise's call with the experts' combine (``fuses_neighbours``) on the SM 9.0 path: its backward casts the
    combine's gradient, gathered and weighted, per row for grad_input and per group and column for grad_weight in
    one kernel (``fp8graph::quantize_weighted_rows_rowwise``), each row's scale from its token's amax times its
    weight. In fp32, where autograd's combine forms the same products, that is what the call without the combine
    and autograd's combine compute, bit for bit: the input's and the weight's gradients equal, the routing
    weights' (each row's dot, summed in another order) within fp32's rounding; the output equal."""
    torch.manual_seed(0)
    tokens, top_k = 40, 2
    offsets = torch.tensor([13, 13, 50, 80], dtype=torch.int32)  # an empty expert
    permutation = torch.randperm(tokens * top_k)
    h, w = torch.randn(tokens * top_k, 64), torch.randn(4, 96, 64)
    row_weights = torch.rand(tokens * top_k, 1)
    row_weights[5] = 0.0
    grad = torch.randn(tokens, 96) * torch.logspace(-4, 4, 96, base=2.0)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _read_scaled_grouped_mm)
    results = []
    for fused in (True, False):
        h_run, w_run, weights_run = (t.clone().requires_grad_() for t in (h, w, row_weights))
        if fused:
            output = grouped_fp8_target(recipe, Lowering.SCALED_MM, combine_top_k=top_k)(
                h_run, w_run, offsets, row_weights=weights_run, permutation=permutation)
        else:
            rows = grouped_fp8_target(recipe, Lowering.SCALED_MM)(h_run, w_run, offsets)
            output = _combine(rows, weights_run, permutation, top_k)
        output.backward(grad)
        results.append((output, h_run.grad, w_run.grad, weights_run.grad))
    (fused_output, *fused_grads, fused_weights_grad), (plain_output, *plain_grads, plain_weights_grad) = results
    assert torch.equal(fused_output, plain_output)
    for fused_grad, plain_grad in zip(fused_grads, plain_grads):
        assert torch.equal(fused_grad, plain_grad)
    torch.testing.assert_close(fused_weights_grad, plain_weights_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", [Float8RowwiseScaling(), Float8RowwiseScaling(power_2_scales=False)], ids=str)
def test_the_rowwise_call_that_takes_swiglu_casts_its_gradient_as_autograds_swiglu_and_the_call_would(
        monkeypatch, recipe):
    """Row-wise's call with SwiGLU (``fuses_neighbours``) on the SM 9.0 path: its backward computes SwiGLU's gradient
    and casts it a scale a row for grad_input and a scale a group and column for grad_weight in one kernel
    (``fp8graph::swiglu_backward_rowwise``, its amaxes from ``swiglu_backward_rowwise_amax``). In fp32, where the
    ops' reference forms the products in autograd's order, that is what the call without SwiGLU and autograd's
    SwiGLU compute, bit for bit (on the GPU the kernel's sigmoid may move a byte one step: tests/test_gpu.py), the
    output equal; an expert of no rows and rows in no group included."""
    torch.manual_seed(0)
    offsets = torch.tensor([13, 13, 50, 80, 83], dtype=torch.int32)  # an empty expert; 3 rows in no group past it
    x, w = torch.randn(83, 64), torch.randn(5, 96, 64) * 0.3
    grad = torch.randn(83, 48) * torch.logspace(-4, 4, 48, base=2.0)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _read_scaled_grouped_mm)
    results = []
    for fused in (True, False):
        x_run, w_run = x.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            output, gate_up = grouped_fp8_target(recipe, Lowering.SCALED_MM, swiglu=True)(x_run, w_run, offsets)
            assert not gate_up.requires_grad and gate_up.shape == (83, 96)  # the GEMM's output, for the next site
        else:
            output = _swiglu(grouped_fp8_target(recipe, Lowering.SCALED_MM)(x_run, w_run, offsets))
        output.backward(grad)
        results.append((output, x_run.grad, w_run.grad))
    (fused_output, *fused_grads), (plain_output, *plain_grads) = results
    assert torch.equal(fused_output, plain_output)
    for fused_grad, plain_grad in zip(fused_grads, plain_grads):
        assert torch.equal(fused_grad, plain_grad)


class _FusedBackwardCasts(TorchDispatchMode):
    """Each call of the kernels that cast a fused neighbour's gradient: ``(op, layout given, laid-out output)``."""

    OPS = ("swiglu_backward_placed", "swiglu_backward_rowwise", "quantize_weighted_rows_placed",
           "quantize_weighted_rows_rowwise")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        outputs = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.OPS:
            schema_args = [argument.name for argument in func._schema.arguments]
            layout = {**dict(zip(schema_args, args)), **(kwargs or {})}.get("layout", True)
            self.calls.append((name, layout, outputs[1]))
        return outputs


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8RowwiseScaling(), DelayedScaling(amax_history_len=4)],
                         ids=str)
@pytest.mark.parametrize("neighbour", ["swiglu", "combine"])
def test_frozen_experts_fused_neighbours_cast_the_gradient_for_grad_input_alone(monkeypatch, recipe, neighbour):
    """With the experts' weights frozen no grad_weight GEMM runs: the kernel that casts a fused neighbour's gradient
    stores the rows grad_input's GEMM reads and lays out nothing (``layout=False``; row-wise's combine skips the
    walk for the layout's scales too), where it would write a byte an element that nothing reads. The input's and
    the routing weights' gradients are those of the call whose weights train, bit for bit."""
    torch.manual_seed(0)
    tokens, top_k = 40, 2
    offsets = torch.tensor([13, 13, 50, 80], dtype=torch.int32)  # an empty expert
    permutation = torch.randperm(tokens * top_k)
    x, w = torch.randn(tokens * top_k, 64), torch.randn(4, 96, 64) * 0.3
    row_weights = torch.rand(tokens * top_k, 1)
    grad = torch.randn(tokens if neighbour == "combine" else tokens * top_k, 96 if neighbour == "combine" else 48)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _read_scaled_grouped_mm)
    fused = (grouped_fp8_target(recipe, Lowering.SCALED_MM, swiglu=True) if neighbour == "swiglu"
             else grouped_fp8_target(recipe, Lowering.SCALED_MM, combine_top_k=top_k))
    results, calls = [], []
    for frozen in (False, True):
        x_run, w_run, weights_run = x.clone().requires_grad_(), w.clone().requires_grad_(not frozen), \
            row_weights.clone().requires_grad_()
        state = (torch.zeros(5, 4), torch.ones(5), torch.zeros(1, 4), torch.ones(1)) if recipe.stateful else ()
        extra = {} if neighbour == "swiglu" else {"row_weights": weights_run, "permutation": permutation}
        output = fused(x_run, w_run, offsets, None, *state, **extra)
        output = output[0] if neighbour == "swiglu" else output  # (SwiGLU, the GEMM's output)
        with _FusedBackwardCasts() as casts:
            output.backward(grad)
        results.append((x_run.grad, weights_run.grad))
        calls.append(casts.calls)
        assert (w_run.grad is None) == frozen
    (trained, frozen_calls) = calls
    assert [layout for _, layout, _ in trained] == [True] and [layout for _, layout, _ in frozen_calls] == [False]
    assert frozen_calls[0][2].numel() == 0 and trained[0][2].numel() > 0
    for trained_grad, frozen_grad in zip(*results):
        assert (trained_grad is None) == (frozen_grad is None)
        if trained_grad is not None:
            assert torch.equal(trained_grad, frozen_grad)


class _OpsCalled(TorchDispatchMode):
    """The fp8graph ops called, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fp8graph":
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)], ids=str)
def test_the_down_projection_casts_swiglu_from_the_gate_up_output_by_one_kernel_for_both_of_its_gemms(
        monkeypatch, recipe):
    """The down projection's call given ``swiglu_source`` (the gate_up call's output, which that call returns
    beside SwiGLU) computes SwiGLU and casts it for its forward GEMM and grad_weight's layout by one kernel
    (``fp8graph::swiglu_forward_placed``), with no layout pass of its own (``transpose_fp8``), and never reads its
    input's values: given zeros in their place, its output, its weight's gradient and its input's are the call's
    that casts SwiGLU as given, bit for bit (fp32, where both spell silu alike); with the experts frozen (no
    grad_weight, no layout) it casts its input as given, as before. Delayed scaling records the same amaxes."""
    torch.manual_seed(0)
    offsets = torch.tensor([13, 13, 50, 80, 83], dtype=torch.int32)  # an empty expert; 3 rows in no group past it
    gate_up = torch.randn(83, 96) * 2
    w = torch.randn(5, 64, 48) * 0.3
    grad = torch.randn(83, 64)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _read_scaled_grouped_mm)
    down = grouped_fp8_target(recipe, Lowering.SCALED_MM)
    for frozen in (False, True):
        results, states, called = [], [], []
        for from_source in (False, True):
            h = _swiglu(gate_up)
            # Zeros where the call must not read them: its weight frozen, it casts its input as given.
            h_run = (torch.zeros_like(h) if from_source and not frozen else h).requires_grad_()
            w_run = w.clone().requires_grad_(not frozen)
            state = (torch.zeros(6, 4), torch.ones(6), torch.zeros(1, 4), torch.ones(1)) if recipe.stateful else ()
            with _OpsCalled() as ops:
                output = down(h_run, w_run, offsets, None, *state, **(
                    {"swiglu_source": gate_up} if from_source else {}))
                output.backward(grad)
            results.append((output, w_run.grad, h_run.grad))
            states.append(state)
            called.append(ops.names)
        fused = "swiglu_forward_placed" in called[1]
        assert fused is not frozen and "swiglu_forward_placed" not in called[0], called
        # The forward's layout pass gone (the backward lays out grad_output as before).
        assert called[0].count("transpose_fp8") - called[1].count("transpose_fp8") == (0 if frozen else 1), called
        for plain, from_source in zip(results[0], results[1]):
            assert (plain is None) == (from_source is None)
            if plain is not None and not (frozen and plain is results[0][0]):
                assert torch.equal(plain, from_source)
        for plain, from_source in zip(*states):
            assert torch.equal(plain, from_source)
    with pytest.raises(ValueError, match="swiglu_source .* comes to a per-tensor recipe on the native path"):
        grouped_fp8_target(Float8RowwiseScaling(), Lowering.SCALED_MM)(h, w, offsets, swiglu_source=gate_up)


def test_the_weights_copy_for_grad_input_is_kept_only_where_fp8s_saving_on_the_input_pays_for_it():
    """``_recasts_weight``: the forward keeps an expert weight's copy for grad_input (one byte an (E, N, K)
    element, and an fp32 inverse scale an expert and row) where FP8's saving on the site's input over BF16 (S rows
    of K: 2 bytes each in BF16, 1 in grad_weight's layout of S + 16 E rows rounded up to 16, less an fp32 weight
    scale an expert) covers it: ``K (2 S - P) - 4 E >= E N (K + 4)``; else, with frozen experts (BF16 keeps no
    input), and for a symbolic S not provably large enough (no guard made), it is cast again in the backward, but
    where the pass found the expert MLP's other GEMM pays for it (``pooled_weight_copy``). A recipe that saves its
    transposes keeps it always; the emulation leaves it to the partitioner."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fp8graph.targets.grouped import GroupedSpec, _recasts_weight

    weight = torch.empty(4, 64, 32)  # E = 4, N = 64, K = 32: the copy and its scales 4 x 64 x 36 = 9216 bytes
    native = GroupedSpec(Float8CurrentScaling(), Lowering.SCALED_MM)
    assert _recasts_weight(native, 360, weight, True)  # P = 432: 32 x 288 - 16 = 9200 bytes saved
    assert not _recasts_weight(native, 361, weight, True)  # 32 x 290 - 16 = 9264
    assert _recasts_weight(native, 10 ** 6, weight, False)  # frozen experts
    pooled = GroupedSpec(Float8CurrentScaling(), Lowering.SCALED_MM, pooled_weight_copy=True)
    assert not _recasts_weight(pooled, 1, weight, True)
    assert _recasts_weight(pooled, 10 ** 6, weight, False)  # frozen: BF16 keeps no input, so nothing pays
    saving = GroupedSpec(Float8CurrentScaling(save_transposes=True), Lowering.SCALED_MM)
    assert not _recasts_weight(saving, 1, weight, True)
    assert not _recasts_weight(GroupedSpec(DelayedScaling(), Lowering.EMULATED), 1, weight, True)
    shape_env = ShapeEnv()
    symbolic_rows = shape_env.create_unbacked_symint()
    assert _recasts_weight(native, symbolic_rows, weight, True)
    assert not shape_env.guards
