"""Every amax a scale is computed from is an fp32 value in the graphs fp8graph's targets trace to.

A BF16 amax is two values under Inductor's Triton code: the kernel that reduces it keeps the unrounded fp32 value
it computed, the buffer it stores for the next kernel holds it rounded. Row-wise scaling cast a column of
grad_output with the power-of-2 scale of one and dequantized it with the other's where the amax lay just above
1.75 * 2**m: a row of grad_weight came out doubled (the tiny Llama's gradients 3-4 dB from the emulation on an
H100 and an H200). ``fp8graph.numerics.quantize.finite_magnitude`` takes every magnitude in fp32; here the forward
and backward graphs of each recipe's targets, on BF16 operands, are read for their amax reductions.
"""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

import fp8graph
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.targets.grouped import grouped_fp8_target
from fp8graph.targets.linear_tensorwise import linear_fp8_target
from fp8graph.targets.linear_tiled import linear_tiled_target

_REDUCTIONS = {torch.ops.aten.amax.default, torch.ops.aten.max.default, torch.ops.aten.max.dim}


def _amax_dtypes(fn, *inputs) -> list[torch.dtype]:
    """The dtypes of every amax reduction in the forward and backward graphs ``fn`` traces to."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    output = compiled(*inputs)
    output.float().square().sum().backward()
    assert len(graphs) == 2  # forward and backward
    return [node.meta["val"][0].dtype if isinstance(node.meta["val"], tuple) else node.meta["val"].dtype
            for gm in graphs for node in gm.graph.nodes if node.op == "call_function" and node.target in _REDUCTIONS]


def _delayed(recipe, lowering):
    state = (torch.zeros(2, 4), torch.ones(2), torch.zeros(1, 4), torch.ones(1))
    target = linear_fp8_target(recipe, lowering)
    return lambda x, w: target(x, w, None, None, *state)


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "rowwise", "block", "mxfp8"])
def test_every_amax_of_a_linears_casts_is_fp32(recipe_name):
    recipe = {"current": fp8graph.Float8CurrentScaling(), "delayed": fp8graph.DelayedScaling(amax_history_len=4),
              "rowwise": fp8graph.Float8RowwiseScaling(), "block": fp8graph.Float8BlockScaling(),
              "mxfp8": fp8graph.MXFP8BlockScaling()}[recipe_name]
    lowering = Lowering.EMULATED
    target = (_delayed(recipe, lowering) if recipe.stateful else
              linear_tiled_target(recipe, lowering) if recipe.tiled else linear_fp8_target(recipe, lowering))
    x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    dtypes = _amax_dtypes(target, x, w)
    assert dtypes and set(dtypes) == {torch.float32}, dtypes


@pytest.mark.parametrize("recipe", [fp8graph.Float8CurrentScaling(), fp8graph.MXFP8BlockScaling()], ids=str)
def test_every_amax_of_an_expert_gemms_casts_is_fp32(recipe):
    """The expert GEMMs' casts (row-wise's group columns are reduced by torch.segment_reduce, an ATen kernel that
    reads its stored input: one value, exact in BF16)."""
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 64, 64, dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([8, 16, 32, 40], dtype=torch.int32)
    target = grouped_fp8_target(recipe, Lowering.EMULATED)
    dtypes = _amax_dtypes(lambda x_, w_: target(x_, w_, offsets), x, w)
    assert dtypes and set(dtypes) == {torch.float32}, dtypes
