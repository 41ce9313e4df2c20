"""The tokens' order restored after the expert GEMMs (``inverse[perm] = arange(S); out = rows[inverse]``): a gather
whose backward gathers too, in graphs with FP8 expert GEMMs only, and only where ``inverse`` provably inverts a
sort's permutation."""

import pytest
import torch

import fp8graph
from fp8graph import Float8RowwiseScaling, Policy
from fp8graph.models import build
from fp8graph.passes import pipeline
from fp8graph.passes.unpermute import unpermute_expert_outputs
from fp8graph.targets.unpermute import unpermute_rows


def _restore(rows, keys):
    """The MoE block's pattern: sort, then the inverse permutation written in place, then the gather."""
    _, perm = torch.sort(keys)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    return rows[inverse] * 2


def _argsort_restore(rows, keys):
    perm = torch.argsort(keys)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0])
    return rows[inverse]


def _top_k_index(rows, keys):  # topk's indices repeat no index here, but nothing proves it in general
    _, perm = torch.topk(keys, keys.shape[0])
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0])
    return rows[inverse]


def _shorter_arange(rows, keys):  # not the inverse: the last slot is never written
    _, perm = torch.sort(keys)
    inverse = torch.zeros_like(perm)
    inverse[perm[:-1]] = torch.arange(perm.shape[0] - 1)
    return rows[inverse]


def _permutation_changed_in_place(rows, keys):
    _, perm = torch.sort(keys)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0])
    perm.clamp_(max=3)
    return rows[inverse], perm


def _more_rows_than_the_permutation(rows, keys):  # padded rows: the backward must scatter a gradient per row
    _, perm = torch.sort(keys[:-2])
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0])
    return rows[inverse]


@pytest.mark.parametrize("function, expected", [(_restore, 1), (_argsort_restore, 1), (_top_k_index, 0),
                                                (_shorter_arange, 0), (_permutation_changed_in_place, 0),
                                                (_more_rows_than_the_permutation, 0)],
                         ids=lambda case: getattr(case, "__name__", str(case)))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_only_a_proven_inverse_permutation_is_rewritten(function, expected, dynamic):
    counts = []

    def backend(gm, example_inputs):
        counts.append(unpermute_expert_outputs(gm))
        return gm

    torch._dynamo.reset()
    rows, keys = torch.randn(12, 5), torch.randn(12)
    outputs = torch.compile(function, backend=backend, dynamic=dynamic, fullgraph=True)(rows, keys)
    assert counts == [expected]
    torch.testing.assert_close(outputs, function(rows, keys), rtol=0, atol=0)


def test_its_gradient_is_autograds_for_the_gather():
    rows, keys, grad = torch.randn(40, 8, requires_grad=True), torch.randn(40), torch.randn(40, 8)
    _, perm = torch.sort(keys)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(40)
    expected = torch.autograd.grad(rows[inverse], rows, grad)[0]
    output = unpermute_rows(rows, perm, inverse)
    assert torch.equal(output, rows[inverse])
    assert torch.equal(torch.autograd.grad(output, rows, grad)[0], expected)


def _run_block(policy, monkeypatch, unpermute: bool):
    if not unpermute:
        monkeypatch.setattr(pipeline, "unpermute_expert_outputs", lambda gm: 0)
    torch.manual_seed(0)
    block = build("moe", "tiny", dtype=torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = fp8graph.compile(block, policy=policy, compiler="aot_eager")
    output = compiled(x)
    output.float().pow(2).sum().backward()
    calls = sum(node.target is unpermute_rows for d in compiled.fp8graph_backend.decisions[:1]
                for node in d.site.graph_module.graph.nodes)
    return output, [x.grad, *(p.grad for p in block.parameters())], calls


def test_the_moe_block_with_fp8_experts_computes_what_it_computes_without_the_pass(monkeypatch):
    output, grads, calls = _run_block(Float8RowwiseScaling(), monkeypatch, unpermute=True)
    with monkeypatch.context() as patch:
        plain_output, plain_grads, plain_calls = _run_block(Float8RowwiseScaling(), patch, unpermute=False)
    assert (calls, plain_calls) == (1, 0)
    assert torch.equal(output, plain_output)
    for grad, plain_grad in zip(grads, plain_grads, strict=True):
        assert torch.equal(grad, plain_grad)


def test_a_graph_without_fp8_expert_gemms_is_left_as_it_is(monkeypatch):
    *_, calls = _run_block(Policy(default=None), monkeypatch, unpermute=True)
    assert calls == 0
