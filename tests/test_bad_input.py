"""Bad input: zeros, inf and NaN go through like plain arithmetic and do not poison later calls."""

import torch

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
