"""User code may write into a target's output in place, as into ``F.linear``'s.

    y1, y2 = linear(x, w1), linear(x, w2)     -> y1, y2 = fp8graph_linears_<recipe>(x, [w1, w2], ...)
    y1 += y2                                     Falcon: mlp_output += attention_output

Autograd forbids writing in place into a view a custom Function returns (its
backward would be bypassed): every target returns its GEMMs' own results, the
(M, N) outputs, and reshapes them to the input's leading dimensions outside
the Function, where the views are ordinary ones. The in-place run must equal
the out-of-place one bit for bit.
"""

import copy

import pytest
import torch
from torch import nn

import fp8graph
from fp8graph import Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling, MXFP8BlockScaling
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.targets.linear_tensorwise import linear_fp8_target, linears_fp8_target
from fp8graph.targets.linear_tiled import linear_tiled_target
from fp8graph.targets.matmul import matmul_fp8_target
from helpers import compile_fp8, fp8_target_count, sqnr_db

HYBRID = Float8CurrentScaling()
K = N = 32


def _leaves(*shapes, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes]


def _gradients(forward, leaves, in_place: bool):
    """Gradients of ``sum(y1 + y2)`` for ``y1, y2 = forward(*leaves)``, added in place or not."""
    leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
    y1, y2 = forward(*leaves)
    if in_place:
        y1 += y2
        total = y1
    else:
        total = y1 + y2
    total.backward(torch.linspace(-1, 1, total.numel()).reshape(total.shape).to(total.dtype))
    return total.detach(), [leaf.grad for leaf in leaves]


def _assert_in_place_equals_out_of_place(forward, leaves):
    expected, expected_grads = _gradients(forward, leaves, in_place=False)
    actual, grads = _gradients(forward, leaves, in_place=True)
    assert torch.equal(actual, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.equal(grad, expected_grad)


@pytest.mark.parametrize("lead_shape", [(64,), (4, 16)], ids=["2d", "3d"])
def test_a_group_output_written_in_place(lead_shape):
    group = linears_fp8_target(HYBRID, Lowering.EMULATED)
    leaves = _leaves((*lead_shape, K), (N, K), (N, K), (N,))
    _assert_in_place_equals_out_of_place(lambda x, w1, w2, b1: group(x, [w1, w2], [b1, None]), leaves)


@pytest.mark.parametrize("lead_shape", [(64,), (4, 16)], ids=["2d", "3d"])
def test_a_single_linear_output_written_in_place(lead_shape):
    linear = linear_fp8_target(HYBRID, Lowering.EMULATED)
    leaves = _leaves((*lead_shape, K), (N, K), (N, K))
    _assert_in_place_equals_out_of_place(lambda x, w1, w2: (linear(x, w1), linear(x, w2)), leaves)


@pytest.mark.parametrize("recipe", [Float8RowwiseScaling(), Float8BlockScaling(), MXFP8BlockScaling()],
                         ids=["rowwise", "block", "mxfp8"])
def test_a_tiled_linear_output_written_in_place(recipe):
    linear = linear_tiled_target(recipe, Lowering.EMULATED)
    leaves = _leaves((2, 64, 128), (128, 128), (128, 128), dtype=torch.bfloat16)
    _assert_in_place_equals_out_of_place(lambda x, w1, w2: (linear(x, w1), linear(x, w2)), leaves)


def test_a_matmul_output_written_in_place():
    matmul = matmul_fp8_target(HYBRID)
    leaves = _leaves((2, 16, K), (2, K, 16), (K, 16))  # the second b broadcast over the batch
    _assert_in_place_equals_out_of_place(lambda a, b1, b2: (matmul(a, b1), matmul(a, b2)), leaves)
    addend = _leaves((2, 16, K), (2, K, 16), (2, 16, 16))  # baddbmm: c + a @ b
    _assert_in_place_equals_out_of_place(lambda a, b, c: (matmul(a, b, c), matmul(a, b)), addend)


class TwoProjectionsAddedInPlace(nn.Module):
    """``x -> (first, second) -> first += second``: one group's call, its first output written in place."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(K, N)
        self.second = nn.Linear(K, N, bias=False)

    def forward(self, x):
        y = self.first(x)
        y += self.second(x)
        return y


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_compiled_group_output_added_in_place_trains(compiler):
    torch.manual_seed(0)
    model = TwoProjectionsAddedInPlace().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8, K, dtype=torch.bfloat16)
    compiled, backend = compile_fp8(model, compiler=compiler)
    out = compiled(x)
    out.float().square().mean().backward()
    expected = reference(x)
    expected.float().square().mean().backward()
    calls = [n.target.__name__ for gm in backend.graph_modules for n in gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "").startswith("fp8graph_")]
    assert calls == ["fp8graph_linears_current_HYBRID_emulated"]  # one group, its weights cast per call
    assert sum(fp8_target_count(gm) for gm in backend.graph_modules) == 2
    assert sqnr_db(expected.float(), out.float()) > 20
    for (name, param), reference_param in zip(model.named_parameters(), reference.parameters()):
        assert sqnr_db(reference_param.grad.float(), param.grad.float()) > 15, name


@pytest.mark.parametrize("architecture", [dict(parallel_attn=True, new_decoder_architecture=False),
                                          dict(new_decoder_architecture=True, num_kv_heads=2)],
                         ids=["parallel_attn", "new_decoder_architecture"])
def test_falcon_trains(architecture):
    """Falcon's decoder layer adds the attention's output into the MLP's in place."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                          **architecture)
    model = FalconForCausalLM(config).to(torch.bfloat16)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = compiled(input_ids=tokens, labels=tokens).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
