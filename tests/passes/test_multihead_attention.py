"""PyTorch's own attention: every projection GEMM is a site, rewritten or kept with a reason.

Dynamo keeps ``F.multi_head_attention_forward`` as one call; ``expand_attention``
opens it, so a layer in training reads

    x -> linear(in_proj_weight) -> sdpa -> linear(out_proj) -> norm -> linear1 -> relu -> linear2

In eval without gradients the layer runs fused ATen ops instead; their GEMMs are
listed as kept.
"""

import pytest
import torch
from torch import nn

import fp8graph
from fp8graph.recipes.scaling import DelayedScaling
from helpers import compile_fp8, decisions_by_path, fp8_target_count, sqnr_db

FAST_PATH_ADVICE = "torch.backends.mha.set_fastpath_enabled(False) before compiling makes them linear sites"
SLICE_REASON = "weight is a slice of a parameter (MultiheadAttention's packed in_proj_weight"


def encoder_layer():
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)


class CrossAttention(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True, **kwargs)

    def forward(self, query, key, value):
        return self.attn(query, key, value, need_weights=False)[0]


def test_explain_lists_the_attention_projections_as_rewritten():
    report = fp8graph.explain(encoder_layer(), torch.randn(2, 8, 64))  # training mode: the general path
    shapes = {record.path: (record.M, record.K, record.N, record.reason) for record in report}
    assert shapes == {
        "self_attn": (16, 64, 192, None),  # the packed in_proj_weight, one GEMM for q, k and v
        "self_attn.out_proj": (16, 64, 64, None),
        "linear1": (16, 64, 128, None),
        "linear2": (16, 128, 64, None),
    }


def test_encoder_layer_in_fp8_tracks_eager_forward_and_backward():
    layer = encoder_layer()
    x = torch.randn(4, 16, 64, requires_grad=True)
    compiled, backend = compile_fp8(layer, compiler="aot_eager")
    out = compiled(x)
    assert [d.site.path for d in backend.decisions if d.rewritten] == [
        "self_attn", "self_attn.out_proj", "linear1", "linear2"]
    assert sum(fp8_target_count(gm) for gm in backend.graph_modules) == 4
    expected = layer(x)
    assert sqnr_db(expected, out) > 20
    grad_output = torch.randn_like(out)
    (grad_fp8,) = torch.autograd.grad(out, layer.self_attn.in_proj_weight, grad_output)
    (grad_fp32,) = torch.autograd.grad(expected, layer.self_attn.in_proj_weight, grad_output)
    assert sqnr_db(grad_fp32, grad_fp8) > 15


def test_keep_all_policy_is_bit_equal_to_plain_compile():
    layer = encoder_layer()
    x = torch.randn(2, 8, 64)
    compiled, backend = compile_fp8(layer, compiler="aot_eager", policy=fp8graph.Policy(default=None))
    out = compiled(x)
    torch._dynamo.reset()
    plain = torch.compile(layer, backend="aot_eager")(x)
    assert torch.equal(out, plain)
    assert {d.site.path: d.reason for d in backend.decisions} == {
        path: "policy keeps it in high precision" for path in ("self_attn", "self_attn.out_proj", "linear1", "linear2")}


def test_eval_fast_paths_are_listed_as_kept_with_the_way_out():
    layer = encoder_layer().eval()
    report = fp8graph.explain(layer, torch.randn(2, 8, 64))  # eval, no gradients: _transformer_encoder_layer_fwd
    assert [(r.path, r.K, r.N) for r in report] == [
        ("self_attn", 64, 192), ("self_attn.out_proj", 64, 64), ("linear1", 64, 128), ("linear2", 128, 64)]
    assert all(r.reason.startswith("fused TransformerEncoderLayer fast path (torch._transformer_encoder_layer_fwd)")
               and FAST_PATH_ADVICE in r.reason for r in report)

    # Eager nn.MultiheadAttention takes this op in eval without gradients; under Dynamo (torch 2.13) it takes the
    # general path, which is opened. The op itself, as eager's fast path calls it:
    class NativeAttention(nn.MultiheadAttention):
        def forward(self, x):
            return torch._native_multi_head_attention(x, x, x, self.embed_dim, self.num_heads, self.in_proj_weight,
                                                      self.in_proj_bias, self.out_proj.weight, self.out_proj.bias,
                                                      None, False)[0]

    model = nn.Sequential(NativeAttention(64, 4, batch_first=True)).eval()
    report = fp8graph.explain(model, torch.randn(2, 8, 64))
    assert [(r.path, r.K, r.N) for r in report] == [("0", 64, 192), ("0.out_proj", 64, 64)]
    assert all(r.reason.startswith("fused MultiheadAttention fast path (torch._native_multi_head_attention)")
               for r in report)

    torch.backends.mha.set_fastpath_enabled(False)
    try:
        report = fp8graph.explain(layer, torch.randn(2, 8, 64))
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert [(r.path, r.reason) for r in report] == [
        ("self_attn", None), ("self_attn.out_proj", None), ("linear1", None), ("linear2", None)]


def test_cross_attention_keeps_the_slices_of_the_packed_weight():
    """key is value, not the query: in_proj_weight is split [E, 2E]; out_proj is still a whole parameter."""
    model = CrossAttention()
    query, memory = torch.randn(2, 8, 64), torch.randn(2, 5, 64)
    compiled, backend = compile_fp8(model, compiler="aot_eager")
    out = compiled(query, memory, memory)
    kept = [(d.site.path, d.site.M, d.site.N) for d in backend.decisions if not d.rewritten]
    assert kept == [("attn", 16, 64), ("attn", 10, 128)]
    assert all(d.reason.startswith(SLICE_REASON) for d in backend.decisions if not d.rewritten)
    assert [d.site.path for d in backend.decisions if d.rewritten] == ["attn.out_proj"]
    assert sqnr_db(model(query, memory, memory), out) > 20


def test_separate_projection_weights_are_rewritten():
    """kdim and vdim differ from embed_dim: q_proj_weight, k_proj_weight, v_proj_weight are parameters."""
    model = CrossAttention(kdim=32, vdim=48)
    query, key, value = torch.randn(2, 8, 64), torch.randn(2, 5, 32), torch.randn(2, 5, 48)
    compiled, backend = compile_fp8(model, compiler="aot_eager")
    out = compiled(query, key, value)
    assert [(d.site.path, d.site.K, d.site.N, d.rewritten) for d in backend.decisions] == [
        ("attn", 64, 64, True), ("attn", 32, 64, True), ("attn", 48, 64, True), ("attn.out_proj", 64, 64, True)]
    assert sqnr_db(model(query, key, value), out) > 20


def test_decoder_layer_has_all_its_projections_listed():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
    report = fp8graph.explain(layer, torch.randn(2, 8, 64), torch.randn(2, 5, 64))
    assert [(r.path, r.reason is None) for r in report] == [
        ("self_attn", True), ("self_attn.out_proj", True), ("multihead_attn", False), ("multihead_attn", False),
        ("multihead_attn.out_proj", True), ("linear1", True), ("linear2", True)]


def test_delayed_scaling_on_the_packed_weight():
    """in_proj_weight belongs to the attention module, whose hooks run: it has state. out_proj's forward never
    runs (its weight is multiplied by the attention's code), so its state is not in the graph: kept, saying so."""
    compiled, backend = compile_fp8(encoder_layer(), compiler="aot_eager", policy=DelayedScaling())
    compiled(torch.randn(2, 8, 64))
    decisions = decisions_by_path(backend)
    assert decisions["self_attn"].rewritten and decisions["linear1"].rewritten
    assert decisions["self_attn.out_proj"].reason.startswith("delayed scaling has no state in this graph")


def test_a_call_that_cannot_be_opened_lists_its_gemms_as_kept():
    """Dynamic shapes: sizes would be baked into the opened ops, so the call stays whole."""
    model = CrossAttention()
    x = torch.randn(2, 8, 64)
    torch._dynamo.reset()
    compiled, backend = compile_fp8(model, compiler="aot_eager", dynamic=True)
    torch.testing.assert_close(compiled(x, x, x), model(x, x, x))
    assert [d.site.path for d in backend.decisions] == ["attn", "attn.out_proj"]
    assert all(d.reason == "F.multi_head_attention_forward left as one call (dynamic shapes): its GEMMs run "
                           "inside it" for d in backend.decisions)
