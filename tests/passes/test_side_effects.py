"""The passes keep every node with side effects: in-place writes nobody reads, setitem, RNG.

Each model holds one FP8-eligible linear and one write Dynamo keeps as a node
whose result is unused (the patterns of DeepSeek's attention, the experts'
``index_add_``, ...). Every site kept in high precision, fp8graph's output must
equal plain ``torch.compile``'s bit for bit; with the default FP8 policy it
must match eager within FP8's error.
"""

import copy

import pytest
import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

import forked
import fp8graph
from fp8graph.passes.pipeline import _check_side_effects_kept
from fp8graph.passes.side_effects import UNKNOWN, has_side_effects, side_effect_nodes, written_nodes
from helpers import compile_fp8, fp8_target_count, sqnr_db

K = N = 32


def split_copy(m, x):
    # DeepSeek-V2/V3's attention: a buffer filled by two copy_ into views, then read.
    y = m.proj(x)
    joined = y.new_empty(y.shape)
    joined[..., :16].copy_(y[..., 16:])
    joined[..., 16:].copy_(y[..., :16])
    return m.out(joined)


def index_add(m, x):
    # The eager experts loop of Mixtral and others: outputs accumulated into a zeroed buffer.
    flat = x.reshape(-1, K)
    out = torch.zeros_like(flat)
    rows = torch.arange(0, flat.shape[0], 2)
    out.index_add_(0, rows, m.proj(flat[rows]))
    return m.out(out)


def masked_fill(m, x):
    # The mask comes from the input, so FP8's rounding of y cannot flip it.
    y = m.proj(x)
    y.masked_fill_(x > 0.5, 0.0)
    return m.out(y)


def add_gathered_bias(m, x):
    y = m.proj(x)
    y.add_(m.table[torch.arange(y.shape[-2]) % 4])
    return m.out(y)


def narrow_mul(m, x):
    y = m.proj(x)
    y.narrow(-1, 0, 16).mul_(3.0)
    return m.out(y)


def setitem(m, x):
    y = m.proj(x)
    y[..., 0, :] = 1.0
    return m.out(y)


def in_place_add(m, x):
    # Falcon: the MLP's output gets the attention's added in place.
    y = m.proj(x)
    y += m.out(x)
    return y


PATTERNS = {f.__name__: f for f in (split_copy, index_add, masked_fill, add_gathered_bias, narrow_mul, setitem,
                                    in_place_add)}


class Pattern(nn.Module):
    def __init__(self, forward):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.out = nn.Linear(N, K)
        self.table = nn.Parameter(torch.randn(4, N))
        self._forward = forward

    def forward(self, x):
        return self._forward(self, x)


def _forward_backward(run, model, x):
    out = run(x)
    out.float().square().mean().backward()
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_kept_sites_equal_plain_torch_compile_bit_for_bit(pattern):
    torch.manual_seed(0)
    model = Pattern(PATTERNS[pattern]).to(torch.bfloat16)
    plain, kept = model, copy.deepcopy(model)
    x = torch.randn(2, 8, K, dtype=torch.bfloat16)
    expected, expected_grads = _forward_backward(torch.compile(plain, backend="aot_eager"), plain, x)
    compiled, _ = compile_fp8(kept, policy=fp8graph.Policy(default=None))
    actual, grads = _forward_backward(compiled, kept, x)
    assert torch.equal(actual, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        assert (grad is None and expected_grad is None) or torch.equal(grad, expected_grad)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_fp8_sites_keep_the_writes(pattern):
    torch.manual_seed(0)
    model = Pattern(PATTERNS[pattern])
    x = torch.randn(2, 8, K)
    expected = model(x)
    compiled, backend = compile_fp8(copy.deepcopy(model))
    actual = compiled(x)
    assert sum(fp8_target_count(gm) for gm in backend.graph_modules) == 2
    assert sqnr_db(expected, actual) > 20


def test_dead_random_draws_stay():
    # A random draw nobody reads still advances the generator: the draw after it depends on it.
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, N)

        def forward(self, x):
            torch.rand(3)
            return self.proj(x) + torch.rand(N)

    model, x = Noisy(), torch.randn(4, K)
    torch.manual_seed(1)
    expected = torch.compile(copy.deepcopy(model), backend="aot_eager")(x)
    compiled, _ = compile_fp8(model, policy=fp8graph.Policy(default=None))
    torch.manual_seed(1)
    assert torch.equal(compiled(x), expected)


class QKV(nn.Module):
    """Three projections of one input; ``between`` runs between the first and the second."""

    def __init__(self, between):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(K, N) for _ in range(3))
        self._between = between

    def forward(self, x):
        h = x * 2.0
        q = self.q(h)
        self._between(self, h)
        return q + self.k(h) + self.v(h)


@pytest.mark.parametrize("between, grouped", [
    (lambda m, h: None, True),
    (lambda m, h: h.mul_(3.0), False),  # writes the input the later projections read
    (lambda m, h: torch.rand(1), True),  # a random draw writes nothing the projections read
])
def test_a_group_is_not_moved_across_a_write_to_what_it_reads(between, grouped):
    torch.manual_seed(0)
    model = QKV(between)
    x = torch.randn(4, K)
    torch.manual_seed(2)
    expected = model(x)
    compiled, backend = compile_fp8(copy.deepcopy(model))
    torch.manual_seed(2)
    actual = compiled(x)
    group_calls = [n for gm in backend.graph_modules for n in gm.graph.nodes
                   if n.op == "call_function" and getattr(n.target, "__name__", "").startswith("fp8graph_linears_")]
    assert bool(group_calls) == grouped
    assert sum(fp8_target_count(gm) for gm in backend.graph_modules) == 3
    assert sqnr_db(expected, actual) > 20


def _traced(fn, *args):
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return captured[0]


def test_writes_are_read_from_every_spelling():
    def fn(x, index, y):
        buffer = x.new_zeros(x.shape)
        buffer[:2, :2].copy_(y[:, :2])
        buffer.index_add_(0, index, y)
        buffer[0] = 1.0
        buffer += x
        torch.relu_(buffer)
        torch.rand(2)
        return buffer.t() * 2

    gm = _traced(fn, torch.randn(4, 4), torch.tensor([0, 1]), torch.randn(2, 4))
    effects = side_effect_nodes(gm)
    names = [str(n.target) if n.op == "call_method" else n.target.__name__ for n in effects]
    assert names == ["copy_", "index_add_", "setitem", "iadd", "relu_", "rand"]
    for node in effects[:-1]:
        written = written_nodes(node)
        assert written is not UNKNOWN and len(written) == 1
    assert written_nodes(effects[-1]) == []  # RNG: a side effect, but it writes no tensor of the graph
    pure = [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("t", "new_zeros")]
    assert len(pure) == 2 and not any(has_side_effects(n) for n in pure)


def test_the_driver_refuses_a_pass_that_drops_a_write():
    def fn(x):
        x.add_(1)
        return x * 2

    gm = _traced(fn, torch.randn(3))
    before = [side_effect_nodes(gm)]
    _check_side_effects_kept(gm, before)
    gm.graph.eliminate_dead_code()  # FX's own DCE: counts the unused add_ as dead
    with pytest.raises(AssertionError, match="deleted"):
        _check_side_effects_kept(gm, before)


def test_the_pass_list_is_printed_in_order_and_each_pass_is_checked(monkeypatch):

    from fp8graph.passes import pipeline

    printed = forked.run_python(["-m", "fp8graph", "passes"], check=True).stdout.splitlines()
    assert [line.split()[1] for line in printed] == [p.name for p in pipeline.PASSES]
    assert [p.name for p in pipeline.PASSES][:3] == ["anchored_inputs", "expand_attention", "find_sites"]

    def drop_writes(state):
        """A faulty pass: FX's dead-code elimination, which deletes unread in-place writes."""
        state.gm.graph.eliminate_dead_code()

    def copy_writes(state):
        """A faulty pass: copies every in-place write."""
        graph = state.gm.graph
        for node in [n for n in graph.nodes if n.op == "call_method" and n.target == "add_"]:
            with graph.inserting_after(node):
                graph.node_copy(node)

    def model(x):
        x.add_(1)
        return torch.nn.functional.linear(x, torch.ones(16, 16))

    for faulty, what in ((drop_writes, "deleted"), (copy_writes, "duplicated")):
        monkeypatch.setattr(pipeline, "PASSES", pipeline.PASSES[:3] + (pipeline.GraphPass("faulty", faulty),))
        torch._dynamo.reset()
        with pytest.raises(Exception, match=f"pass faulty {what} add_"):
            torch.compile(model, backend="fp8", options={"compiler": "eager"})(torch.randn(4, 16))
