"""The Triton kernels of fp8graph::quantize_tiles(_both) against the plain-torch reference, bit for bit.

Run on CPU by Triton's interpreter (``TRITON_INTERPRET=1``, read when a kernel
is defined, hence a fresh process). Under the interpreter the kernels round to
the E4M3 grid and write NaN and -0 bytes themselves (``SOFTWARE_ROUNDING``),
because the interpreter's own FP8 conversion differs from the GPU's on some
values; on a GPU the hardware's conversion does it. So this checks tiling,
masks, padding, scales and non-finite values exactly; the GPU's conversion is
checked exactly on a GPU (``tests/test_gpu.py``), and that the kernels compile
for one in ``tests/kernels/test_kernels_compile.py``.
"""

import pytest
import torch

from fp8graph.kernels.quantize_tiles import quantize_tiles, triton_available
from fp8graph.numerics.tiles import ScaleKind, Tiling, reference_quantize_tiles
from helpers import cases_checked_under_triton_interpreter

@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.triton_interpreter
def test_triton_kernel_equals_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_quantize_kernel.py") == 18


def test_the_op_runs_the_reference_on_cpu_and_traces_with_its_fake():
    x = torch.randn(64, 96)
    x_fp8, scale = quantize_tiles(x, 1, 32, "e8m0")
    reference_fp8, reference_scale = reference_quantize_tiles(x, Tiling(1, 32, ScaleKind.E8M0))
    assert torch.equal(x_fp8.view(torch.uint8), reference_fp8.view(torch.uint8))
    assert torch.equal(scale, reference_scale)
    torch.library.opcheck(torch.ops.fp8graph.quantize_tiles, (torch.randn(128, 100), 128, 0, "pow2"))
    torch.library.opcheck(torch.ops.fp8graph.quantize_tiles, (torch.randn(8, 100), 1, 32, "e8m0"))
    torch.library.opcheck(torch.ops.fp8graph.quantize_tiles, (torch.randn(384, 256).t(), 1, 128, "pow2"))
    torch.library.opcheck(torch.ops.fp8graph.quantize_tiles_and_transpose, (torch.randn(200, 300), 1, 128, "pow2"))
    torch.library.opcheck(torch.ops.fp8graph.quantize_tiles_and_transpose, (torch.randn(256, 384), 128, 128, "exact"))


@pytest.mark.parametrize("tiling", [Tiling(1, 128, ScaleKind.POWER_2), Tiling(128, 128, ScaleKind.POWER_2)],
                         ids=["1x128", "128x128"])
@pytest.mark.parametrize("along", [(True, True), (True, False), (False, True)], ids=["both", "rows", "columns"])
def test_the_linear_quantizes_through_the_kernel_ops_as_through_inductors_code(tiling, along):
    """The CUDA routing of fp8graph.gemm.tiled_operands, run on the ops' CPU reference: same values and shapes,
    one op for both layouts (one read), and each layout only where a gradient asks for it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8graph.gemm.tiled_operands import quantize_both_ways

    x = torch.randn(256, 384)

    def quantized(use_kernel):
        return [(q.fp8.view(torch.uint8), q.scale) if q is not None else None
                for q in quantize_both_ways(x, tiling, *along, use_kernel=use_kernel)]

    for by_kernel, by_inductor in zip(quantized(True), quantized(False)):
        assert (by_kernel is None) == (by_inductor is None)
        if by_kernel is not None:
            assert torch.equal(by_kernel[0], by_inductor[0].contiguous()) and torch.equal(by_kernel[1], by_inductor[1])
    graph = make_fx(lambda x: [t for pair in quantized(True) if pair for t in pair])(x).graph
    ops = [str(node.target) for node in graph.nodes if node.op == "call_function" and "fp8graph" in str(node.target)]
    expected = "fp8graph.quantize_tiles_and_transpose.default" if all(along) else "fp8graph.quantize_tiles.default"
    assert ops == [expected]


def test_the_block_kernel_refuses_dimensions_its_32_bit_offsets_cannot_reach():
    from fp8graph.kernels.quantize_tiles import plan_quantize_tiles_and_transpose_kernel

    tiling = Tiling(1, 128, ScaleKind.POWER_2)
    plan_quantize_tiles_and_transpose_kernel(torch.empty(2**24 - 128, 256, device="meta"), tiling)
    with pytest.raises(ValueError, match=r"dimensions and strides below 16777216, got 16777344"):
        plan_quantize_tiles_and_transpose_kernel(torch.empty(2**24 + 1, 256, device="meta"), tiling)
