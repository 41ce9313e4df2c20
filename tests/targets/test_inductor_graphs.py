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


def aot_graphs(model, policy, loss_of, lowering: str = "auto") -> list[torch.fx.GraphModule]:
    """The forward and backward ATen graphs of one training step, ``loss_of(compiled model).backward()``.

    ``lowering="scaled_mm"`` gives the GPU's graph (cuBLAS's layouts, run on the CPU kernel)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    # As compile_fx hands graphs to Inductor: its decompositions, its min-cut partitioner (what the
    # backward recomputes), input mutations (delayed-scaling state updates) kept in the graph.
    to_aten = aot_autograd(fw_compiler=keep, bw_compiler=keep, decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)
    # One graph holding every site (regions=None): the structure pinned here is per site, and a
    # region's graph has the same per-site structure (tests/regions/test_regions.py checks regions' numerics).
    compiled = fp8_compile(model, policy=policy, compiler="eager", lowering=lowering, regions=None)
    backend: FP8Backend = compiled.fp8graph_backend
    backend._compile_graph = lambda gm, example_inputs: to_aten(gm, example_inputs)
    loss_of(compiled).backward()
    assert any(d.rewritten for d in backend.decisions)
    return graphs


def _is_finite_magnitude(node: torch.fx.Node) -> bool:
    """``where(|x| < inf, |x|, ...)``: fp8graph.numerics.quantize.finite_magnitude, as decomposed."""
    return node.target is torch.ops.aten.where.self and node.args[1].target is torch.ops.aten.abs.default


def _cast_amax_nodes(graph: torch.fx.GraphModule):
    """The amaxes of FP8 casts: ``amax(finite |x|)`` and the maxima of their partials (not, say, log_softmax's)."""
    amaxes = [node for node in graph.graph.nodes if node.target is torch.ops.aten.amax.default]
    of_magnitudes = {node for node in amaxes if _is_finite_magnitude(node.args[0])}
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


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
# The ops of a per-tensor cast between a tensor and its FP8 copy (fp8graph.numerics.quantize.quantize, as decomposed).
_CAST_CHAIN = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
               torch.ops.aten.permute.default, torch.ops.aten.t.default, torch.ops.aten.clone.default,
               torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default,
               torch.ops.aten.clamp_min.default, torch.ops.aten.clamp_max.default, torch.ops.aten.clamp.default,
               torch.ops.aten.where.self, torch.ops.aten.isinf.default, torch.ops.aten.sub.Tensor,
               torch.ops.aten.abs.default}
_SCALING = {torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor}


def _cast_walk(node: torch.fx.Node) -> tuple[list[torch.fx.Node], bool]:
    """The FP8 conversions ``node`` reaches through cast ops alone (a multiplication only by a scale), and
    whether it feeds any other op on the way."""
    reached, other, frontier, seen = [], False, [node], {node}
    while frontier:
        for user in frontier.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.target is torch.ops.prims.convert_element_type.default and user.args[1] in _FP8_DTYPES:
                reached.append(user)
            elif user.target in _CAST_CHAIN or (user.target in _SCALING and any(
                    isinstance(arg, torch.fx.Node) and arg is not node and arg.meta["val"].numel() == 1
                    for arg in user.args)):
                frontier.append(user)
            else:
                other = True
    return reached, other


def _fp8_casts_reached(node: torch.fx.Node) -> list[torch.fx.Node]:
    return _cast_walk(node)[0]


def _tensor_sources(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph inputs of full size that ``node`` is computed from through cast ops (scales left out)."""
    sources, frontier, seen = [], [node], {node}
    while frontier:
        current = frontier.pop()
        for arg in current.all_input_nodes:
            if arg in seen or arg.meta["val"].numel() == 1:
                continue
            seen.add(arg)
            if arg.op == "placeholder":
                sources.append(arg)
            elif arg.target in _CAST_CHAIN or arg.target in _SCALING:
                frontier.append(arg)
    return sources


def _fp8_copies(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Contiguous copies of FP8 tensors written in the graph's own code: what the casts' kernels write in a
    second layout."""
    return [node for node in graph.graph.nodes
            if node.target is torch.ops.aten.clone.default and node.meta["val"].dtype in _FP8_DTYPES]


_VIEWS = {torch.ops.aten.permute.default, torch.ops.aten.t.default, torch.ops.aten.view.default,
          torch.ops.aten.as_strided.default, torch.ops.aten.alias.default}


def _saved_bases(forward: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose values the forward hands to the backward, each seen through the views saved of it."""
    bases = set()
    for node in forward.graph.output_node().args[0]:
        while isinstance(node, torch.fx.Node) and node.target in _VIEWS:
            node = node.args[0]
        bases.add(node)
    return bases


def _op_count(graph: torch.fx.GraphModule, op) -> int:
    return sum(node.target is op for node in graph.graph.nodes)


def _llama_step_graphs(recipe, lowering="scaled_mm"):
    model = build("llama", "tiny")
    tokens = torch.randint(0, 250, (2, 32))
    return aot_graphs(model, recipe, lambda compiled: compiled(tokens, labels=tokens).loss, lowering)


SAVING = [Float8CurrentScaling(save_transposes=True), DelayedScaling(amax_history_len=4, save_transposes=True)]
SITES, INPUTS = 14, 8  # the tiny Llama: 2 layers x 7 linears; q, k and v read one input, gate and up another


def _weight_casts(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The 2-D graph inputs (the weights) that ``graph`` casts to FP8 itself."""
    return [node for node in graph.graph.nodes if node.op == "placeholder" and node.name.startswith("primals_")
            and node.meta["val"].dim() == 2 and _fp8_casts_reached(node)]


def test_delayed_casts_write_their_transposed_layouts_from_the_fp8_bytes():
    """On the GPU's graph, delayed scaling writes the transposed FP8 copies that cuBLAS reads for grad_weight
    (input and grad_output) with ``fp8graph::transpose_fp8`` from the FP8 bytes, so each cast keeps its one pass
    (H100: 80-83% of a copy; 29-61% with the transpose in the group). Both are written in the backward: each
    input cast again there row-major with the forward's scale, from the input saved or made again. The weights'
    transposed copies, which grad_input reads, are cast in the backward from the weights with the forward's
    scales: no FP8 copy is kept from forward to backward.
    Not proven here: that Inductor's GPU code then fuses the cast and its amax into one kernel
    (``python -m bench model``, ``bench decoder --profile``)."""
    forward, backward = _llama_step_graphs(DelayedScaling(amax_history_len=4))
    transpose_fp8 = torch.ops.fp8graph.transpose_fp8.default
    assert _op_count(forward, transpose_fp8) == 0
    assert _op_count(backward, transpose_fp8) == SITES + INPUTS  # each grad_output's and each input's, once
    assert _fp8_copies(forward) == []  # no FP8 layout written by the casts' own code
    # but the weights' transposed casts in the backward, each read from its weight
    weight_copies = _fp8_copies(backward)
    assert len(weight_copies) == SITES
    assert all([source.name.startswith("primals_") for source in _tensor_sources(copy)] == [True]
               for copy in weight_copies)
    assert len(_weight_casts(backward)) == SITES  # each weight cast again, transposed, for grad_input
    saved = _saved_bases(forward)
    assert not any(node.meta["val"].dtype in _FP8_DTYPES and node.meta["val"].dim() == 2
                   for node in saved)  # no input's or weight's FP8 bytes saved


def test_delayed_casts_with_saved_transposes_keep_every_weight_transposed_for_the_backward():
    """``save_transposes=True``: the weights' transposed copies too are written in the forward (from the FP8
    bytes) and kept, so the backward reads no weight."""
    forward, backward = _llama_step_graphs(SAVING[1])
    transpose_fp8 = torch.ops.fp8graph.transpose_fp8.default
    assert _op_count(forward, transpose_fp8) == INPUTS + SITES  # each input once, each weight
    assert _op_count(backward, transpose_fp8) == SITES
    assert _fp8_copies(forward) == _fp8_copies(backward) == []
    saved = _saved_bases(forward)
    assert sum(node in saved for node in forward.graph.nodes if node.target is transpose_fp8) == INPUTS + SITES
    assert _weight_casts(backward) == []


def test_current_casts_with_saved_transposes_write_both_layouts_in_the_forward_and_keep_the_transposed_ones():
    """``save_transposes=True``: current scaling writes each input's and weight's transposed FP8 copy in the
    forward, from the same high-precision tensor as the row-major cast (one kernel after the amax reduction),
    and the partitioner keeps it for the backward instead of recomputing it there
    (``fp8graph.targets.partitioning``). The backward's only casts are the grad_outputs'."""
    forward, backward = _llama_step_graphs(SAVING[0])
    forward_copies = _fp8_copies(forward)
    assert len(forward_copies) == INPUTS + SITES
    saved = _saved_bases(forward)
    assert all(copy in saved for copy in forward_copies)
    assert len(_fp8_copies(backward)) == SITES  # each grad_output's, for grad_weight
    for copy in forward_copies:  # cast from a full-size tensor of the forward, not from FP8 bytes
        assert all(source.meta["val"].dtype in _HIGH_PRECISION for source in _tensor_sources(copy))
    assert _weight_casts(backward) == []


def test_current_casts_leave_each_inputs_transposed_copy_to_the_partitioner_and_cast_weights_again():
    """By default current scaling casts each weight's transposed copy in the backward, from the weight with
    the forward's scale, and each input's transposed copy is written exactly once: in the forward and saved,
    or in the backward from what the backward keeps anyway, as the partitioner chose."""
    forward, backward = _llama_step_graphs(Float8CurrentScaling())
    assert len(_weight_casts(backward)) == SITES
    # The weights' (backward), the inputs' (either graph) and the grad_outputs' (backward): each once.
    assert len(_fp8_copies(forward)) + len(_fp8_copies(backward)) == 2 * SITES + INPUTS
    saved = _saved_bases(forward)
    assert all(copy in saved for copy in _fp8_copies(forward))


def _needed_beyond_casts(node: torch.fx.Node) -> bool:
    """Whether ``node`` feeds an op other than an FP8 cast's (through the cast chain's views and copies)."""
    return _cast_walk(node)[1]


@pytest.mark.parametrize("recipe", RECIPES + SAVING, ids=["current", "delayed", "current saved", "delayed saved"])
def test_no_activation_is_saved_in_high_precision_only_to_be_cast_again(recipe):
    """Every activation the backward casts to FP8 arrives as FP8, or is a high-precision tensor the backward
    needs anyway (a norm's or an activation function's input, cast again inside their backward's kernels):
    none (2 or 4 bytes an element) is kept from forward to backward only to be quantized again there. With
    ``save_transposes`` no weight is cast again either; by default each weight is, once, for grad_input.
    Not proven here: how much memory or time that saves on a GPU (``bench decoder``: peak memory, profile)."""
    forward, backward = _llama_step_graphs(recipe)
    saved = [node for node in backward.graph.nodes if node.op == "placeholder"
             and not node.name.startswith(("primals_", "tangents_"))]
    assert saved, "no tensors saved for backward"
    recast = [node.name for node in saved if node.meta["val"].dtype in _HIGH_PRECISION
              and node.meta["val"].dim() >= 2 and _fp8_casts_reached(node) and not _needed_beyond_casts(node)]
    assert recast == []
    assert len(_weight_casts(backward)) == (0 if recipe.save_transposes else SITES)
    # The check can fail: in the forward it finds every weight's casts.
    forward_primals = [node for node in forward.graph.nodes if node.op == "placeholder"]
    assert sum(bool(_fp8_casts_reached(node)) and node.meta["val"].dim() == 2 for node in forward_primals) >= 14
