"""Run by tests/test_quantize_kernel.py under TRITON_INTERPRET=1: kernel vs reference, exact."""

import torch

from fp8graph.kernels.quantize_tiles import quantize_tiles_triton
from fp8graph.tiles import ScaleKind, Tiling, quantize_tiled

TILINGS = [Tiling(1, None, ScaleKind.POWER_2), Tiling(1, None, ScaleKind.EXACT),
           Tiling(1, 128, ScaleKind.POWER_2), Tiling(128, 128, ScaleKind.POWER_2),
           Tiling(128, 128, ScaleKind.EXACT), Tiling(1, 128, ScaleKind.EXACT),
           Tiling(1, 32, ScaleKind.E8M0), Tiling(1, 32, ScaleKind.E8M0)]


def _input(generator, rows, columns):
    # Rows over 6.5 decades, an inf, a NaN, all-zero rows, subnormal-range values.
    # Small: the interpreter runs each program in numpy.
    x = torch.randn(rows, columns, generator=generator)
    x = x * torch.exp(torch.empty(rows, 1).uniform_(-12, 3, generator=generator))
    x[5, 7], x[9, 40], x[20:22] = float("inf"), float("nan"), 0.0
    x[30, :32] = torch.randn(32, generator=generator) * 1e-30
    return x


def main():
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for tiling in TILINGS:
        for transposed in (False, True):  # transposed: strided reads, as for input_t and grad_output_t
            # 128-row tiles need 128 rows either way round; other tiles get a ragged width.
            x = _input(generator, 256, 256) if tiling.rows > 1 else _input(generator, 48, 160)
            x = x.t() if transposed else x
            kernel_fp8, kernel_scale = quantize_tiles_triton(x, tiling)
            reference_fp8, reference_scale = quantize_tiled(x.contiguous(), tiling)
            label = f"{tiling.label} {tiling.scale_kind.value} transposed={transposed}"
            assert torch.equal(kernel_fp8.view(torch.uint8), reference_fp8.view(torch.uint8)), label
            assert torch.equal(kernel_scale.nan_to_num(-1.0), reference_scale.nan_to_num(-1.0)), label
            checked += 1
    print(f"cases checked: {checked}")


if __name__ == "__main__":
    main()
