"""The Triton kernel of fp8graph::quantize_tiles against the plain-torch reference, bit for bit.

Run on CPU by Triton's interpreter (``TRITON_INTERPRET=1``, read when a kernel
is defined, hence a fresh process). The kernel rounds to the E4M3 grid and
writes NaN and -0 bytes itself, so the interpreter's own FP8 conversion,
which differs from the GPU's on some values, never decides a result: the
comparison is exact, as it is on a GPU (``tests/test_gpu.py``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8graph.kernels.quantize_tiles import quantize_tiles, triton_available
from fp8graph.tiles import ScaleKind, Tiling, quantize_tiled

CHECK_SCRIPT = Path(__file__).parent / "scripts" / "check_quantize_kernel.py"


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_triton_kernel_equals_the_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(CHECK_SCRIPT)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cases checked: 16" in result.stdout, result.stdout


def test_the_op_runs_the_reference_on_cpu_and_traces_with_its_fake():
    x = torch.randn(64, 96)
    x_fp8, scale = quantize_tiles(x, 1, 32, "e8m0")
    reference_fp8, reference_scale = quantize_tiled(x, Tiling(1, 32, ScaleKind.E8M0))
    assert torch.equal(x_fp8.view(torch.uint8), reference_fp8.view(torch.uint8))
    assert torch.equal(scale, reference_scale)
    torch.library.opcheck(torch.ops.fp8graph.quantize_tiles, (torch.randn(128, 100), 128, 0, "pow2"))
    torch.library.opcheck(torch.ops.fp8graph.quantize_tiles, (torch.randn(8, 100), 1, 32, "e8m0"))
