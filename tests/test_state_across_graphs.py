"""State and stats buffers written by more than one training graph.

    a(x) -> graph break -> a(.)     two graphs, one module: refused, naming the module
    a(x)                            recompiled for a new shape: one frame, allowed

A buffer that backward writes is written back whole, as the graph's forward
left it, so two graphs interleaving forward and backward would overwrite
each other's records (and autograd refuses the buffer the second forward changed).
"""

import pytest
import torch

import fp8graph


class _CalledTwice(torch.nn.Module):
    def __init__(self, graph_break: bool):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.graph_break = graph_break

    def forward(self, x):
        x = self.a(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.a(torch.relu(x))


STATEFUL = [dict(policy=fp8graph.DelayedScaling()), dict(stats=True)]


@pytest.mark.parametrize("options", STATEFUL, ids=["delayed", "stats"])
def test_a_module_written_by_two_graphs_is_refused_by_name(options):
    compiled = fp8graph.compile(_CalledTwice(graph_break=True), compiler="aot_eager", **options)
    with pytest.raises(Exception, match="module 'a' has FP8 sites in two compiled graphs"):
        compiled(torch.randn(16, 32))


@pytest.mark.parametrize("options", STATEFUL, ids=["delayed", "stats"])
def test_one_graph_calling_a_module_twice_and_its_recompiles_train(options):
    model = _CalledTwice(graph_break=False)
    compiled = fp8graph.compile(model, compiler="aot_eager", **options)
    for rows in (16, 8, 4):  # a new shape recompiles the same frame
        compiled(torch.randn(rows, 32)).sum().backward()
    assert compiled.fp8graph_backend.graph_count == 2  # static, then dynamic batch
    assert all(d.rewritten for d in compiled.fp8graph_backend.decisions)


def test_inference_graphs_may_share_state():
    """Graphs compiled without gradients only read the state, and no backward writes it."""
    model = _CalledTwice(graph_break=True)
    compiled = fp8graph.compile(model, policy=fp8graph.DelayedScaling(), compiler="aot_eager")
    with torch.no_grad():
        compiled(torch.randn(16, 32))
    assert compiled.fp8graph_backend.graph_count == 2
    assert [d.rewritten for d in compiled.fp8graph_backend.decisions] == [True, True]
