"""What Inductor makes of the rewrite: quantization fused into the kernels that produce the tensors.

    x -> [up: FP8 linear + bias] -> gelu -> [mid: FP8 linear] -> gelu -> [head: kept, N=10]

Counted on CPU (C++ backend, torch 2.13), forward only.
"""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fp8graph
from fp8graph.models import build

pytestmark = pytest.mark.inductor


def test_gelu_output_is_quantized_in_the_kernel_that_computes_it():
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, compiler="inductor", cache_weights=False)  # the weights cast in this call
    with torch.no_grad():
        _, [code] = run_and_get_code(compiled, torch.randn(64, 64))
    kernels = sorted(set(re.findall(r"(cpp_fused_\w+)\(", code)))
    # 0: amax + cast of x and of up.weight; 1: up's dequantize + bias + gelu,
    # then amax + cast for mid (and mid.weight's cast); 2: mid's dequantize + gelu.
    assert len(kernels) == 3, kernels
    producer = [k for k in kernels if all(op in k for op in ("add", "gelu", "amax", "_to_copy"))]
    assert len(producer) == 1, kernels
    # The GEMMs stay library calls: up and mid (emulated FP8) and head (kept, with its bias).
    assert code.count("extern_kernels.mm(") == 2
    assert code.count("extern_kernels.addmm(") == 1


def _input_reads(code: str) -> int:
    """Places in the generated C++ that read the input: each a pass over its elements (the suite compiles
    Inductor's C++ kernels scalar, tests/conftest.py: a load is ``in_ptr0[...]``)."""
    return code.count("in_ptr0[")


@pytest.mark.parametrize("recipe_name", ["rowwise", "block", "mxfp8"])
def test_each_tiled_quantize_is_one_kernel(recipe_name):
    """What Inductor makes of a tiled quantize (amax per tile, scale, cast): one fused kernel.

    Measured on the C++ backend: two passes over each tile (amax, then cast), so
    the tensor is read twice from memory when it exceeds the cache; E8M0
    scales compile from their integer operations like any other op.
    """
    from fp8graph import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling
    from fp8graph.numerics.formats import Role
    from fp8graph.numerics.tiles import reference_quantize_tiles

    recipe = {"rowwise": Float8RowwiseScaling(), "block": Float8BlockScaling(),
              "mxfp8": MXFP8BlockScaling()}[recipe_name]
    tiling = recipe.tiling(Role.INPUT)
    x = torch.randn(1024, 2048)
    _, [code] = run_and_get_code(torch.compile(lambda x: reference_quantize_tiles(x, tiling), backend="inductor"), x)
    assert len(set(re.findall(r"(cpp_fused_\w+)\(", code))) == 1
    assert _input_reads(code) == 2, code


def test_scaled_mm_operands_are_cast_straight_into_the_layouts_the_gemms_read():
    """The GPU's graph (``lowering="scaled_mm"``, run on the CPU kernel), forward and backward.

    ``_scaled_mm`` reads A row-major and B column-major, so each of the three
    GEMMs wants some operand transposed (``grad_input = grad_output @ weight``
    reads the weight column-major, ``grad_weight = grad_output_t @ input`` reads
    grad_output transposed). Inductor writes every FP8 operand from its
    high-precision source by the cast kernel, in the layout its GEMM reads:
    no kernel reads FP8 data, so no FP8 tensor is ever copied to transpose it.
    """
    model = torch.nn.Sequential(torch.nn.Linear(256, 384, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(384, 128, bias=False)).to(torch.bfloat16)
    compiled = fp8graph.compile(model, lowering="scaled_mm")
    x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    _, [forward, backward] = run_and_get_code(lambda: compiled(x).float().sum().backward())
    for code in (forward, backward):
        kernel_arguments = re.findall(r"cpp_fused_\w+ = async_compile\.cpp_pybinding\(\[([^\]]*)\]", code)
        assert kernel_arguments, code
        assert not [args for args in kernel_arguments if "const at::Float8" in args], kernel_arguments
        # Writers of FP8 data exist: the casts are in these kernels, not library calls.
        assert any("at::Float8" in args for args in kernel_arguments)
    assert forward.count("extern_kernels._scaled_mm(") == 2
    assert backward.count("extern_kernels._scaled_mm(") == 4  # grad_input and grad_weight of each layer
