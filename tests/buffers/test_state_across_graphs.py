"""Delayed-scaling state and stats buffers of a module whose sites land in more than one training graph.

    a(x) -> graph break -> a(.)     two graphs, one module: delayed state trains as in one graph;
                                    stats are refused, naming the module
    a(x)                            recompiled for a new shape: one frame, allowed

The forward and the backward write delayed state in buffers of their own
(``fp8graph.buffers.delayed_state``), each reading them as they are. A stats buffer is
written by both, so a backward writes it back whole, as its graph's forward
left it: two graphs interleaving forward and backward would overwrite each
other's records (and autograd refuses the buffer the second forward changed).
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


def test_stats_of_a_module_written_by_two_graphs_are_refused_by_name():
    compiled = fp8graph.compile(_CalledTwice(graph_break=True), compiler="aot_eager", stats=True)
    with pytest.raises(Exception, match="module 'a' has FP8 sites in two compiled graphs.*stats=False"):
        compiled(torch.randn(16, 32))


def _train_called_twice(graph_break: bool, compiler: str):
    torch.manual_seed(0)
    model = _CalledTwice(graph_break)
    compiled = fp8graph.compile(model, policy=fp8graph.DelayedScaling(amax_history_len=4), compiler=compiler)
    outputs = []
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)) * (step + 1)
        output = compiled(x)
        output.sum().backward()
        outputs.append(output.detach())
    state = {name: value.clone() for name, value in model.state_dict().items() if "fp8graph" in name}
    return outputs, state, model.a.weight.grad, compiled.fp8graph_backend.graph_count


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_delayed_state_of_a_module_in_two_graphs_moves_as_in_one(compiler):
    outputs, state, grad, graphs = _train_called_twice(graph_break=True, compiler=compiler)
    one_outputs, one_state, one_grad, one_graph = _train_called_twice(graph_break=False, compiler=compiler)
    assert (graphs, one_graph) == (2, 1)  # outside fp8graph.weights_unchanged: one graph a piece, casting per call
    assert all(torch.equal(a, b) for a, b in zip(outputs, one_outputs))
    assert state.keys() == one_state.keys() and len(state) == 4
    for name, value in one_state.items():
        assert torch.equal(state[name], value), name  # both calls recorded, in order, every step
    # The weight's gradient sums the two calls' in another order (autograd across graphs, not in one).
    torch.testing.assert_close(grad, one_grad, rtol=1e-5, atol=1e-6)


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
