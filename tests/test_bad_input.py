"""Bad input: zeros, inf and NaN go through like plain arithmetic and do not poison later calls."""

import pytest
import torch

import fp8graph
from fp8graph import Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling
from fp8graph.models import build
from helpers import compile_fp8, sqnr_db


def test_all_zero_input_gives_the_bias_and_zero_weight_grad():
    model = build("mlp", "tiny")
    compiled, _ = compile_fp8(model)
    x = torch.zeros(4, 64, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert torch.isfinite(model.up.weight.grad).all()
    assert torch.count_nonzero(model.up.weight.grad) == 0  # input is zero: grad_weight = g^T @ 0
    # up(0) is exactly its bias; the layers after it see ordinary data.
    assert sqnr_db(model(x), out) > 20


def test_inf_and_nan_propagate_like_plain_math_then_recover():
    model = build("mlp", "tiny")
    compiled, _ = compile_fp8(model)
    x = torch.randn(6, 64)
    x[1, 3] = float("inf")
    x[4, 10] = float("nan")
    out, reference = compiled(x), model(x)
    # Rows with a non-finite input are non-finite, exactly where fp32 has them.
    assert torch.equal(torch.isfinite(out), torch.isfinite(reference))
    assert not torch.isfinite(out[1]).any() and not torch.isfinite(out[4]).any()
    assert torch.isfinite(out[[0, 2, 3, 5]]).all()
    # A later finite batch is as accurate as ever: current scaling keeps no state.
    clean = torch.randn(64, 64)
    assert sqnr_db(model(clean), compiled(clean)) > 20


RECIPES = {"current": Float8CurrentScaling(), "rowwise": Float8RowwiseScaling(), "block": Float8BlockScaling()}


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_one_nan_in_a_small_input_leaves_the_other_rows_as_fp8_would_give_them_without_it(recipe):
    """One bad request in a batch: the other rows' outputs and the finite grad_weight entries are those of
    the batch with the bad value replaced by 0 (per-tensor scaling used to cast them all at scale 1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128, bias=False))
    compiled, _ = compile_fp8(model, policy=recipe)
    x = torch.randn(128, 128) * 1e-3
    x_bad = x.clone()
    x_bad[0, 0] = float("nan")
    x[0, 0] = 0.0
    grad_output = torch.randn(128, 128) * 1e-6
    grads = []
    for batch in (x, x_bad):
        model.zero_grad()
        out = compiled(batch)
        out.backward(grad_output)
        grads.append(model[0].weight.grad.clone())
        if batch is x:
            clean_out = out.detach()
    assert torch.equal(out[1:].detach(), clean_out[1:])
    assert sqnr_db(model(x)[1:], clean_out[1:]) > 25  # and that is a good FP8 result
    finite = grads[1].isfinite()
    assert torch.equal(grads[1][finite], grads[0][finite]) and grads[0][finite].abs().sum() > 0


def test_one_nan_in_a_tiny_gradient_leaves_the_finite_weight_gradient_entries_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    compiled, _ = compile_fp8(model)
    x = torch.randn(32, 64)
    grad_output = torch.randn(32, 64) * 1e-6
    grad_output_bad = grad_output.clone()
    grad_output_bad[0, 0] = float("nan")
    grad_output[0, 0] = 0.0
    grads = []
    for grad in (grad_output, grad_output_bad):
        model.zero_grad()
        compiled(x).backward(grad)
        grads.append(model[0].weight.grad.clone())
    finite = grads[1].isfinite()
    assert (~finite).any() and finite.any()
    assert torch.equal(grads[1][finite], grads[0][finite]) and grads[1][finite].abs().sum() > 0


def test_nan_gradient_does_not_crash_and_next_step_is_finite():
    model = build("mlp", "tiny")
    compiled, _ = compile_fp8(model)
    x = torch.randn(4, 64)
    x[0, 0] = float("nan")
    compiled(x).sum().backward()
    assert torch.isnan(model.up.weight.grad).any()  # as fp32 autograd would report it
    model.zero_grad()
    compiled(torch.randn(4, 64)).sum().backward()
    assert torch.isfinite(model.up.weight.grad).all()


def test_user_tensors_are_not_modified():
    model = build("mlp", "tiny")
    compiled, _ = compile_fp8(model)
    x = torch.randn(4, 64) * 1000  # saturates nothing: scales adapt, input stays as given
    x_before = x.clone()
    weights_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled(x).sum().backward()
    assert torch.equal(x, x_before)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), weights_before[name]), name


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_an_empty_batch_returns_an_empty_result_as_eager_does(shape, compiler):
    model = build("mlp", "tiny")
    compiled, backend = compile_fp8(model, compiler=compiler)
    x = torch.randn(*shape, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, model(x)) and x.grad.shape == x.shape
    reasons = {d.reason for d in backend.decisions if d.site.path in ("up", "mid")}
    assert reasons == {"an empty operand (M, K or N is 0): nothing to cast; the GEMM runs as in high precision"}
    report = fp8graph.explain(model, torch.randn(*shape))
    assert all("empty operand" in record.reason for record in report if record.path in ("up", "mid"))


def test_torch_compiles_options_and_backend_given_to_fp8graph_compile_are_refused_saying_where_they_go():
    model = build("mlp", "tiny")
    for torch_only in ({"options": {"policy": fp8graph.Float8CurrentScaling()}}, {"backend": "fp8"}):
        with pytest.raises(TypeError, match=r"fp8graph\.compile: (options|backend)= is torch\.compile's; "
                                            r"fp8graph\.compile takes the backend's options as its own arguments"):
            fp8graph.compile(model, compiler="aot_eager", **torch_only)


def test_a_lazy_module_is_refused_naming_it_until_its_first_call():
    """A LazyLinear's weight has no shape before its first call: compile, explain and plan say so and how to go
    on; after one eager call the model compiles and trains."""
    model = torch.nn.Sequential(torch.nn.LazyLinear(64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    x = torch.randn(8, 48)
    for call in (lambda: fp8graph.compile(model, compiler="aot_eager"), lambda: fp8graph.explain(model, x),
                 lambda: fp8graph.plan(model)):
        with pytest.raises(ValueError, match=r"module '0' \(LazyLinear\) has parameters not initialized yet.*Call "
                                             r"the model once on a batch"):
            call()
    model(x)  # the LazyLinear becomes a Linear (48 -> 64)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    compiled(x).sum().backward()
    assert model[0].weight.grad.shape == (64, 48)
    assert [d.rewritten for d in compiled.fp8graph_backend.decisions] == [True, True]


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8RowwiseScaling()], ids=str)
@pytest.mark.parametrize("name, example", [("mlp", lambda device: torch.zeros(8, 64, device=device, dtype=torch.bfloat16)),
                                           ("llama", lambda device: torch.zeros(2, 16, dtype=torch.long,
                                                                                device=device))])
def test_a_model_on_the_meta_device_is_explained_as_the_same_model_with_memory(recipe, name, example):
    """explain() of a model built on the meta device (a large model planned without its memory) runs its FP8
    calls there (no autocast on meta) and decides every site as it does for the model in memory: a HuggingFace
    model traced whole (its code between regions would read values) and without a KV cache."""
    def report(device):
        model = build(name, "tiny", device=device, dtype=torch.bfloat16)
        assert {p.device.type for p in model.parameters()} == {device}
        return [(r.path, r.op, r.M, r.K, r.N, r.rewritten, r.reason)
                for r in fp8graph.explain(model, example(device), policy=recipe)]

    on_meta = report("meta")
    assert on_meta == report("cpu") and any(site[5] for site in on_meta)


def test_explaining_a_meta_model_with_explicit_regions_is_refused_with_the_reason():
    model = build("llama", "tiny", device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="meta device, and regions run the code between them eagerly"):
        fp8graph.explain(model, torch.zeros(2, 16, dtype=torch.long, device="meta"), regions=["model.layers.*"])
