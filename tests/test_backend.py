"""The backend end to end: options, errors, and agreement of eager, aot_eager and inductor."""

import pytest
import torch

import fp8graph
from fp8graph import Float8CurrentScaling, Format
from fp8graph.models import build
from helpers import compile_fp8, fp8_target_count, sqnr_db


def _forward_backward(compiled, model, x):
    model.zero_grad(set_to_none=True)
    out = compiled(x)
    out.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out.detach(), grads


def test_backend_string_works_after_install():
    model = build("mlp", "tiny")
    compiled = torch.compile(model, backend="fp8", options={"compiler": "aot_eager"})
    out = compiled(torch.randn(4, 64))
    assert out.shape == (4, 10)
    assert torch._dynamo.utils.counters["fp8graph"]["sites_rewritten"] == 2


def test_options_policy_overrides_the_default_recipe():
    model = build("mlp", "tiny")
    e4m3 = Float8CurrentScaling(fp8_format=Format.E4M3)
    compiled, backend = compile_fp8(model, policy=e4m3, compiler="eager")
    compiled(torch.randn(4, 64))
    assert {d.recipe for d in backend.decisions if d.rewritten} == {e4m3}
    report = fp8graph.explain(compiled, torch.randn(4, 64))
    # Rows carry the recipe object: equal to the policy's, printed by its short name.
    assert {r.recipe for r in report.rewritten} == {e4m3}
    assert {str(r.recipe) for r in report.rewritten} == {"current(E4M3)"}


def test_different_policies_compile_different_graphs():
    model, x = build("mlp", "tiny"), torch.randn(8, 64)
    hybrid = fp8graph.compile(model, compiler="aot_eager")
    e4m3 = fp8graph.compile(model, policy=Float8CurrentScaling(Format.E4M3), compiler="aot_eager")
    _, grads_hybrid = _forward_backward(hybrid, model, x)
    _, grads_e4m3 = _forward_backward(e4m3, model, x)
    # grad_output is E5M2 under HYBRID and E4M3 otherwise: the gradients must differ.
    assert not torch.equal(grads_hybrid["up.weight"], grads_e4m3["up.weight"])


def test_unknown_option_is_an_error():
    with pytest.raises(Exception, match="unknown fp8 backend option.*'polcy'"):
        torch.compile(build("mlp", "tiny"), backend="fp8", options={"polcy": None})(torch.randn(2, 64))


def test_policy_must_be_a_recipe():
    with pytest.raises(TypeError, match="policy must be a fp8graph.Policy, a recipe"):
        fp8graph.compile(build("mlp", "tiny"), policy="current")


@pytest.mark.parametrize("kwargs,message", [
    ({"compiler": "tvm"}, "compiler must be one of"),
    ({"lowering": "cutlass"}, "lowering must be one of"),
])
def test_bad_compile_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fp8graph.compile(build("mlp", "tiny"), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_forcing_scaled_mm_on_cpu_is_refused_for_a_recipe_its_cpu_kernel_lacks():
    # Per-tensor scales run on _scaled_mm's CPU kernel (tests/gemm/test_scaled_gemm.py); MX scales do not.
    compiled = fp8graph.compile(build("mlp", "tiny"), compiler="eager", lowering="scaled_mm",
                                policy=fp8graph.MXFP8BlockScaling())
    with pytest.raises(Exception, match=r"mxfp8.* needs a CUDA device of compute capability 10\.x"):
        compiled(torch.randn(2, 64))


def test_eager_and_aot_eager_agree_exactly():
    model, x = build("mlp", "tiny"), torch.randn(4, 8, 64)
    out_eager, grads_eager = _forward_backward(fp8graph.compile(model, compiler="eager"), model, x)
    out_aot, grads_aot = _forward_backward(fp8graph.compile(model, compiler="aot_eager"), model, x)
    torch.testing.assert_close(out_aot, out_eager, rtol=0, atol=0)
    for name in grads_eager:
        torch.testing.assert_close(grads_aot[name], grads_eager[name], rtol=0, atol=0)


@pytest.mark.inductor
def test_inductor_agrees_with_eager_and_tracks_fp32():
    model, x = build("mlp", "tiny"), torch.randn(4, 8, 64)
    out_fp32, grads_fp32 = _forward_backward(model, model, x)
    out_eager, grads_eager = _forward_backward(fp8graph.compile(model, compiler="eager"), model, x)
    out_ind, grads_ind = _forward_backward(fp8graph.compile(model, compiler="inductor"), model, x)
    # Inductor fuses and may reorder fp32 arithmetic, which can move a value
    # across an FP8 rounding boundary: the results agree far beyond FP8 noise.
    assert sqnr_db(out_eager, out_ind) > 45
    for name in grads_eager:
        assert sqnr_db(grads_eager[name], grads_ind[name]) > 40, name
    assert sqnr_db(out_fp32, out_ind) > 25
    assert sqnr_db(grads_fp32["up.weight"], grads_ind["up.weight"]) > 18


@pytest.mark.inductor
def test_inductor_trains_gpt2_conv1d_sites_like_eager():
    """GPT-2's Conv1D sites (addmm with a (K, N) weight and a bias) through Inductor, forward and backward."""
    model = build("gpt2", "tiny")
    # Two sequences of 16 tokens, as in tests/buffers/test_weight_cache.py's GPT-2 test: its uncached run compiles
    # the graphs this one does, so a suite run finds them in Inductor's on-disk caches.
    tokens = torch.randint(0, 250, (2, 16))

    def loss_and_grads(compiler):
        model.zero_grad(set_to_none=True)
        loss = fp8graph.compile(model, compiler=compiler)(tokens, labels=tokens).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_eager, grads_eager = loss_and_grads("eager")
    loss_inductor, grads_inductor = loss_and_grads("inductor")
    torch.testing.assert_close(loss_inductor, loss_eager, rtol=1e-5, atol=1e-5)
    for name, grad in grads_eager.items():
        assert sqnr_db(grad, grads_inductor[name]) > 40, name


class _GateWithGraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 32)

    def forward(self, x):
        y = self.layer(x)
        doubled = int(y.sum() > 0)  # graph break: Dynamo compiles this frame on its own
        return y * (doubled + 1)


class _TwoGates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _GateWithGraphBreak(), _GateWithGraphBreak()

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("grad, input_requires_grad", [
    (True, False),  # b's input requires grad where a's did not: a guard of Dynamo's own tells them apart
    # Nothing Dynamo guards on differs between the two calls (no gradients, or an input that requires grad
    # already): b's plan signature does (fp8graph.instances), so b gets a graph of its own.
    (False, False),
    (True, True),
])
def test_two_instances_of_a_graph_broken_module_each_get_their_own_decision(grad, input_requires_grad):
    torch.manual_seed(0)
    model, x = _TwoGates(), torch.randn(4, 32, requires_grad=input_requires_grad)
    compiled, backend = compile_fp8(model, policy=fp8graph.Policy(rules=[("a.layer", None)]), regions=None)
    with torch.set_grad_enabled(grad):
        fp8_output, eager_output = compiled(x), model(x)
    assert {d.site.path: d.rewritten for d in backend.decisions} == {"a.layer": False, "b.layer": True}
    assert not torch.equal(fp8_output, eager_output)  # b's GEMM ran in FP8
    assert backend.unmatched_rules() == []


def test_instances_the_policy_treats_alike_share_one_graph_and_each_is_reported():
    torch.manual_seed(0)
    model, x = _TwoGates(), torch.randn(4, 32)
    with torch.no_grad():
        compiled, backend = compile_fp8(model, regions=None)
        compiled(x)
    layer_graphs = [gm for gm in backend.graph_modules if fp8_target_count(gm)]
    assert len(layer_graphs) == 1  # b ran the frame traced for a
    assert {d.site.path: d.rewritten for d in backend.decisions} == {"a.layer": True, "b.layer": True}


def test_an_eagerly_run_graph_resolves_its_amax_reductions_under_the_mesh_its_trace_saw():
    """``compiler="eager"`` runs the rewritten graph after the trace has ended, and its targets resolve their
    amax reductions when they run (``fp8graph.buffers.amax_reduction``): it runs inside the FSDP2 mesh the trace
    saw. A traced graph's reductions were resolved in the trace, and a graph of an unsharded model runs as it is."""
    from fp8graph.backend import _run_under
    from fp8graph.buffers import amax_reduction

    def reads_the_mesh(*args):  # what a target running in the graph would see
        return amax_reduction._fsdp_mesh.get()

    assert _run_under("the model's mesh", "eager", reads_the_mesh)() == "the model's mesh"
    assert amax_reduction._fsdp_mesh.get() is None
    assert _run_under(None, "eager", reads_the_mesh) is reads_the_mesh
    assert _run_under("the model's mesh", "aot_eager", reads_the_mesh) is reads_the_mesh
