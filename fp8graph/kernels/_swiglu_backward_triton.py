"""Triton kernel behind ``fp8graph::swiglu_backward_placed``, ``fp8graph::swiglu_backward_amax``,
``fp8graph::swiglu_backward_rowwise`` and ``fp8graph::swiglu_backward_rowwise_amax`` (imported only where Triton is
installed).

One program a group of rows and a block of columns of the activation (``width`` I): it loads the block's gate,
up and grad_h once, and computes both halves of the gradient, grad_gate (columns of the gate half) and grad_up
(the same columns of the up half). With ``CAST`` it casts both with the one scale and stores each twice, as rows
(S, 2I) and at the group's place in the padded transposed layout (2I, P), pads as zeros, the groups placed as
``fp8graph.kernels._group_columns_triton`` places them (``group_bounds``); it stores each half's amax for the
group and block (what delayed scaling records). Without ``CAST`` it only reads, for current scaling's amax, and
stores those amaxes.

With ``ROWWISE`` (row-wise scaling: grad_input's GEMM reads the rows cast a scale a row, grad_weight's the layout
cast a scale a group and column) the walk without ``CAST`` stores, in place of the block amaxes, each row's amax
over the block's columns of both halves (a partial a block and row, a block's partials contiguous: a row's scale
needs its every column, which no program sees) and each column's amax over the group's rows; the walk with
``CAST`` casts the rows with the given row scales and the layout with the group's column scales.

Without ``LAYOUT`` (no grad_weight: the experts' weights frozen) the walk with ``CAST`` stores the rows alone.

The gradient is computed in fp32 from the BF16 loads and never rounded before the cast, as Inductor's fused
kernels compute it; the cast is ``fp8graph.kernels._quantize_tiles_triton``'s (E4M3 only: the grouped GEMM's).
"""

import triton
import triton.language as tl

from fp8graph.kernels._group_columns_triton import group_bounds, placed_walk, store_placed
from fp8graph.kernels._quantize_tiles_triton import _e4m3_bits, _magnitude_bits


@triton.jit
def _swiglu_backward(gate_up_ptr, grad_h_ptr, row, present, column, column_inside, gate_up_stride, grad_h_stride,
                     width):
    """``(grad_gate, grad_up)`` in fp32 at rows ``row`` and ``column`` of the activation; 0 where absent."""
    mask = present[:, None] & column_inside[None, :]
    gate_at = gate_up_ptr + row[:, None] * gate_up_stride + column[None, :]
    gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_at + width, mask=mask, other=0.0).to(tl.float32)
    grad_h = tl.load(grad_h_ptr + row[:, None] * grad_h_stride + column[None, :], mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    grad_up = grad_h * (gate * sigmoid)
    grad_gate = grad_h * up * (sigmoid * (1.0 + gate * (1.0 - sigmoid)))
    return grad_gate, grad_up


@triton.jit
def swiglu_backward_placed_kernel(
        gate_up_ptr, grad_h_ptr, offsets_ptr, scale_ptr, rows_fp8_ptr, placed_ptr, amax_ptr, column_table_ptr, rows,
        width, padded_rows, gate_up_stride, grad_h_stride, groups, MULTIPLE: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, FP8_MAX: tl.constexpr,
        SOFTWARE_ROUNDING: tl.constexpr, CAST: tl.constexpr, ROWWISE: tl.constexpr, LAYOUT: tl.constexpr):
    group = tl.program_id(0)
    block = tl.program_id(1)
    column = block.to(tl.int64) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    column_inside = column < width
    start, end, padded_start, padded_end = group_bounds(offsets_ptr, group, groups, rows, padded_rows, MULTIPLE,
                                                        BLOCK_GROUPS)
    in_block = tl.arange(0, BLOCK_ROWS).to(tl.int64)
    # The largest magnitudes so far, as fp32 bits, reduced across the block once, after the loop.
    gate_bits_max = tl.zeros([BLOCK_ROWS, BLOCK_COLUMNS], dtype=tl.int32)
    up_bits_max = tl.zeros([BLOCK_ROWS, BLOCK_COLUMNS], dtype=tl.int32)
    if CAST:
        if ROWWISE and LAYOUT:  # scale_ptr: a scale a row; column_table_ptr (E + 1, 2I): the columns' a group
            gate_scale = tl.load(column_table_ptr + group * (2 * width) + column, mask=column_inside, other=0.0)
            up_scale = tl.load(column_table_ptr + group * (2 * width) + width + column, mask=column_inside, other=0.0)
        elif not ROWWISE:
            scale = tl.load(scale_ptr)
        base, bound, steps = placed_walk(padded_start, padded_end, MULTIPLE, BLOCK_ROWS)
        step = 0
        while step < steps:  # a while loop: the interpreter takes no loaded bounds in range()
            placed = base + step * BLOCK_ROWS
            row = start + (placed - base) + in_block
            present = row < end  # else a pad: zeros
            grad_gate, grad_up = _swiglu_backward(gate_up_ptr, grad_h_ptr, row, present, column, column_inside,
                                                  gate_up_stride, grad_h_stride, width)
            if ROWWISE:  # the layout with the group's column scales; the rows below with their own
                if LAYOUT:
                    gate_bits = _e4m3_bits(grad_gate, gate_scale[None, :], FP8_MAX, SOFTWARE_ROUNDING)
                    up_bits = _e4m3_bits(grad_up, up_scale[None, :], FP8_MAX, SOFTWARE_ROUNDING)
            else:
                gate_bits = _e4m3_bits(grad_gate, scale, FP8_MAX, SOFTWARE_ROUNDING)
                up_bits = _e4m3_bits(grad_up, scale, FP8_MAX, SOFTWARE_ROUNDING)
            if LAYOUT:  # the up half's rows of the layout after the gate half's
                store_placed(placed_ptr, gate_bits, placed, bound, column, column_inside, padded_rows, BLOCK_ROWS)
                store_placed(placed_ptr, up_bits, placed, bound, column + width, column_inside, padded_rows,
                             BLOCK_ROWS)
            if ROWWISE:
                row_scale = tl.load(scale_ptr + row, mask=present, other=0.0)[:, None]
                gate_bits = _e4m3_bits(grad_gate, row_scale, FP8_MAX, SOFTWARE_ROUNDING)
                up_bits = _e4m3_bits(grad_up, row_scale, FP8_MAX, SOFTWARE_ROUNDING)
            stored = present[:, None] & column_inside[None, :]
            rows_at = rows_fp8_ptr + row[:, None] * (2 * width) + column[None, :]
            tl.store(rows_at, gate_bits, mask=stored)
            tl.store(rows_at + width, up_bits, mask=stored)
            if not ROWWISE:
                gate_bits_max = tl.maximum(gate_bits_max, _magnitude_bits(grad_gate))
                up_bits_max = tl.maximum(up_bits_max, _magnitude_bits(grad_up))
            step += 1
    else:
        first = start
        while first < end:
            row = first + in_block
            grad_gate, grad_up = _swiglu_backward(gate_up_ptr, grad_h_ptr, row, row < end, column, column_inside,
                                                  gate_up_stride, grad_h_stride, width)
            gate_magnitude, up_magnitude = _magnitude_bits(grad_gate), _magnitude_bits(grad_up)
            gate_bits_max = tl.maximum(gate_bits_max, gate_magnitude)
            up_bits_max = tl.maximum(up_bits_max, up_magnitude)
            if ROWWISE:  # each row's amax over the block's columns of both halves
                row_partial = tl.max(tl.maximum(gate_magnitude, up_magnitude), axis=1).to(tl.float32, bitcast=True)
                tl.store(amax_ptr + block.to(tl.int64) * rows + row, row_partial, mask=row < end)
            first += BLOCK_ROWS
    if ROWWISE:
        if not CAST:  # each column's amax over the group's rows, both halves, into the column table
            columns_at = column_table_ptr + group * (2 * width) + column
            tl.store(columns_at, tl.max(gate_bits_max, axis=0).to(tl.float32, bitcast=True), mask=column_inside)
            tl.store(columns_at + width, tl.max(up_bits_max, axis=0).to(tl.float32, bitcast=True), mask=column_inside)
    else:  # one amax a group and block of each half's columns: the gate half's blocks first, then the up half's
        partials = amax_ptr + group * (2 * tl.num_programs(1))
        tl.store(partials + block, tl.max(tl.max(gate_bits_max, axis=0), axis=0).to(tl.float32, bitcast=True))
        tl.store(partials + tl.num_programs(1) + block,
                 tl.max(tl.max(up_bits_max, axis=0), axis=0).to(tl.float32, bitcast=True))
