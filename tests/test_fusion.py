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
