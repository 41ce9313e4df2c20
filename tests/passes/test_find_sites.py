"""Site finding and annotation on small graphs, one op spelling at a time.

Each case is a module whose forward holds one GEMM; the test compiles it with
the eager compiler and reads the decision the backend made.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fp8graph
from fp8graph.passes.module_paths import _normalize_source_path
from helpers import compile_fp8, fp8_target_count, sqnr_db


class OneGemm(nn.Module):
    def __init__(self, forward, K=32, N=48, weight_kn=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(K, N) if weight_kn else torch.randn(N, K))
        self.bias = nn.Parameter(torch.randn(N))
        self._forward = forward

    def forward(self, x):
        return self._forward(self, x)


REWRITTEN_CASES = {
    "linear+bias": (lambda m, x: F.linear(x, m.weight, m.bias), False, "linear"),
    "linear": (lambda m, x: F.linear(x, m.weight), False, "linear"),
    "matmul-kn": (lambda m, x: torch.matmul(x, m.weight), True, "matmul"),
    "at-operator-kn": (lambda m, x: x @ m.weight, True, "matmul"),
    "method-matmul": (lambda m, x: x.matmul(m.weight), True, "matmul"),
    "matmul-t": (lambda m, x: x @ m.weight.t(), False, "matmul"),
    "mm-2d": (lambda m, x: torch.mm(x.reshape(-1, x.shape[-1]), m.weight), True, "mm"),
    "addmm-conv1d": (lambda m, x: torch.addmm(m.bias, x.view(-1, x.size(-1)), m.weight), True, "addmm"),
}


@pytest.mark.parametrize("name", list(REWRITTEN_CASES))
def test_linear_spellings_are_rewritten_and_match_f_linear(name):
    forward, weight_kn, op = REWRITTEN_CASES[name]
    model = OneGemm(forward, weight_kn=weight_kn)
    x = torch.randn(2, 8, 32)
    compiled, backend = compile_fp8(model, compiler="eager")
    out = compiled(x)
    [decision] = backend.decisions
    assert decision.rewritten and decision.site.op == op
    assert (decision.site.M, decision.site.K, decision.site.N) == (16, 32, 48)
    assert fp8_target_count(backend.graph_modules[0]) == 1
    expected = forward(model, x)
    assert out.shape == expected.shape
    # FP8 of N(0,1) data: the output tracks the fp32 result to ~28 dB.
    assert sqnr_db(expected, out) > 25


KEPT_CASES = {
    "scaled-addmm": (lambda m, x: torch.addmm(m.bias, x, m.weight, beta=0.5), True,
                     "addmm with alpha or beta other than 1"),
    "param-left": (lambda m, x: m.weight @ x, False, "parameter is the left operand"),
    "activations": (lambda m, x: x @ x.t(), False, "activation x activation matmul"),
    "computed-weight": (lambda m, x: F.linear(x, m.weight * 2), False,
                        "weight is not a parameter"),
    "residual-added": (lambda m, x: torch.addmm(x, x, m.weight), True,
                       "added term of shape (32, 32) is not a bias of its 32 outputs"),
    "row-added": (lambda m, x: torch.addmm(x[:, :1], x, m.weight), True,
                  "added term of shape (32, 1) is not a bias of its 32 outputs"),
    "2-d-bias": (lambda m, x: F.linear(x, m.weight, x), False,
                 "added term of shape (32, 32) is not a bias of its 32 outputs"),
}


@pytest.mark.parametrize("name", list(KEPT_CASES))
def test_non_linear_gemms_are_kept_with_a_reason(name):
    forward, weight_kn, reason = KEPT_CASES[name]
    model = OneGemm(forward, K=32, N=32, weight_kn=weight_kn)
    x = torch.randn(32, 32)
    compiled, backend = compile_fp8(model, compiler="eager")
    torch.testing.assert_close(compiled(x), forward(model, x))  # untouched: exact
    [decision] = backend.decisions
    assert not decision.rewritten and reason in decision.reason
    assert (decision.site.M, decision.site.K, decision.site.N) == (32, 32, 32)
    assert fp8_target_count(backend.graph_modules[0]) == 0


@pytest.mark.parametrize("op", [torch.mm, torch.matmul, lambda x, w, out: torch.addmm(w[0], x, w, out=out)],
                         ids=["mm", "matmul", "addmm"])
def test_a_gemm_writing_into_out_is_kept_and_its_write_kept(op):
    """``out=`` writes a tensor the graph holds: rewritten, the write would go."""
    weight = torch.nn.Parameter(torch.randn(32, 32))

    def forward(x, out):
        op(x, weight, out=out)
        return out * 2

    compiled, backend = compile_fp8(forward, compiler="eager")
    x = torch.randn(16, 32)
    with torch.no_grad():
        assert torch.equal(compiled(x, torch.empty(16, 32)), forward(x, torch.empty(16, 32)))
    [decision] = backend.decisions
    assert not decision.rewritten and "writes its result into out=" in decision.reason


def test_batched_attention_matmul_reports_its_shape():
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)  # (B, heads, T, head_dim)
    compiled, backend = compile_fp8(lambda q, k: torch.matmul(q, k.transpose(-1, -2)), compiler="eager")
    compiled(q, k)
    [decision] = backend.decisions
    assert decision.reason == "activation x activation matmul (FP8 only when a policy rule names it)"
    assert (decision.site.M, decision.site.K, decision.site.N) == (2 * 4 * 16, 8, 16)


@pytest.mark.parametrize("spelling", [
    lambda q, k, c: torch.bmm(q, k.transpose(1, 2)), lambda q, k, c: q.bmm(k.transpose(1, 2)),
    lambda q, k, c: torch.baddbmm(c, q, k.transpose(1, 2)), lambda q, k, c: c.baddbmm(q, k.transpose(1, 2)),
], ids=["torch.bmm", "Tensor.bmm", "torch.baddbmm", "Tensor.baddbmm"])
def test_batched_gemms_are_sites_however_they_are_spelled(spelling):
    """A method call is the function's site: reported with its shape and reason, left as it is."""
    q, k, c = torch.randn(4, 16, 32), torch.randn(4, 16, 32), torch.randn(4, 16, 16)
    compiled, backend = compile_fp8(spelling, compiler="eager")
    assert torch.equal(compiled(q, k, c), spelling(q, k, c))
    [decision] = backend.decisions
    assert decision.reason.startswith("activation x activation matmul")
    assert (decision.site.M, decision.site.K, decision.site.N) == (4 * 16, 32, 16)


class _TwoAttentionLayers(torch.nn.Module):
    """Two equal layers (compiled as one region) whose attention scores multiply two activations."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            x = torch.softmax(h @ h.transpose(-1, -2), dim=-1) @ h
        return x


def test_a_symbolic_sequence_length_is_reported_as_text_and_keeps_every_site_bit_equal_to_torch_compile():
    """With dynamic shapes the attention matmul's K or N is the sequence length, a symbol: reported as text, as
    M is (the regional compiler hashes the shapes), and with every site kept the output is torch.compile's."""
    torch.manual_seed(0)
    model = _TwoAttentionLayers()
    plain = torch.compile(copy.deepcopy(model), backend="aot_eager", dynamic=True)
    compiled = fp8graph.compile(model, policy=fp8graph.Policy(default=None), compiler="aot_eager", dynamic=True)
    for tokens in (16, 24):
        x = torch.randn(2, tokens, 16)
        assert torch.equal(compiled(x), plain(x))
    shapes = {(d.site.K, d.site.N) for d in compiled.fp8graph_backend.decisions if d.site.op == "matmul"}
    assert all(isinstance(size, (int, str)) for shape in shapes for size in shape)
    assert any(isinstance(size, str) for shape in shapes for size in shape)


@pytest.mark.parametrize("K,N,reason", [
    (30, 48, "K=30 is not a multiple of 16"),
    (32, 40, "N=40 is not a multiple of 16"),
])
def test_dims_not_multiple_of_16_stay_in_high_precision(K, N, reason):
    model = nn.Linear(K, N)
    x = torch.randn(4, K)
    compiled, backend = compile_fp8(model, compiler="eager")
    torch.testing.assert_close(compiled(x), model(x))
    [decision] = backend.decisions
    assert decision.reason == reason


def test_float64_sites_are_left_alone():
    model = nn.Linear(32, 32).double()
    x = torch.randn(4, 32, dtype=torch.float64)
    compiled, backend = compile_fp8(model, compiler="eager")
    assert torch.equal(compiled(x), model(x))
    assert backend.decisions[0].reason == "float64 stays in high precision"


def test_m_is_free_and_1d_input_works():
    model = nn.Linear(32, 16)
    compiled, backend = compile_fp8(model, compiler="eager")
    assert compiled(torch.randn(32)).shape == (16,)
    assert compiled(torch.randn(3, 32)).shape == (3, 16)  # M=3: no constraint on M
    assert all(d.rewritten for d in backend.decisions)


@pytest.mark.parametrize("source,path", [
    ("L['self'].model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj"),
    ("L['self'].model.layers[3].mlp", "model.layers.3.mlp"),
    ("L['self']._modules['model']._modules['norm']", "model.norm"),
    ("L['fn'].blocks['2'].attn", "blocks.2.attn"),
    ("L['self']", ""),
])
def test_module_source_paths_normalize_to_named_modules_spelling(source, path):
    assert _normalize_source_path(source) == path


def test_operands_passed_by_keyword_are_found():
    model = OneGemm(lambda m, x: torch.addmm(input=m.bias, mat1=x, mat2=m.weight), weight_kn=True)
    compiled, backend = compile_fp8(model, compiler="eager")
    compiled(torch.randn(16, 32))
    [decision] = backend.decisions
    assert decision.rewritten and (decision.site.K, decision.site.N) == (32, 48)


def test_chained_gemms_are_both_rewritten():
    """x @ w1^T @ w2^T: the second site's input is the first site's (rewritten) output."""
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(48, 32))
            self.w2 = nn.Parameter(torch.randn(16, 48))

        def forward(self, x):
            return F.linear(F.linear(x, self.w1), self.w2)

    model = Chain()
    x = torch.randn(8, 32)
    compiled, backend = compile_fp8(model, compiler="aot_eager")
    out = compiled(x)
    assert [d.rewritten for d in backend.decisions] == [True, True]
    assert sqnr_db(model(x), out) > 20


def test_a_gemm_of_a_childs_weight_run_by_its_parent_is_named_after_the_child():
    # Mamba's mixer computes self.dt_proj.weight @ x without calling dt_proj; a report naming only the mixer
    # would not show the dt_proj linear at all. A parameter the caller owns keeps the caller's name.
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.dt_proj = nn.Linear(32, 48)
            self.own = nn.Parameter(torch.randn(32, 32))

        def forward(self, x):  # x: (B, 32, T)
            return self.dt_proj.weight @ (self.own @ x)

    model = nn.Sequential(Mixer())
    report = fp8graph.explain(model, torch.randn(2, 32, 8))
    assert sorted((row.path, row.reason) for row in report) == [
        ("0", "parameter is the left operand"), ("0.dt_proj", "parameter is the left operand")]


class _SharedInputs(nn.Module):
    """q, k and v read one input; so do gate and up; o reads its own, and a projection with N=40 (never FP8) reads
    q's input too."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 32)
        self.gate, self.up, self.odd = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(32, 40)

    def forward(self, x):
        h = self.o(self.q(x) + torch.cat([self.k(x), self.v(x)], -1)) + self.odd(x)[..., :32]
        return self.gate(h) * self.up(h)


def test_each_linear_knows_how_many_linears_read_its_input():
    """What the cost model divides a shared input's casts by (one cast serves the group, passes.group_sites): the
    linears that read the same input node and can run in FP8; the policy sees it in SiteInfo."""
    seen = {}

    def record(path, module, site):
        seen[path] = site.input_readers
        return False

    compiled, backend = compile_fp8(_SharedInputs(), compiler="eager", policy=fp8graph.Policy(rules=[(record, None)]))
    compiled(torch.randn(4, 32))
    readers = {d.site.path: d.site.input_readers for d in backend.decisions}
    assert readers == {"q": 3, "k": 3, "v": 3, "o": 1, "odd": 1, "gate": 2, "up": 2}
    assert seen == readers
