"""Triton kernel behind ``fp8graph::quantize_transposed`` (imported only where Triton is installed).

A tiled cast and transpose of a batch of high-precision matrices, a scale a
matrix: each program loads a BLOCK_ROWS x BLOCK_COLUMNS tile of matrix
``program_id(2)`` (vector loads along whichever dimension is contiguous),
casts it with the matrix's scale and stores the E4M3 bytes transposed, with
contiguous stores along the output's rows; Triton moves the tile through
shared memory between the two layouts. The high-precision tensor is read
once and only the FP8 transpose is written.

The cast is ``fp8graph.kernels._quantize_tiles_triton``'s, so it equals
``fp8graph.numerics.quantize.quantize`` bit for bit. Offsets are 64-bit from
the program ids on: an expert weight of 2**31 elements or more would
overflow 32-bit ones.
"""

import triton
import triton.language as tl

from fp8graph.kernels._quantize_tiles_triton import _e4m3_bits


@triton.jit
def quantize_transposed_kernel(x_ptr, scale_ptr, x_t_ptr, rows, columns, row_stride, column_stride, batch_stride,
                               FP8_MAX: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                               BLOCK_COLUMNS: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    column = tl.program_id(1).to(tl.int64) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    inside = (row[:, None] < rows) & (column[None, :] < columns)
    x = tl.load(x_ptr + batch * batch_stride + row[:, None] * row_stride + column[None, :] * column_stride,
                mask=inside, other=0.0).to(tl.float32)
    bits = _e4m3_bits(x * tl.load(scale_ptr + batch), FP8_MAX, SOFTWARE_ROUNDING)
    # Matrix b's transpose is (columns, rows), contiguous, the matrices one after the other.
    tl.store(x_t_ptr + batch * rows * columns + column[:, None] * rows + row[None, :], tl.trans(bits),
             mask=tl.trans(inside))
