"""Writes are known by what they do, whatever their spelling.

Two FP8 linears read one tensor and something writes it between them::

    a = q(h)          k(h) must read h after the write: grouping k with q (one cast of h before
    <write h>         the write) would read the old h
    b = k(h)

Each spelling of a write below reaches Dynamo's graph in another form (a keyword argument, a module, a
method, ``out=``, an op overload, a random op, a call fp8graph cannot see into); ``group_sites`` must not
move ``k`` across any of them. The written tensor is an activation or a module buffer; fp32 and BF16; the
outputs, the buffer and the random number generator's state are compared with eager.
"""

import copy

import pytest
import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from fp8graph.passes.side_effects import UNKNOWN, effects_of
from helpers import compile_fp8, sqnr_db

K = N = 32


@torch._dynamo.allow_in_graph
def _opaque_scale(h):
    """A call Dynamo keeps whole in the graph: fp8graph cannot see what it writes."""
    h.mul_(-1.0)
    return None


WRITES = {
    "F.relu inplace": lambda m, h: F.relu(h, inplace=True),
    "F.relu6 inplace": lambda m, h: F.relu6(h, inplace=True),
    "F.leaky_relu inplace": lambda m, h: F.leaky_relu(h, 0.1, inplace=True),
    "F.hardtanh inplace": lambda m, h: F.hardtanh(h, -0.5, 0.5, inplace=True),
    "F.elu inplace": lambda m, h: F.elu(h, inplace=True),
    "F.selu inplace": lambda m, h: F.selu(h, inplace=True),
    "F.silu inplace": lambda m, h: F.silu(h, inplace=True),
    "F.mish inplace": lambda m, h: F.mish(h, inplace=True),
    "F.hardswish inplace": lambda m, h: F.hardswish(h, inplace=True),
    "F.threshold inplace positional": lambda m, h: F.threshold(h, 0.2, 0.0, True),
    "nn.ReLU(inplace=True)": lambda m, h: m.relu(h),
    "F.dropout inplace": lambda m, h: F.dropout(h, 0.5, True, inplace=True),
    "method relu_": lambda m, h: h.relu_(),
    "function torch.relu_": lambda m, h: torch.relu_(h),
    "out=": lambda m, h: torch.mul(h, -2.0, out=h),
    "op overload": lambda m, h: torch.ops.aten.relu_.default(h),
    "uniform_": lambda m, h: h.uniform_(),
    "bernoulli_": lambda m, h: h.bernoulli_(0.5),
    "opaque call": lambda m, h: _opaque_scale(h),
}
DRAWS = {"F.dropout inplace", "uniform_", "bernoulli_"}


class WriteBetween(nn.Module):
    def __init__(self, write, into_buffer: bool):
        super().__init__()
        self.q, self.k = nn.Linear(K, N), nn.Linear(K, N)
        self.relu = nn.ReLU(inplace=True)
        self.register_buffer("state", torch.randn(8, K))
        self._write, self._into_buffer = write, into_buffer

    def forward(self, x):
        h = self.state if self._into_buffer else x * 1.0
        a = self.q(h)
        self._write(self, h)
        return a, self.k(h)


def _run(run, model, x, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        outputs = run(x)
    return outputs, model.state.clone(), torch.get_rng_state()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("into_buffer", [False, True], ids=["activation", "buffer"])
@pytest.mark.parametrize("write", list(WRITES))
def test_a_site_is_not_moved_across_a_write_to_what_it_reads(write, into_buffer, dtype):
    torch.manual_seed(0)
    eager = WriteBetween(WRITES[write], into_buffer).to(dtype)
    model = copy.deepcopy(eager)
    x = torch.randn(8, K, dtype=dtype)
    (expected_a, expected_b), expected_state, expected_rng = _run(eager, eager, x, seed=3)

    compiled, backend = compile_fp8(model, regions=None)
    (a, b), state, rng = _run(compiled, model, x, seed=3)

    grouped = [n for gm in backend.graph_modules for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "__name__", "").startswith("fp8graph_linears_")]
    assert grouped == [], "k's GEMM was moved before the write, into q's group"
    assert sum(d.rewritten for d in backend.decisions) == 2
    assert sqnr_db(expected_a, a) > 20 and sqnr_db(expected_b, b) > 20
    assert torch.equal(state, expected_state)  # the buffer written in place as eager wrote it (or untouched)
    assert torch.equal(rng, expected_rng)  # the same draws from the generator as eager


def _graph_of(write):
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    model = WriteBetween(WRITES[write], into_buffer=False)
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=write != "opaque call")(torch.randn(8, K))
    return captured[0]


@pytest.mark.parametrize("write", list(WRITES))
def test_each_spelling_is_one_write_of_its_argument(write):
    gm = _graph_of(write)
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.nn.functional.linear]
    h = linears[0].args[0]
    version_traced = h.meta["example_value"]._version
    writers = [n for n in gm.graph.nodes if effects_of(n).written is UNKNOWN or h in effects_of(n).written]
    assert len(writers) == 1, [(n.format_node(), effects_of(n)) for n in gm.graph.nodes]
    (writer,) = writers
    if write == "opaque call":
        assert effects_of(writer).written is UNKNOWN
    else:
        assert effects_of(writer).written == (h,)
    assert effects_of(writer).draws_random == (write in DRAWS)
    # The probe ran on fresh fake tensors, not the graph's example value of h: its version counter stays.
    assert h.meta["example_value"]._version == version_traced


def test_pure_ops_and_views_write_nothing():
    def fn(x):
        y = x.t().contiguous().view(-1)
        return F.gelu(F.relu(y)) + torch.zeros(1)

    captured = []
    torch.compile(fn, backend=lambda gm, inputs: captured.append(gm) or gm.forward, fullgraph=True)(torch.randn(4, 4))
    effects = [effects_of(n) for n in captured[0].graph.nodes if n.op in ("call_function", "call_method")]
    assert effects and all(e.written == () and not e.draws_random for e in effects)
