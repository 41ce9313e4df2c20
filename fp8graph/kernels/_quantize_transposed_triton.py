"""Triton kernel behind ``fp8graph::quantize_transposed`` and ``fp8graph::quantize_both_layouts`` (imported only
where Triton is installed).

A tiled cast and transpose of a batch of high-precision matrices, a scale a
matrix: each program loads a BLOCK_ROWS x BLOCK_COLUMNS tile of matrix
``program_id(2)`` (vector loads along whichever dimension is contiguous),
casts it with the matrix's scale and stores the E4M3 bytes transposed, with
contiguous stores along the output's rows; Triton moves the tile through
shared memory between the two layouts. With STRAIGHT it also stores the bytes
in the input's (row-major) layout, and with TILE_AMAX the tile's amax (NaN and
inf as 0, as ``fp8graph.numerics.quantize.finite_magnitude``), one partial a
tile: the high-precision tensor is read once for every output.

The cast is ``fp8graph.kernels._quantize_tiles_triton``'s, so it equals
``fp8graph.numerics.quantize.quantize`` bit for bit. Offsets are 64-bit from
the program ids on: an expert weight of 2**31 elements or more would
overflow 32-bit ones.
"""

import triton
import triton.language as tl

from fp8graph.kernels._quantize_tiles_triton import _e4m3_bits


@triton.jit
def quantize_transposed_kernel(x_ptr, scale_ptr, x_t_ptr, x_fp8_ptr, amax_ptr, rows, columns, row_stride,
                               column_stride, batch_stride, FP8_MAX: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
                               BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, STRAIGHT: tl.constexpr,
                               TILE_AMAX: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    column = tl.program_id(1).to(tl.int64) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    inside = (row[:, None] < rows) & (column[None, :] < columns)
    x = tl.load(x_ptr + batch * batch_stride + row[:, None] * row_stride + column[None, :] * column_stride,
                mask=inside, other=0.0).to(tl.float32)
    bits = _e4m3_bits(x, tl.load(scale_ptr + batch), FP8_MAX, SOFTWARE_ROUNDING)
    # Matrix b's transpose is (columns, rows), contiguous, the matrices one after the other.
    tl.store(x_t_ptr + batch * rows * columns + column[:, None] * rows + row[None, :], tl.trans(bits),
             mask=tl.trans(inside))
    if STRAIGHT:
        tl.store(x_fp8_ptr + batch * rows * columns + row[:, None] * columns + column[None, :], bits, mask=inside)
    if TILE_AMAX:
        magnitude = tl.abs(x)
        finite = magnitude < float("inf")  # False for inf and NaN
        tile_amax = tl.max(tl.max(tl.where(finite, magnitude, 0.0), axis=1), axis=0)
        tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.store(amax_ptr + batch * tiles + tile, tile_amax)
