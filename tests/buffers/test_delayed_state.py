"""Delayed scaling: the compiled state against a plain-Python reference, step by step.

    per training-mode cast:  scale = fp8_max / (algo(history) * 2**margin)  (kept if that amax is 0/inf/NaN)
                             history = roll(history, -1); history[0] = 0;  cast;  history[0] = amax
"""

import math

import pytest
import torch

import fp8graph
from fp8graph import Format
from fp8graph.models import build
from fp8graph.models.text_data import TextBatches
from fp8graph import DelayedScaling
from helpers import sgd_steps

E4M3_MAX = 448.0


class ReferenceState:
    """The history semantics in plain Python lists, for one role."""

    def __init__(self, length, margin=0, algo="max"):
        self.history, self.scale, self.margin, self.algo = [0.0] * length, 1.0, margin, algo

    def cast(self, amax):
        if self.algo == "max":
            reference_amax = max(self.history)
        elif self.algo == "most_recent":
            reference_amax = self.history[0]
        else:
            reference_amax = float(self.algo(torch.tensor(self.history)))
        if math.isfinite(reference_amax) and reference_amax > 0:
            self.scale = E4M3_MAX / (reference_amax * 2 ** self.margin)
        self.history = [0.0] + self.history[2:] + [self.history[0]]
        self.history[0] = amax


def _mean_of_two_newest(history):
    return (history[0] + history[-1]) / 2


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 0), ("max", 2), (_mean_of_two_newest, 1)])
def test_compiled_state_follows_the_reference_step_by_step(algo, margin):
    model = build("mlp", "tiny")
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo, margin=margin)
    compiled = fp8graph.compile(model, policy=recipe, compiler="aot_eager", cache_weights=False)
    input_reference = ReferenceState(4, margin, algo)
    weight_reference = ReferenceState(4, margin, algo)
    magnitudes = [1.0, 3.0, 0.5, 2.0, 8.0, 1.0, 0.25]
    for step, magnitude in enumerate(magnitudes):
        x = torch.randn(8, 64) * magnitude
        compiled(x).sum().backward()
        input_reference.cast(x.abs().max().item())
        weight_reference.cast(model.up.weight.abs().max().item())
        history, scale = model.up.fp8graph_amax_history_weight, model.up.fp8graph_scale_weight
        assert history[0].tolist() == pytest.approx(input_reference.history, rel=1e-6), step
        assert scale[0].item() == pytest.approx(input_reference.scale, rel=1e-6), step
        assert history[1].tolist() == pytest.approx(weight_reference.history, rel=1e-6), step
        assert scale[1].item() == pytest.approx(weight_reference.scale, rel=1e-6), step
    assert compiled.fp8graph_backend.graph_count == 1


def test_state_is_in_the_state_dict_and_recipe_fields_are_checked():
    model = build("llama", "tiny")
    fp8graph.compile(model, policy=DelayedScaling(amax_history_len=16), compiler="aot_eager")
    state = model.state_dict()
    history = state["model.layers.0.mlp.down_proj.fp8graph_amax_history_weight"]
    assert history.shape == (2, 16)  # input, weight
    assert state["model.layers.0.mlp.down_proj.fp8graph_grad_output_amax_history_weight"].shape == (1, 16)
    assert state["model.layers.1.self_attn.q_proj.fp8graph_scale_weight"].tolist() == [1.0, 1.0]
    assert state["model.layers.1.self_attn.q_proj.fp8graph_grad_output_scale_weight"].tolist() == [1.0]
    assert not any(key.startswith("lm_head.fp8graph") for key in state)  # N=250: stays in high precision
    for kwargs, field in [({"margin": -1}, "margin"), ({"amax_history_len": 0}, "amax_history_len"),
                          ({"amax_compute_algo": "mean"}, "amax_compute_algo"), ({"margin": 1.5}, "margin"),
                          ({"fp8_format": "E4M3"}, "fp8_format"), ({"reduce_amax": 1}, "reduce_amax")]:
        with pytest.raises(ValueError, match=f"DelayedScaling.{field}"):
            DelayedScaling(**kwargs)


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 2)])
def test_a_bare_linear_keeps_its_state_on_itself_and_follows_the_reference(algo, margin):
    """A model that is one nn.Linear: its own weight's state, in its own state_dict."""
    linear = torch.nn.Linear(64, 32)
    compiled = fp8graph.compile(linear, policy=DelayedScaling(amax_history_len=4, amax_compute_algo=algo,
                                                              margin=margin), compiler="aot_eager")
    assert {"fp8graph_amax_history_weight", "fp8graph_scale_weight"} <= set(linear.state_dict())
    input_reference, weight_reference = ReferenceState(4, margin, algo), ReferenceState(4, margin, algo)
    for step, magnitude in enumerate([1.0, 3.0, 0.5, 2.0, 8.0, 1.0]):
        x = torch.randn(8, 64) * magnitude
        compiled(x).sum().backward()
        input_reference.cast(x.abs().max().item())
        weight_reference.cast(linear.weight.abs().max().item())
        history, scale = linear.fp8graph_amax_history_weight, linear.fp8graph_scale_weight
        assert history[0].tolist() == pytest.approx(input_reference.history, rel=1e-6), step
        assert scale[0].item() == pytest.approx(input_reference.scale, rel=1e-6), step
        assert history[1].tolist() == pytest.approx(weight_reference.history, rel=1e-6), step


def test_a_bare_linear_resumes_bit_exactly():
    def fresh():
        torch._dynamo.reset()
        linear = torch.nn.Linear(64, 32)
        linear.load_state_dict(initial)
        compiled = fp8graph.compile(linear, policy=DelayedScaling(amax_history_len=8), compiler="aot_eager")
        return linear, compiled, torch.optim.AdamW(linear.parameters(), lr=3e-3)

    def train(linear, compiled, optimizer, inputs):
        losses = []
        for x in inputs:
            loss = compiled(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    initial = torch.nn.Linear(64, 32).state_dict()
    inputs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    uninterrupted = train(*fresh(), inputs)
    linear, compiled, optimizer = fresh()
    first = train(linear, compiled, optimizer, inputs[:6])
    checkpoint = {"model": {k: v.clone() for k, v in linear.state_dict().items()},
                  "optimizer": optimizer.state_dict()}
    linear, compiled, optimizer = fresh()
    linear.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    assert first + train(linear, compiled, optimizer, inputs[6:]) == uninterrupted  # bit for bit


def test_checkpoint_resume_is_bit_exact():
    recipe = DelayedScaling(amax_history_len=16)

    def fresh():
        model = build("llama", "tiny", seed=0)
        compiled = fp8graph.compile(model, policy=recipe, compiler="aot_eager")
        return model, compiled, torch.optim.AdamW(model.parameters(), lr=3e-3)

    def train(model, compiled, optimizer, batches, steps):
        return sgd_steps(compiled, model, batches, steps, optimizer=optimizer)

    model, compiled, optimizer = fresh()
    uninterrupted = train(model, compiled, optimizer, TextBatches(4, 32, vocab_size=250), 20)

    torch._dynamo.reset()
    model, compiled, optimizer = fresh()
    batches = TextBatches(4, 32, vocab_size=250)
    first = train(model, compiled, optimizer, batches, 10)
    checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                  "optimizer": optimizer.state_dict()}
    torch._dynamo.reset()
    model, compiled, optimizer = fresh()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    second = train(model, compiled, optimizer, batches, 10)
    assert first + second == uninterrupted  # bit for bit


def test_a_history_of_the_wrong_length_is_refused_naming_the_buffer():
    model = build("mlp", "tiny")
    fp8graph.compile(model, policy=DelayedScaling(amax_history_len=8), compiler="aot_eager")
    state = model.state_dict()
    state["up.fp8graph_amax_history_weight"] = torch.zeros(2, 4)
    with pytest.raises(RuntimeError, match="up.fp8graph_amax_history_weight"):
        model.load_state_dict(state)


def test_inference_reads_scales_without_updating_history():
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    for _ in range(2):
        compiled(torch.randn(8, 64)).sum().backward()
    history = model.up.fp8graph_amax_history_weight.clone()
    scale = model.up.fp8graph_scale_weight.clone()
    with torch.no_grad():
        compiled(torch.randn(8, 64) * 100)
    assert torch.equal(model.up.fp8graph_amax_history_weight, history)
    assert torch.equal(model.up.fp8graph_scale_weight, scale)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_eval_mode_reads_scales_without_updating_state_even_with_gradients(compiler):
    """A validation loop without no_grad: model.eval() alone keeps the state, forward and backward; train() resumes."""
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler=compiler)
    compiled(torch.randn(8, 64)).sum().backward()
    state = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.eval()
    output = compiled(torch.randn(8, 64) * 100)
    output.sum().backward()
    assert output.requires_grad
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, state[name]), name
    model.train()
    compiled(torch.randn(8, 64) * 100).sum().backward()
    assert model.up.fp8graph_amax_history_weight[0, 0].item() > 100  # the input amax, recorded again
    assert model.up.fp8graph_grad_output_amax_history_weight[0, 0].item() > 0


def test_two_calls_per_step_and_micro_batches_record_every_amax():
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=8), compiler="aot_eager")
    micro_batches = [torch.randn(4, 64) * scale for scale in (1.0, 2.0, 4.0)]
    for x in micro_batches:  # gradient accumulation: three forwards and backwards, one step
        compiled(x).sum().backward()
    newest_first = [micro_batches[2], micro_batches[1], micro_batches[0]]
    recorded = model.up.fp8graph_amax_history_weight[0]
    assert recorded[0].item() == pytest.approx(newest_first[0].abs().max().item())
    assert recorded[-1].item() == pytest.approx(newest_first[1].abs().max().item())
    assert recorded[-2].item() == pytest.approx(newest_first[2].abs().max().item())


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_value_records_the_amax_of_the_finite_ones_and_scaling_goes_on(bad):
    """One bad value must not freeze the scale for a whole history (a NaN amax would, under "max")."""
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    compiled(torch.randn(8, 64)).sum().backward()
    x = torch.randn(8, 64) * 5
    x[0, 0] = bad
    out = compiled(x)
    assert model.up.fp8graph_amax_history_weight[0, 0].item() == pytest.approx(x[x.isfinite()].abs().max().item())
    assert torch.isfinite(out[1:]).all()  # the other rows, as fp32 would give them
    compiled(torch.randn(8, 64))
    assert model.up.fp8graph_scale_weight[0].item() == pytest.approx(448 / x[x.isfinite()].abs().max().item())


def test_a_value_far_above_a_history_of_tiny_amaxes_saturates_instead_of_becoming_nan():
    """448 / 1e-37 overflows fp32, so the input's scale is fp32's largest, and a value above 1 times it overflows
    the product: such values saturate, as every value beyond the range does."""
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=2), compiler="aot_eager")
    compiled(torch.randn(8, 64) * 1e-37).sum().backward()
    x = torch.randn(8, 64, requires_grad=True)
    out = compiled(x)
    assert model.up.fp8graph_scale_weight[0].item() == torch.finfo(torch.float32).max  # the input's scale
    assert (x.abs() > 1).any() and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_a_zero_amax_keeps_the_previous_scale_and_training_continues():
    model = build("mlp", "tiny")
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    compiled = fp8graph.compile(model, policy=recipe, compiler="aot_eager")
    compiled(torch.randn(8, 64)).sum().backward()
    compiled(torch.randn(8, 64)).sum().backward()
    compiled(torch.zeros(8, 64))
    scale_before = model.up.fp8graph_scale_weight[0].item()
    assert model.up.fp8graph_amax_history_weight[0, 0].item() == 0.0
    out = compiled(torch.randn(8, 64))  # its scale comes from a zero amax: the previous one is kept
    assert model.up.fp8graph_scale_weight[0].item() == scale_before
    assert torch.isfinite(out).all()
    out = compiled(torch.randn(8, 64))
    assert torch.isfinite(out).all()
    assert model.up.fp8graph_scale_weight[0].item() != scale_before  # updating again


def test_no_recompiles_across_100_steps():
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=16), compiler="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(100):
        compiled(torch.randn(8, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert compiled.fp8graph_backend.graph_count == 1


def test_the_bare_backend_refuses_stateful_policies():
    with pytest.raises(Exception, match=r"Use fp8graph.compile"):
        torch.compile(build("mlp", "tiny"), backend="fp8",
                      options={"policy": DelayedScaling(), "compiler": "eager"})(torch.randn(2, 64))


def test_delayed_llama_trains_close_to_fp32():
    fp32_model = build("llama", "tiny", seed=0)
    fp32_losses = sgd_steps(fp32_model, fp32_model, TextBatches(8, 64, vocab_size=250), 30, lr=3e-3)
    model = build("llama", "tiny", seed=0)
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=16, fp8_format=Format.HYBRID),
                                compiler="aot_eager")
    fp8_losses = sgd_steps(compiled, model, TextBatches(8, 64, vocab_size=250), 30, lr=3e-3)
    assert abs(sum(fp8_losses[-10:]) / sum(fp32_losses[-10:]) - 1) < 0.03


def test_a_checkpoint_without_fp8_state_loads_with_fresh_state_and_a_notice(caplog):
    plain = build("mlp", "tiny", seed=1)
    checkpoint = plain.state_dict()  # saved by a model that never had FP8 state
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    compiled(torch.randn(8, 64)).sum().backward()  # some state to be replaced
    with caplog.at_level("INFO", logger="fp8graph"):
        model.load_state_dict(checkpoint)
    assert torch.equal(model.up.weight, plain.up.weight)
    assert torch.equal(model.up.fp8graph_amax_history_weight, torch.zeros(2, 4))
    assert torch.equal(model.up.fp8graph_scale_weight, torch.ones(2))
    assert torch.equal(model.up.fp8graph_grad_output_amax_history_weight, torch.zeros(1, 4))
    assert torch.equal(model.up.fp8graph_grad_output_scale_weight, torch.ones(1))
    assert any("checkpoint has no up.fp8graph_amax_history_weight" in r.getMessage() for r in caplog.records)
    assert any("checkpoint has no up.fp8graph_grad_output_scale_weight" in r.getMessage() for r in caplog.records)


def test_a_partial_load_leaves_the_state_of_weights_it_does_not_hold_and_names_it_missing():
    """``load_state_dict(strict=False)`` of some tensors (an adapter's, one layer's): the trained state of every
    weight the checkpoint does not hold stays, and its keys are reported missing as torch reports any."""
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    for _ in range(2):
        compiled(torch.randn(8, 64)).sum().backward()
    trained = {name: value.clone() for name, value in model.state_dict().items() if "fp8graph_" in name}
    result = model.load_state_dict({"up.bias": torch.zeros_like(model.up.bias)}, strict=False)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in trained.items())
    assert set(trained) <= set(result.missing_keys)


def test_a_checkpoint_with_the_three_roles_in_one_buffer_loads_split(caplog):
    """Checkpoints written before the grad_output row had buffers of its own keep (3, len) and (3,)."""
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    for _ in range(2):
        compiled(torch.randn(8, 64)).sum().backward()
    current = model.state_dict()
    old_format = {key: value for key, value in current.items() if "grad_output" not in key}
    for name in ("amax_history", "scale"):
        key = f"up.fp8graph_{name}_weight"
        old_format[key] = torch.cat([current[key], current[f"up.fp8graph_grad_output_{name}_weight"]])
    assert old_format["up.fp8graph_amax_history_weight"].shape == (3, 4)
    fresh = build("mlp", "tiny", seed=3)
    fp8graph.compile(fresh, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    with caplog.at_level("INFO", logger="fp8graph"):
        fresh.load_state_dict(old_format)
    for key in ("up.fp8graph_amax_history_weight", "up.fp8graph_grad_output_amax_history_weight",
                "up.fp8graph_scale_weight", "up.fp8graph_grad_output_scale_weight"):
        assert torch.equal(fresh.state_dict()[key], current[key]), key
    assert any("holds the three roles in one buffer" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_two_forwards_before_one_backward_record_both_as_eager_autograd_does(compiler):
    """Micro-batches summed into one loss: each forward records its amaxes, then each backward its
    grad_output's, into the buffers as they are then (no saved copy of them goes stale)."""
    def two_forwards_one_backward(compiler, steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False))
        compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler=compiler)
        first, second = torch.randn(16, 32), torch.randn(16, 32) * 10
        for step in range(steps):
            (compiled(first).sum() + (3 + step) * compiled(second).sum()).backward()
        return model[0], first, second

    linear, first, second = two_forwards_one_backward(compiler, steps=1)
    history = linear.fp8graph_amax_history_weight
    assert history[0].tolist() == [second.abs().max().item(), 0.0, 0.0, first.abs().max().item()]  # rolled
    # Backward runs the second call first: its grad_output (all 3) is older than the first's (all 1).
    assert linear.fp8graph_grad_output_amax_history_weight[0].tolist() == [1.0, 0.0, 0.0, 3.0]
    # Each backward casts with the scale its history gives when it runs, and dequantizes with the same.
    linear, _, _ = two_forwards_one_backward(compiler, steps=3)
    reference, _, _ = two_forwards_one_backward("eager", steps=3)
    for name, buffer in reference.named_buffers():
        assert torch.equal(getattr(linear, name), buffer), name
    torch.testing.assert_close(linear.weight.grad, reference.weight.grad, rtol=1e-6, atol=1e-5)


class RootWeight(torch.nn.Module):
    """A weight on the root, used by a functional matmul in the root's forward."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 64) / 8)
        self.body = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.body(x @ self.weight.t())


def test_root_weights_keep_their_state_on_the_root():
    model = RootWeight()
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    x = torch.randn(8, 64)
    compiled(x).sum().backward()
    decisions = {d.site.path: d for d in compiled.fp8graph_backend.decisions}
    assert decisions[""].rewritten and decisions["body"].rewritten
    assert model.fp8graph_amax_history_weight[0, 0].item() == pytest.approx(x.abs().max().item())
    assert "fp8graph_scale_weight" in model.state_dict()


class _TiedLinears(torch.nn.Module):
    """Two Linears holding one weight; the graph calls only the second."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(x)


def test_a_tied_weight_used_only_through_its_second_module_keeps_one_state():
    model = _TiedLinears()
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    x = torch.randn(16, 32)
    compiled(x).sum().backward()
    [decision] = compiled.fp8graph_backend.decisions
    assert decision.rewritten, decision.reason
    assert not hasattr(model.second, "fp8graph_amax_history_weight")  # the first holder keeps the state
    history = model.first.fp8graph_amax_history_weight
    assert history[0, 0].item() == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert history[1, 0].item() == pytest.approx(model.first.weight.abs().max().item(), rel=1e-6)
    assert model.first.fp8graph_grad_output_amax_history_weight[0, 0].item() == 1.0  # sum()'s grad_output


def test_a_second_compile_continues_the_first_compiles_state():
    """Compiling again (another compiler, or for inference) keeps the histories, scales and hooks."""
    recipe = DelayedScaling(amax_history_len=8)
    inputs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(3)]
    once, twice = build("mlp", "tiny"), build("mlp", "tiny")
    # Casting at every call: a second compile refills kept copies, with the scale the history gives then.
    compiled_once = fp8graph.compile(once, policy=recipe, compiler="aot_eager", cache_weights=False)
    for x in inputs:
        compiled_once(x).sum().backward()
    first = fp8graph.compile(twice, policy=recipe, compiler="aot_eager", cache_weights=False)
    for x in inputs[:2]:
        first(x).sum().backward()
    second = fp8graph.compile(twice, policy=recipe, compiler="eager", cache_weights=False)
    second(inputs[2]).sum().backward()
    assert second.fp8graph_backend.state is first.fp8graph_backend.state
    for name, buffer in once.named_buffers():
        assert torch.equal(dict(twice.named_buffers())[name], buffer), name  # each amax recorded once
    assert len(twice.up._forward_hooks) == len(once.up._forward_hooks)


def test_a_second_compile_that_needs_other_state_is_refused_naming_the_weight():
    model = build("mlp", "tiny")
    fp8graph.compile(model, policy=DelayedScaling(amax_history_len=8), compiler="aot_eager")
    with pytest.raises(ValueError, match=r"up\.weight: the model was compiled before.*length 16.*length 8"):
        fp8graph.compile(model, policy=DelayedScaling(amax_history_len=16), compiler="aot_eager")
