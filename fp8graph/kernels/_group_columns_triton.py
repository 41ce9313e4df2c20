"""Triton kernel behind ``fp8graph::quantize_group_columns_placed``, ``fp8graph::quantize_rows_placed``,
``fp8graph::quantize_weighted_rows_placed`` and ``fp8graph::quantize_weighted_rows_rowwise`` (imported only where
Triton is installed).

One program a group of rows and a block of columns. Scaled per group and column
(``TENSOR_SCALE`` off) it walks the group's rows twice, for each column's amax
(an integer max over the magnitudes' fp32 bits, NaN and inf as 0, as
``fp8graph.numerics.quantize.finite_magnitude``) and for the cast, whose bytes
it stores transposed, at the group's place in the padded layout, with the
group's pad rows as zeros. The second walk reads from L2 where the group's
slice still is. Nothing else is read or written: no table of amaxes in memory,
no FP8 copy to transpose afterwards.

Scaled per tensor (``TENSOR_SCALE``: the scale is known before the kernel runs)
it walks the rows once: each block is cast, stored as rows (the forward GEMM's
layout) and transposed (the weight-gradient GEMM's), and its magnitudes kept
for the amax of the group's block of columns, which it stores (what delayed
scaling records), so the rows are read once for both layouts. With
``ROW_WEIGHTS`` each row is multiplied by its weight before the cast, and with
``DOTS`` its dot product with the same row of a second tensor (``other``) over
the block's columns is stored, a partial a block and row (a block's partials
contiguous): the backward of an expert
combine, ``out = sum_k weights * y``, whose gradient ``g`` gives ``y``'s as
``g * weights`` and the weights' as ``g . y`` (``quantize_weighted_rows_placed``).
Scaled per group and column with ``ROW_WEIGHTS`` the amax walk weighs the rows
too, and with ``ROW_SCALES`` the cast walk also stores the rows where they lie,
each cast with its own scale (given: a row's scale needs its every column, which
no program sees): row-wise scaling's two casts of that gradient, one for each of
its GEMMs, from the same two walks (``quantize_weighted_rows_rowwise``).

With ``EXPERT_MAJOR`` (every group the same size, a multiple of ``MULTIPLE``: an expert weight (E, N, K) as E
groups of N rows) the bytes are stored (E, K, N), each group's transpose a block of its own: the layout grad_input's
GEMM reads a row-wise weight cast along N in (``quantize_expert_columns``).

Without ``LAYOUT`` (no grad_weight GEMM reads it: the experts' weights frozen) nothing is laid out: the rows alone
are stored, per tensor or with ``ROW_SCALES`` (whose amax walk, for the layout's scales, is then skipped too).

Where each group lies is derived in the program from ``offsets`` alone: its
padded start is the sum of the padded sizes of the groups before it (E <= BLOCK_GROUPS
values, loaded at once). Program ``E`` (one past the last group) takes the rows in
no group, after ``offsets[-1]``: cast with their own amax and laid out after the
padded groups, as the reference (``fp8graph.numerics.groups``) lays them out.

Scale and cast are ``fp8graph.kernels._quantize_tiles_triton``'s, so they equal
``amax_to_scale`` and ``quantize`` bit for bit (E4M3: the only format a grouped
GEMM takes). Addresses are 64-bit: an expert operand of 2**31 bytes is 16 GB
of FP8 in the transposed layout at most, but its BF16 source reaches 2**31
bytes first.
"""

import triton
import triton.language as tl

from fp8graph.kernels._quantize_tiles_triton import _e4m3_bits, _magnitude_bits, _scale_of


@triton.jit
def group_bounds(offsets_ptr, group, groups, rows, padded_rows, MULTIPLE: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """``(start, end, padded_start, padded_end)`` of ``group``'s rows, and of its place in the padded layout: the
    padded start sums the padded sizes of the groups before it. Group ``groups`` is the rows in no group, after
    ``offsets[-1]``, placed after the padded groups."""
    ids = tl.arange(0, BLOCK_GROUPS)
    ends = tl.load(offsets_ptr + ids, mask=ids < groups, other=0).to(tl.int64)
    starts = tl.load(offsets_ptr + ids - 1, mask=(ids > 0) & (ids < groups), other=0).to(tl.int64)
    padded_sizes = (ends - starts + MULTIPLE - 1) // MULTIPLE * MULTIPLE
    padded_start = tl.sum(tl.where(ids < group, padded_sizes, 0), axis=0)
    start = tl.sum(tl.where(ids == group - 1, ends, 0), axis=0)  # offsets[group - 1], 0 for the first
    last = group == groups
    end = tl.where(last, rows, tl.sum(tl.where(ids == group, ends, 0), axis=0))
    padded_end = tl.where(last, padded_rows, padded_start + tl.sum(tl.where(ids == group, padded_sizes, 0), axis=0))
    return start, end, padded_start, padded_end


@triton.jit
def placed_walk(padded_start, padded_end, MULTIPLE: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """``(base, bound, steps)``: a group's place in the padded layout, ``padded_start`` and ``padded_end``
    written so that the compiler knows them multiples of MULTIPLE (the transposed stores are then 16-byte
    vectors; a hint on the loaded values did not reach the stores), and the blocks of BLOCK_ROWS rows that walk
    it, pads included."""
    base = padded_start // MULTIPLE * MULTIPLE
    bound = padded_end // MULTIPLE * MULTIPLE
    return base, bound, (bound - base + BLOCK_ROWS - 1) // BLOCK_ROWS


@triton.jit
def store_placed(placed_ptr, bits, placed, bound, column, column_inside, padded_rows, BLOCK_ROWS: tl.constexpr):
    """A block of cast rows ``bits`` (BLOCK_ROWS, columns), the block at ``placed`` of the walk
    (:func:`placed_walk`), stored transposed into the layout (C, ``padded_rows``). 64-bit offsets (``column`` is
    int64): C x ``padded_rows`` passes 2**31 bytes at a million rows of a 2048-wide expert."""
    position = placed + tl.arange(0, BLOCK_ROWS)
    inside = tl.trans((position < bound)[:, None] & column_inside[None, :])
    tl.store(placed_ptr + column[:, None] * padded_rows + position[None, :], tl.trans(bits), mask=inside)


@triton.jit
def _load_rows(x_ptr, gather_ptr, row, present, column, column_inside, row_stride, GATHER: tl.constexpr):
    """Rows ``row`` of x (of ``x[gather[row]]`` with GATHER) at ``column``, in fp32; 0 where absent."""
    if GATHER:
        source = tl.load(gather_ptr + row, mask=present, other=0).to(tl.int64)
    else:
        source = row
    return tl.load(x_ptr + source[:, None] * row_stride + column[None, :],
                   mask=present[:, None] & column_inside[None, :], other=0.0).to(tl.float32)


@triton.jit
def quantize_group_columns_placed_kernel(
        x_ptr, gather_ptr, offsets_ptr, x_t_fp8_ptr, scale_ptr, x_fp8_ptr, amax_ptr, weights_ptr, other_ptr, dots_ptr,
        row_scales_ptr, rows, columns, padded_rows, row_stride, other_stride, groups, GATHER: tl.constexpr,
        MULTIPLE: tl.constexpr, BLOCK_GROUPS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr,
        SCALE_KIND: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MAX_EXPONENT: tl.constexpr,
        SOFTWARE_ROUNDING: tl.constexpr, TENSOR_SCALE: tl.constexpr, ROW_WEIGHTS: tl.constexpr, DOTS: tl.constexpr,
        EXPERT_MAJOR: tl.constexpr, ROW_SCALES: tl.constexpr, LAYOUT: tl.constexpr):
    group = tl.program_id(0)
    column = tl.program_id(1).to(tl.int64) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    column_inside = column < columns
    start, end, padded_start, padded_end = group_bounds(offsets_ptr, group, groups, rows, padded_rows, MULTIPLE,
                                                        BLOCK_GROUPS)

    in_block = tl.arange(0, BLOCK_ROWS).to(tl.int64)
    max_bits = tl.zeros([BLOCK_ROWS, BLOCK_COLUMNS], dtype=tl.int32)
    if TENSOR_SCALE:
        scale = tl.load(scale_ptr)
        column_scale = tl.full([BLOCK_COLUMNS], 1.0, tl.float32) * scale
    elif LAYOUT:
        # While loops: the bounds are loaded values, which Triton's interpreter cannot take as range()'s.
        first = start
        while first < end:
            row = first + in_block
            x = _load_rows(x_ptr, gather_ptr, row, row < end, column, column_inside, row_stride, GATHER)
            if ROW_WEIGHTS:  # the amaxes of the rows as they are cast: weighted
                x = x * tl.load(weights_ptr + row, mask=row < end, other=0.0).to(tl.float32)[:, None]
            max_bits = tl.maximum(max_bits, _magnitude_bits(x))
            first += BLOCK_ROWS
        amax = tl.max(max_bits, axis=0).to(tl.float32, bitcast=True)
        column_scale = _scale_of(amax, SCALE_KIND, FP8_MAX, FP8_MAX_EXPONENT)
        tl.store(scale_ptr + group * columns + column, column_scale, mask=column_inside & (group < groups))

    base, bound, steps = placed_walk(padded_start, padded_end, MULTIPLE, BLOCK_ROWS)
    step = 0
    while step < steps:
        placed = base + step * BLOCK_ROWS
        row = start + (placed - base) + in_block
        present = row < end  # else a pad: zeros
        x = _load_rows(x_ptr, gather_ptr, row, present, column, column_inside, row_stride, GATHER)
        if DOTS:  # the dot with other's row, before the weight
            other = tl.load(other_ptr + row[:, None] * other_stride + column[None, :],
                            mask=present[:, None] & column_inside[None, :], other=0.0).to(tl.float32)
            tl.store(dots_ptr + tl.program_id(1).to(tl.int64) * rows + row, tl.sum(x * other, axis=1), mask=present)
        if ROW_WEIGHTS:  # the row cast weighted
            x = x * tl.load(weights_ptr + row, mask=present, other=0.0).to(tl.float32)[:, None]
        if TENSOR_SCALE or LAYOUT:
            bits = _e4m3_bits(x, column_scale[None, :], FP8_MAX, SOFTWARE_ROUNDING)
        if LAYOUT:
            if EXPERT_MAJOR:  # (E, C, N): each group's rows a block of their own, a column's bytes contiguous
                position = placed + tl.arange(0, BLOCK_ROWS)
                inside = (position < bound)[:, None] & column_inside[None, :]
                placed_at = (x_t_fp8_ptr + base * columns + column[:, None] * (bound - base)
                             + (position - base)[None, :])
                tl.store(placed_at, tl.trans(bits), mask=tl.trans(inside))
            else:
                store_placed(x_t_fp8_ptr, bits, placed, bound, column, column_inside, padded_rows, BLOCK_ROWS)
        if TENSOR_SCALE:  # the rows where they lie, and their magnitudes (a pad's zeros change no amax)
            max_bits = tl.maximum(max_bits, _magnitude_bits(x))
            tl.store(x_fp8_ptr + row[:, None] * columns + column[None, :], bits,
                     mask=present[:, None] & column_inside[None, :])
        if ROW_SCALES:  # the rows where they lie, cast with their own scales
            row_scale = tl.load(row_scales_ptr + row, mask=present, other=0.0)
            tl.store(x_fp8_ptr + row[:, None] * columns + column[None, :],
                     _e4m3_bits(x, row_scale[:, None], FP8_MAX, SOFTWARE_ROUNDING),
                     mask=present[:, None] & column_inside[None, :])
        step += 1
    if TENSOR_SCALE:  # one amax a group and block of columns: a short partial for the record to finish
        amax = tl.max(tl.max(max_bits, axis=0), axis=0).to(tl.float32, bitcast=True)
        tl.store(amax_ptr + group * tl.num_programs(1) + tl.program_id(1), amax)
