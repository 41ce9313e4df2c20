"""The structure of the FX graphs fp8graph hands to Inductor, which no backend changes.

    model -> Dynamo -> fp8graph passes -> AOTAutograd (Inductor's decompositions) -> [forward, backward]

The graphs are captured where Inductor would receive them (``aot_autograd``
with Inductor's decomposition table and min-cut partitioner), so what is
pinned here is what any Inductor backend starts from. What it does not prove: how the GPU's Triton
code tiles and fuses those graphs (kernel counts and passes over memory are
for ``python -m bench quantize`` and ``bench decoder --profile`` on a GPU).
"""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

from fp8graph import DelayedScaling, Float8CurrentScaling
from fp8graph.api import compile as fp8_compile
from fp8graph.backend import FP8Backend
from fp8graph.models import build

RECIPES = [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)]


def aot_graphs(model, policy, loss_of) -> list[torch.fx.GraphModule]:
    """The forward and backward ATen graphs of one training step, ``loss_of(compiled model).backward()``."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    # As compile_fx hands graphs to Inductor: its decompositions, its min-cut partitioner (what the
    # backward recomputes), input mutations (delayed-scaling state updates) kept in the graph.
    to_aten = aot_autograd(fw_compiler=keep, bw_compiler=keep, decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)
    compiled = fp8_compile(model, policy=policy, compiler="eager")
    backend: FP8Backend = compiled.fp8graph_backend
    backend._lower = lambda gm, example_inputs: to_aten(gm, example_inputs)
    loss_of(compiled).backward()
    assert any(d.rewritten for d in backend.decisions)
    return graphs


def _cast_amax_nodes(graph: torch.fx.GraphModule):
    """The amaxes of FP8 casts: ``amax(abs(x))`` and the maxima of their partials (not, say, log_softmax's)."""
    amaxes = [node for node in graph.graph.nodes if node.target is torch.ops.aten.amax.default]
    of_magnitudes = {node for node in amaxes if node.args[0].target is torch.ops.aten.abs.default}
    return [node for node in amaxes if node in of_magnitudes or node.args[0] in of_magnitudes]


@pytest.mark.parametrize("recipe", RECIPES, ids=["current", "delayed"])
def test_every_per_tensor_amax_is_a_per_row_partial_then_a_small_max(recipe):
    """A global amax over a 2-D tensor, in one reduction, does not fuse with the cast on the GPU
    (H100: 308 us against 164 us for a delayed cast of 16384x8192 written per row). Every amax over a
    tensor of two or more dimensions reduces its last dimension only; the maxima of those partials
    are 1-D reductions."""
    model = build("llama", "tiny")
    tokens = torch.randint(0, 250, (2, 32))
    graphs = aot_graphs(model, recipe, lambda compiled: compiled(tokens, labels=tokens).loss)
    assert len(graphs) == 2  # forward, backward
    # Forward: the 14 weights and the 8 distinct inputs (q, k and v share one, gate and up another; the
    # partitioner's CSE casts each once); backward: the 14 grad_outputs.
    for graph, casts in zip(graphs, (14 + 8, 14)):
        partials = []
        for node in _cast_amax_nodes(graph):
            source = node.args[0].meta["val"]
            reduced = node.args[1] if len(node.args) > 1 and node.args[1] else range(source.dim())  # [] or none: all
            dims = sorted(dim % source.dim() for dim in reduced)
            if source.dim() >= 2:
                assert dims == [source.dim() - 1], (node.format_node(), source.shape)
                partials.append(node)
            else:
                assert dims == [0]
        # One per-row partial per cast (delayed scaling's history maxima are 1-D, not casts).
        assert len(partials) == casts, [node.format_node() for node in partials]
