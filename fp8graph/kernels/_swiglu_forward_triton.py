"""Triton kernel behind ``fp8graph::swiglu_forward_placed`` (imported only where Triton is installed).

One program a group of rows and a block of columns of the activation (``width`` I): it loads the block's gate and
up once, computes ``h = silu(gate) * up`` in fp32, casts it with the one scale and stores it twice, as rows (S, I)
and at the group's place in the padded transposed layout (I, P), pads as zeros, the groups placed as
``fp8graph.kernels._group_columns_triton`` places them (``group_bounds``); it stores h's amax for the group and
block (what delayed scaling records).

silu is spelled as Inductor writes it for the fused kernel it replaces (``x / (1 + exp(-x))``, libdevice's exp)
and h is never rounded to BF16 before the cast, as in that kernel: the FP8 bytes are that kernel's. The cast is
``fp8graph.kernels._quantize_tiles_triton``'s (E4M3 only: the grouped GEMM's).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp8graph.kernels._group_columns_triton import group_bounds, placed_walk, store_placed
from fp8graph.kernels._quantize_tiles_triton import _e4m3_bits, _magnitude_bits


@triton.jit
def _swiglu(gate_up_ptr, row, present, column, column_inside, gate_up_stride, width, LIBDEVICE_EXP: tl.constexpr):
    """``silu(gate) * up`` in fp32 at rows ``row`` and ``column`` of the activation; 0 where absent. The
    interpreter has no libdevice: its exp is numpy's there."""
    mask = present[:, None] & column_inside[None, :]
    gate_at = gate_up_ptr + row[:, None] * gate_up_stride + column[None, :]
    gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_at + width, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        exp = libdevice.exp(-gate)
    else:
        exp = tl.exp(-gate)
    return gate / (1.0 + exp) * up


@triton.jit
def swiglu_forward_placed_kernel(
        gate_up_ptr, offsets_ptr, scale_ptr, rows_fp8_ptr, placed_ptr, amax_ptr, rows, width, padded_rows,
        gate_up_stride, groups, MULTIPLE: tl.constexpr, BLOCK_GROUPS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        BLOCK_COLUMNS: tl.constexpr, FP8_MAX: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
        LIBDEVICE_EXP: tl.constexpr):
    group = tl.program_id(0)
    block = tl.program_id(1)
    column = block.to(tl.int64) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    column_inside = column < width
    start, end, padded_start, padded_end = group_bounds(offsets_ptr, group, groups, rows, padded_rows, MULTIPLE,
                                                        BLOCK_GROUPS)
    in_block = tl.arange(0, BLOCK_ROWS).to(tl.int64)
    # The largest magnitudes so far, as fp32 bits, reduced across the block once, after the loop.
    bits_max = tl.zeros([BLOCK_ROWS, BLOCK_COLUMNS], dtype=tl.int32)
    scale = tl.load(scale_ptr)
    base, bound, steps = placed_walk(padded_start, padded_end, MULTIPLE, BLOCK_ROWS)
    step = 0
    while step < steps:  # a while loop: the interpreter takes no loaded bounds in range()
        placed = base + step * BLOCK_ROWS
        row = start + (placed - base) + in_block
        present = row < end  # else a pad: zeros
        h = _swiglu(gate_up_ptr, row, present, column, column_inside, gate_up_stride, width, LIBDEVICE_EXP)
        bits = _e4m3_bits(h, scale, FP8_MAX, SOFTWARE_ROUNDING)
        store_placed(placed_ptr, bits, placed, bound, column, column_inside, padded_rows, BLOCK_ROWS)
        tl.store(rows_fp8_ptr + row[:, None] * width + column[None, :], bits,
                 mask=present[:, None] & column_inside[None, :])
        bits_max = tl.maximum(bits_max, _magnitude_bits(h))
        step += 1
    tl.store(amax_ptr + group * tl.num_programs(1) + block,
             tl.max(tl.max(bits_max, axis=0), axis=0).to(tl.float32, bitcast=True))
