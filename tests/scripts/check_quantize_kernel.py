"""Run by tests/kernels/test_quantize_kernel.py under TRITON_INTERPRET=1: every kernel launch vs the reference, exact.

The cases are the launches ``tests/kernels/test_kernels_compile.py`` compiles for the
GPU: every tiling of every recipe, contiguous and transposed operands, and
both layouts from one read for 1x128 and 128x128 tiles.
"""

import torch

from fp8graph import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling
from fp8graph.numerics.formats import ROLES
from fp8graph.kernels.quantize_tiles import run_quantize_tiles_and_transpose_kernel, run_quantize_tiles_kernel
from fp8graph.numerics.tiles import reference_quantize_tiles, reference_quantize_tiles_and_transpose

RECIPES = [Float8RowwiseScaling(), Float8RowwiseScaling(power_2_scales=False), Float8BlockScaling(),
           Float8BlockScaling(power_2_scales=False), MXFP8BlockScaling()]
TILINGS = sorted({recipe.tiling(role) for recipe in RECIPES for role in ROLES}, key=repr)


def _input(generator, rows, columns):
    # Rows over 6.5 decades, an inf, a NaN, all-zero rows, subnormal-range values.
    # Small: the interpreter runs each program in numpy.
    x = torch.randn(rows, columns, generator=generator)
    x = x * torch.exp(torch.empty(rows, 1).uniform_(-12, 3, generator=generator))
    x[5, 7], x[9, 40], x[20:22] = float("inf"), float("nan"), 0.0
    x[30, :32] = torch.randn(32, generator=generator) * 1e-30
    return x


def _assert_equal(outputs, references, label):
    assert len(outputs) == len(references), label
    for output, reference in zip(outputs, references):
        assert output.shape == reference.shape, f"{label}: {output.shape} != {reference.shape}"
        if output.dtype == torch.float32:  # scales: a tile's NaN or inf leaves its scale to the finite values
            assert torch.equal(output, reference), label
        else:
            assert torch.equal(output.view(torch.uint8), reference.view(torch.uint8)), label


def main():
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for tiling in TILINGS:
        # 128-row tiles need 128 rows either way round; other tiles get ragged sizes (masks, padding).
        shape = (256, 384) if tiling.rows > 1 else (200, 300)
        for transposed in (False, True):  # transposed: strided reads, as for input_t and grad_output_t
            x = _input(generator, *shape)
            if transposed:
                x = _input(generator, shape[1], shape[0]).t() if tiling.rows == 1 else _input(generator, 384, 256).t()
            label = f"{tiling.label} {tiling.scale_kind.value} transposed={transposed}"
            _assert_equal(run_quantize_tiles_kernel(x, tiling), reference_quantize_tiles(x.contiguous(), tiling), label)
            checked += 1
        if tiling.cols == 128:
            x = _input(generator, *shape)
            _assert_equal(run_quantize_tiles_and_transpose_kernel(x, tiling),
                          reference_quantize_tiles_and_transpose(x, tiling),
                          f"{tiling.label} {tiling.scale_kind.value} both layouts")
            checked += 1
    print(f"cases checked: {checked}")


if __name__ == "__main__":
    main()
