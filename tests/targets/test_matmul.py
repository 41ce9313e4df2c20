"""FP8 matmuls of two activations (opt-in by policy), against fp32.

    scores = q @ k^T                 (B, H, T, T)
    grad_q = grad_scores @ k ,  grad_k = grad_scores^T @ q
"""

import pytest
import torch

import fp8graph
from fp8graph import Float8CurrentScaling, Policy
from fp8graph.targets.matmul import matmul_fp8_target
from fp8graph.models import build
from helpers import compile_fp8, fp8_sites_compiled, fp8_target_count, graphs_per_unit, sqnr_db

HYBRID = Float8CurrentScaling()
ACTIVATION_MATMULS = Policy(rules=[(lambda path, module, site: not site.is_linear, HYBRID)])


def _forward_backward(matmul, a, b, grad_output):
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_()
    out = matmul(a, b)
    out.backward(grad_output)
    return out.detach(), a.grad, b.grad


@pytest.mark.parametrize("a_shape,b_shape", [
    ((2, 4, 64, 32), (2, 4, 32, 64)),   # attention scores, batched over heads
    ((2, 4, 64, 32), (32, 48)),          # b broadcast over the batch: its gradient is summed back
    ((96, 64), (64, 80)),                # plain 2-D
])
def test_output_and_gradients_track_fp32(a_shape, b_shape):
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    grad_output = torch.randn(torch.broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (a_shape[-2], b_shape[-1]))
    reference = _forward_backward(torch.matmul, a, b, grad_output)
    fp8 = _forward_backward(matmul_fp8_target(HYBRID), a, b, grad_output)
    assert fp8[1].shape == a.shape and fp8[2].shape == b.shape
    assert sqnr_db(reference[0], fp8[0]) >= 27
    assert sqnr_db(reference[1], fp8[1]) >= 23
    assert sqnr_db(reference[2], fp8[2]) >= 23


def test_default_policy_keeps_attention_matmuls_in_high_precision():
    model = build("gpt2", "tiny")
    report = fp8graph.explain(model, torch.randint(0, 250, (2, 16)))
    kept = [r for r in report if r.op == "matmul"]
    assert len(kept) == 4 and all("activation x activation" in r.reason for r in kept)


def test_a_rule_opts_gpt2_attention_matmuls_into_fp8_and_it_trains():
    model = build("gpt2", "tiny")
    tokens = torch.randint(0, 250, (2, 16))
    compiled, backend = compile_fp8(model, policy=ACTIVATION_MATMULS)
    loss = compiled(tokens, labels=tokens).loss
    loss.backward()
    matmuls = [d for d in backend.decisions if d.site.op == "matmul"]
    assert len(matmuls) == 4 and all(d.rewritten and d.lowering.value == "emulated" for d in matmuls)
    # The rule names only the matmuls, so the linears fall to the default recipe.
    assert sum(d.rewritten for d in backend.decisions) == 13
    assert fp8_sites_compiled(backend) == 13
    assert torch.isfinite(loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(tokens, labels=tokens).loss.backward()
    for name, param in model.named_parameters():
        if "attn.c_attn" in name:  # q and k reach the loss only through the FP8 score matmul
            assert sqnr_db(param.grad, grads[name]) > 10, name


@pytest.mark.parametrize("op", ["baddbmm", "addmm"])
def test_added_terms_stay_in_high_precision(op):
    batched = op == "baddbmm"
    a = torch.randn(3, 64, 32) if batched else torch.randn(64, 32)
    b = torch.randn(3, 32, 48) if batched else torch.randn(32, 48)
    c = torch.randn(3, 64, 48) if batched else torch.randn(64, 48)
    fn = getattr(torch, op)
    compiled, backend = compile_fp8(lambda c, a, b: fn(c, a, b), compiler="eager", policy=ACTIVATION_MATMULS)
    out = compiled(c, a, b)
    [decision] = backend.decisions
    assert decision.rewritten and decision.site.op == op
    assert sqnr_db(fn(c, a, b), out) > 28  # the exact addend lifts the SQNR over a bare FP8 product
    kept, kept_backend = compile_fp8(lambda c, a, b: fn(c, a, b), compiler="eager")
    torch.testing.assert_close(kept(c, a, b), fn(c, a, b))
    assert "activation x activation" in kept_backend.decisions[0].reason
