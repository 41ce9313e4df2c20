"""Triton kernel behind ``fp8graph::transpose_fp8`` (imported only where Triton is installed).

A tiled transpose of a row-major byte matrix: each program loads a
BLOCK_ROWS x BLOCK_COLUMNS tile with contiguous (vectorized) loads along the
rows, and stores it transposed with contiguous stores along the output's
rows; Triton moves the tile through shared memory between the two layouts.
The bytes are FP8 values viewed as ``uint8``: a transpose never looks at them.

Row offsets are 64-bit: an FP8 activation of 2**31 bytes or more (a 2 GB
tensor) would overflow 32-bit offsets; the launcher checks the rest.
"""

import triton
import triton.language as tl


@triton.jit
def transpose_bytes_kernel(x_ptr, x_t_ptr, rows, columns, row_stride,
                           BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    column = tl.program_id(1).to(tl.int64) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    inside = (row[:, None] < rows) & (column[None, :] < columns)
    tile = tl.load(x_ptr + row[:, None] * row_stride + column[None, :], mask=inside)
    # x_t is (columns, rows), contiguous: element (c, r) at c * rows + r.
    tl.store(x_t_ptr + column[:, None] * rows + row[None, :], tl.trans(tile), mask=tl.trans(inside))
