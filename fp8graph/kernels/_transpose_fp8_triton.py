"""Triton kernel behind ``fp8graph::transpose_fp8`` (imported only where Triton is installed).

A tiled transpose of a row-major byte matrix: each program loads a
BLOCK_ROWS x BLOCK_COLUMNS tile with contiguous (vectorized) loads along the
rows, and stores it transposed with contiguous stores along the output's
rows; Triton moves the tile through shared memory between the two layouts.
The bytes are FP8 values viewed as ``uint8``: a transpose never looks at them.

With GATHER, output column ``r`` is input row ``source_rows[r]``, or zeros
where that is negative: the rows of a tile are read from wherever they lie
(each still one contiguous run), so a grouped GEMM's zero-padded groups are
laid out by the same single pass as a plain transpose.

The grid's third axis takes a batch of matrices (experts' weights, (E, R, C)),
``batch_stride`` apart in the input; each transpose is stored contiguous, one
after the other, or at ``x_t_ptr`` given (the buffer it is written into).

Row offsets are 64-bit: an FP8 activation of 2**31 bytes or more (a 2 GB
tensor) would overflow 32-bit offsets; the launcher checks the rest.
"""

import triton
import triton.language as tl


@triton.jit
def transpose_bytes_kernel(x_ptr, x_t_ptr, source_rows_ptr, rows, columns, row_stride, batch_stride,
                           GATHER: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)
    x_ptr += batch * batch_stride
    x_t_ptr += batch * rows * columns
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    column = tl.program_id(1).to(tl.int64) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    inside = (row[:, None] < rows) & (column[None, :] < columns)
    if GATHER:
        source = tl.load(source_rows_ptr + row, mask=row < rows, other=-1).to(tl.int64)
        tile = tl.load(x_ptr + source[:, None] * row_stride + column[None, :], mask=inside & (source[:, None] >= 0),
                       other=0)
    else:
        tile = tl.load(x_ptr + row[:, None] * row_stride + column[None, :], mask=inside)
    # x_t is (columns, rows), contiguous: element (c, r) at c * rows + r.
    tl.store(x_t_ptr + column[:, None] * rows + row[None, :], tl.trans(tile), mask=tl.trans(inside))
