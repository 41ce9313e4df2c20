"""Tiled FP8 quantization on CUDA: fp8graph's Triton kernels, and where they beat Inductor's code.

Two ops, registered with ``torch.library`` so graphs carry them as single
nodes (on CUDA they run the Triton kernels of ``_quantize_tiles_triton``;
everywhere else the plain-torch reference ``fp8graph.numerics.tiles.reference_quantize_tiles``,
which the tests hold them to bit for bit)::

    fp8graph::quantize_tiles(x, tile_rows, tile_cols, scale_kind)        -> x_fp8, scale
    fp8graph::quantize_tiles_and_transpose(x, tile_rows, tile_cols, scale_kind)   -> x_fp8, scale, x_t_fp8, scale_t

``quantize_tiles_and_transpose`` reads ``x`` once and writes it quantized along its
rows and, transposed, along its columns: what the forward needs of an input
(the GEMM's and, for the weight gradient, the transpose's) and the backward
of a gradient. For 128x128 tiles both layouts share the tiles and scales.

Which code quantizes a tiling on CUDA (:func:`kernel_quantizes`) follows the
stored H100 run of ``python -m bench quantize`` (the fractions of a copy's
bandwidth each reached: ``docs/benchmarks.md``):

    row-wise   Inductor, near copy speed. Its row reduction fuses amax and cast
               into one pass and can fuse into the producer (an RMSNorm reduces
               the same rows), which no separate kernel can.
    MX 1x32    Inductor, near copy speed.
    1x128      this kernel. The linear needs two layouts (activations and
               gradients are quantized along both dimensions), and
               ``quantize_blocks_kernel`` writes both from one read, 4 bytes moved
               per element where Inductor's code moves at least 6.
    128x128    this kernel. Inductor's reduction over a 128x128 tile of a
               row-major tensor is strided (a small fraction of copy speed); the
               kernel also writes the weight's transpose, which the gradient GEMM
               reads, from the same read.

The kernels of that run failed to compile (a non-constexpr global) and the
ones here are new: ``python -m bench quantize`` times every tiling both ways,
so the next GPU run confirms or reverses these choices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from fp8graph.numerics.formats import fp8_max, fp8_max_exponent
from fp8graph.numerics.tiles import ScaleKind, Tiling, reference_quantize_tiles, reference_quantize_tiles_and_transpose

__all__ = ["KernelLaunch", "kernel_quantizes", "plan_quantize_tiles_kernel", "plan_quantize_tiles_and_transpose_kernel",
           "quantize_tiles", "quantize_tiles_and_transpose", "run_quantize_tiles_and_transpose_kernel",
           "run_quantize_tiles_kernel", "triton_available"]

_SCALE_KINDS = {ScaleKind.EXACT: 0, ScaleKind.POWER_2: 1, ScaleKind.E8M0: 2}
_BLOCK = 128  # quantize_blocks_kernel's square block: 1x128 tiles both ways, or one 128x128 tile
_BLOCK_CHUNK = 32  # rows or columns of the block quantize_blocks_kernel holds at once
_ROW_TILE_ELEMENTS = 8192  # elements a program of quantize_row_tiles_kernel holds
_ROW_CHUNK = 8192  # columns of a row quantize_rows_kernel holds at once; longer rows take two walks
_NUM_WARPS = 8


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_quantizes(tiling: Tiling) -> bool:
    """Whether fp8graph's kernel (rather than Inductor's code) quantizes ``tiling`` on CUDA (see above)."""
    return tiling.cols == _BLOCK and tiling.rows in (1, _BLOCK) and triton_available()


def _tiling(tile_rows: int, tile_cols: int, scale_kind: str) -> Tiling:
    return Tiling(tile_rows, None if tile_cols == 0 else tile_cols, ScaleKind(scale_kind))


def _padded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One Triton kernel launch: ``kernel[grid](*args, **constexprs)``.

    Built apart from running it so that tests can compile exactly what would
    be launched, for GPUs this machine does not have (``tests/kernels/test_kernels_compile.py``).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs)


def _common_constexprs(tiling: Tiling, fp8_dtype=torch.float8_e4m3fn) -> dict:
    from triton import knobs

    return {"SCALE_KIND": _SCALE_KINDS[tiling.scale_kind], "FP8_MAX": fp8_max(fp8_dtype),
            "FP8_MAX_EXPONENT": fp8_max_exponent(fp8_dtype),
            # The interpreter's own FP8 conversion is not the GPU's: round in software there.
            "SOFTWARE_ROUNDING": bool(knobs.runtime.interpret), "num_warps": _NUM_WARPS}


def _is_column_major(x: torch.Tensor) -> bool:
    return x.stride(0) == 1 and x.stride(1) != 1


def _plan_blocks(x: torch.Tensor, tiling: Tiling, row_major: bool, transposed: bool):
    """``quantize_blocks_kernel`` on x (R, C): outputs x_fp8 (R, C'), scale, x_t_fp8 (C, R'), scale_t.

    Unrequested outputs are allocated empty (shape (0,)) and never written.
    """
    from fp8graph.kernels._quantize_tiles_triton import quantize_blocks_kernel

    rows, columns = x.shape
    square = tiling.is_square
    if square and (rows % _BLOCK or (transposed and columns % _BLOCK)):
        raise ValueError(f"{rows}x{columns} does not divide into {_BLOCK}x{_BLOCK} tiles")
    rows_padded, columns_padded = _padded(rows, _BLOCK), _padded(columns, _BLOCK)
    # Offsets inside a block are 32-bit: up to BLOCK times a stride or a row length.
    largest = max(abs(x.stride(0)), abs(x.stride(1)), rows_padded, columns_padded)
    if largest * _BLOCK >= 2**31:
        raise ValueError(f"quantize_blocks_kernel takes dimensions and strides below {2**31 // _BLOCK}, "
                         f"got {largest} (x of shape {tuple(x.shape)}, strides {x.stride()})")
    tile_rows_of_x = _BLOCK if square else 1

    def empty(shape, dtype, wanted):
        return torch.empty(shape if wanted else (0,), dtype=dtype, device=x.device)

    x_fp8 = empty((rows, columns_padded), torch.float8_e4m3fn, row_major)
    scale = empty((rows // tile_rows_of_x, columns_padded // _BLOCK), torch.float32, row_major)
    x_t_fp8 = empty((columns, rows_padded), torch.float8_e4m3fn, transposed)
    scale_t = empty((columns // tile_rows_of_x, rows_padded // _BLOCK), torch.float32, transposed)
    launch = KernelLaunch(
        quantize_blocks_kernel, (rows_padded // _BLOCK, columns_padded // _BLOCK),
        (x, x_fp8.view(torch.uint8), scale, x_t_fp8.view(torch.uint8), scale_t, rows, columns, rows_padded,
         columns_padded, x.stride(0), x.stride(1)),
        {"BLOCK": _BLOCK, "CHUNK": _BLOCK_CHUNK, "SQUARE": square, "ROW_MAJOR": row_major, "TRANSPOSED": transposed,
         **_common_constexprs(tiling)})
    return launch, (x_fp8, scale, x_t_fp8, scale_t)


def plan_quantize_tiles_kernel(x_hp: torch.Tensor,
                               tiling: Tiling) -> tuple[KernelLaunch, tuple[torch.Tensor, torch.Tensor]]:
    """The launch that quantizes ``x_hp`` (R, C), any strides, as ``reference_quantize_tiles(x_hp, tiling)``,
    and its outputs."""
    from fp8graph.kernels._quantize_tiles_triton import quantize_row_tiles_kernel, quantize_rows_kernel

    import triton

    rows, columns = x_hp.shape
    if rows % tiling.rows:
        raise ValueError(f"{rows} rows are no multiple of {tiling.rows}-row tiles")
    if tiling.cols == _BLOCK and tiling.rows in (1, _BLOCK):
        if _is_column_major(x_hp):
            # The transpose of a row-major tensor (input_t, grad_output_t): read it row-major
            # and write the transposed layout, so both the reads and the writes are coalesced.
            launch, (_, _, x_fp8, scale) = _plan_blocks(x_hp.t(), tiling, row_major=False, transposed=True)
        else:
            launch, (x_fp8, scale, _, _) = _plan_blocks(x_hp, tiling, row_major=True, transposed=False)
        return launch, (x_fp8, scale)
    if tiling.cols is None:  # row-wise: one scale per row
        chunk = min(triton.next_power_of_2(columns), _ROW_CHUNK)
        block_rows = max(1, min(_ROW_TILE_ELEMENTS // chunk, triton.next_power_of_2(rows)))
        x_fp8 = torch.empty((rows, columns), dtype=torch.float8_e4m3fn, device=x_hp.device)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x_hp.device)
        launch = KernelLaunch(
            quantize_rows_kernel, (triton.cdiv(rows, block_rows),),
            (x_hp, x_fp8.view(torch.uint8), scale, rows, columns, x_hp.stride(0), x_hp.stride(1)),
            {"BLOCK_ROWS": block_rows, "CHUNK": chunk, "ONE_CHUNK": columns <= chunk, **_common_constexprs(tiling)})
        return launch, (x_fp8, scale)
    if tiling.rows != 1:
        raise ValueError(f"no kernel for {tiling.label} tiles")
    tile_cols = tiling.cols
    columns_padded = _padded(columns, tile_cols)
    tiles_per_block = max(1, min(_ROW_TILE_ELEMENTS // 8 // tile_cols,
                                 triton.next_power_of_2(columns_padded // tile_cols)))
    block_rows = max(1, min(_ROW_TILE_ELEMENTS // (tiles_per_block * tile_cols), triton.next_power_of_2(rows)))
    x_fp8 = torch.empty((rows, columns_padded), dtype=torch.float8_e4m3fn, device=x_hp.device)
    scale = torch.empty((rows, columns_padded // tile_cols), dtype=torch.float32, device=x_hp.device)
    launch = KernelLaunch(
        quantize_row_tiles_kernel,
        (triton.cdiv(rows, block_rows), triton.cdiv(columns_padded // tile_cols, tiles_per_block)),
        (x_hp, x_fp8.view(torch.uint8), scale, rows, columns, columns_padded, x_hp.stride(0), x_hp.stride(1)),
        {"BLOCK_ROWS": block_rows, "TILES_PER_BLOCK": tiles_per_block, "TILE_COLS": tile_cols,
         **_common_constexprs(tiling)})
    return launch, (x_fp8, scale)


def plan_quantize_tiles_and_transpose_kernel(x_hp: torch.Tensor, tiling: Tiling):
    """The launch that quantizes ``x_hp`` (R, C) along its rows and, transposed, along its columns.

    Outputs ``(x_fp8, scale, x_t_fp8, scale_t)``: ``reference_quantize_tiles(x_hp, tiling)``
    and ``reference_quantize_tiles(x_hp.t(), tiling)``. Tilings: 1x128 and 128x128.
    """
    if not (tiling.cols == _BLOCK and tiling.rows in (1, _BLOCK)):
        raise ValueError(f"quantize_tiles_and_transpose takes 1x{_BLOCK} or {_BLOCK}x{_BLOCK} tiles, "
                         f"not {tiling.label}")
    return _plan_blocks(x_hp, tiling, row_major=True, transposed=True)


def run_quantize_tiles_kernel(x_hp: torch.Tensor, tiling: Tiling) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel on ``x_hp`` (R, C), any strides; same results as ``reference_quantize_tiles``."""
    launch, outputs = plan_quantize_tiles_kernel(x_hp, tiling)
    launch()
    return outputs


def run_quantize_tiles_and_transpose_kernel(x_hp: torch.Tensor, tiling: Tiling):
    """Run ``quantize_blocks_kernel`` on ``x_hp``: ``reference_quantize_tiles`` of it and of its transpose, one read."""
    launch, outputs = plan_quantize_tiles_and_transpose_kernel(x_hp, tiling)
    launch()
    return outputs


@torch.library.custom_op("fp8graph::quantize_tiles", mutates_args=())
def quantize_tiles(x_hp: torch.Tensor, tile_rows: int, tile_cols: int,
                   scale_kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_quantize_tiles(x_hp, Tiling(tile_rows, tile_cols or None, scale_kind))`` to E4M3, row-major."""
    return tuple(t.contiguous() for t in reference_quantize_tiles(x_hp, _tiling(tile_rows, tile_cols, scale_kind)))


@quantize_tiles.register_fake
def _(x_hp, tile_rows, tile_cols, scale_kind):
    rows, columns = x_hp.shape
    padded = columns if tile_cols == 0 else _padded(columns, tile_cols)
    tile_columns = 1 if tile_cols == 0 else padded // tile_cols
    return (x_hp.new_empty((rows, padded), dtype=torch.float8_e4m3fn),
            x_hp.new_empty((rows // tile_rows, tile_columns), dtype=torch.float32))


@quantize_tiles.register_kernel("cuda")
def _(x_hp, tile_rows, tile_cols, scale_kind):
    if not triton_available():
        return reference_quantize_tiles(x_hp, _tiling(tile_rows, tile_cols, scale_kind))
    return run_quantize_tiles_kernel(x_hp, _tiling(tile_rows, tile_cols, scale_kind))


@torch.library.custom_op("fp8graph::quantize_tiles_and_transpose", mutates_args=())
def quantize_tiles_and_transpose(x_hp: torch.Tensor, tile_rows: int, tile_cols: int,
                        scale_kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_tiles`` of ``x_hp`` and of ``x_hp.t()``: ``(x_fp8, scale, x_t_fp8, scale_t)``."""
    return reference_quantize_tiles_and_transpose(x_hp, _tiling(tile_rows, tile_cols, scale_kind))


@quantize_tiles_and_transpose.register_fake
def _(x_hp, tile_rows, tile_cols, scale_kind):
    rows, columns = x_hp.shape
    rows_padded, columns_padded = _padded(rows, tile_cols), _padded(columns, tile_cols)
    fp8 = functools.partial(x_hp.new_empty, dtype=torch.float8_e4m3fn)
    fp32 = functools.partial(x_hp.new_empty, dtype=torch.float32)
    return (fp8((rows, columns_padded)), fp32((rows // tile_rows, columns_padded // tile_cols)),
            fp8((columns, rows_padded)), fp32((columns // tile_rows, rows_padded // tile_cols)))


@quantize_tiles_and_transpose.register_kernel("cuda")
def _(x_hp, tile_rows, tile_cols, scale_kind):
    if not triton_available():
        return reference_quantize_tiles_and_transpose(x_hp, _tiling(tile_rows, tile_cols, scale_kind))
    return run_quantize_tiles_and_transpose_kernel(x_hp, _tiling(tile_rows, tile_cols, scale_kind))
