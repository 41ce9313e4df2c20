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
    compiled = fp8graph.compile(model, compiler="inductor")
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


def _passes_over(fn, *args, numel):
    _, [code] = run_and_get_code(torch.compile(fn, backend="inductor"), *args)
    return len(re.findall(rf"x0<static_cast<int64_t>\({numel}L\)", code))


def test_a_delayed_cast_reads_its_tensor_once_a_current_cast_twice():
    from fp8graph.delayed_scaling import delayed_cast
    from fp8graph.quantize import quantize_current

    x, history, scale = torch.randn(4096, 1024), torch.zeros(16), torch.ones(())
    e4m3 = torch.float8_e4m3fn
    # Current scaling needs the amax before it can cast: one loop for the
    # amax, one for the cast. Delayed scaling knows its scale: the cast and the
    # amax it records share one loop.
    assert _passes_over(lambda x: quantize_current(x, e4m3), x, numel=x.numel()) == 2
    delayed = lambda x, h, s: delayed_cast(x, h, s, e4m3, 0, "max", True)  # noqa: E731
    assert _passes_over(delayed, x, history, scale, numel=x.numel()) == 1
