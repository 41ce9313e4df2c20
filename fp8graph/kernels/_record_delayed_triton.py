"""Triton kernel behind ``fp8graph::record_delayed_`` (imported only where Triton is installed).

One program per member of a call and row it records: the rows are independent (each its own history
slice, partial amaxes and scale), and an expert weight's call records 1 + E of them, which one program
went through one after another (the H200 profiled 255 us a call of Qwen3-30B-A3B's 129 rows, 2026-11-27).
The tuples of pointers and lengths are specialized on their length: a call of m members compiles once
and runs in one launch. A tuple's element is chosen by a branch per member and row, unrolled, so an expert
call's rows (its experts' amaxes, rows of one tensor) run ``record_delayed_rows_kernel``, which reaches each
row by its offset instead. Loops over runtime lengths are ``while`` loops: Triton's
interpreter (the numerics check) cannot bound a ``range`` by an argument.
"""

import triton
import triton.language as tl


@triton.jit
def _finish_amax(row_amaxes, length, BLOCK_AMAX: tl.constexpr):
    """The max of a 1-D tensor of magnitudes as fp32; NaN if any is NaN (a max alone would drop it)."""
    running = tl.zeros([BLOCK_AMAX], dtype=tl.float32)
    nan_count = tl.zeros([BLOCK_AMAX], dtype=tl.int32)
    start = 0
    while start < length:
        offsets = start + tl.arange(0, BLOCK_AMAX)
        values = tl.load(row_amaxes + offsets, mask=offsets < length, other=0.0).to(tl.float32)
        is_nan = values != values
        nan_count += is_nan.to(tl.int32)
        running = tl.maximum(running, tl.where(is_nan, 0.0, values))
        start += BLOCK_AMAX
    new_amax = tl.max(running, axis=0)
    return tl.where(tl.sum(nan_count, axis=0) > 0, float("nan"), new_amax)


@triton.jit
def _roll_and_record(row, history_len, new_amax, BLOCK_HISTORY: tl.constexpr):
    """In place: ``row[0] = new_amax``, ``row[j] = row[j + 1]`` for 0 < j < len - 1, ``row[len - 1] = row[0]``
    (``fp8graph.numerics.delayed_scaling.roll_history`` then ``record_amax``)."""
    oldest_moved = tl.load(row)  # read before the first store overwrites it
    start = 0
    while start < history_len:
        j = start + tl.arange(0, BLOCK_HISTORY)
        shifted = tl.load(row + j + 1, mask=(j >= 1) & (j < history_len - 1), other=0.0)
        value = tl.where(j == 0, new_amax, tl.where(j == history_len - 1, oldest_moved, shifted))
        tl.debug_barrier()  # every thread has read this block before any thread writes it
        tl.store(row + j, value, mask=j < history_len)
        start += BLOCK_HISTORY


@triton.jit
def record_delayed_kernel(histories, scales, row_amaxes, row_amax_lengths, new_scales, kept_scales, history_len,
                          ROWS: tl.constexpr, KEEP: tl.constexpr, BLOCK_AMAX: tl.constexpr,
                          BLOCK_HISTORY: tl.constexpr):
    member, row = tl.program_id(0), tl.program_id(1)
    for i in tl.static_range(len(histories)):
        if member == i:
            for r in tl.static_range(ROWS):
                if row == r:
                    new_amax = _finish_amax(row_amaxes[i * ROWS + r], row_amax_lengths[i * ROWS + r], BLOCK_AMAX)
                    _roll_and_record(histories[i] + r * history_len, history_len, new_amax, BLOCK_HISTORY)
                    new_scale = tl.load(new_scales + i * ROWS + r)
                    tl.store(scales[i] + r, new_scale)
                    if KEEP and r >= 1:  # every row but the first also into the kept buffers
                        tl.store(kept_scales[i] + (r - 1), new_scale)


@triton.jit
def record_delayed_rows_kernel(history, scale, first_amaxes, first_length, row_amaxes, row_stride, row_length,
                               new_scales, kept_scale, history_len, KEEP: tl.constexpr, BLOCK_AMAX: tl.constexpr,
                               BLOCK_HISTORY: tl.constexpr):
    """One member whose rows but the first read their partial amaxes at ``row_amaxes + (row - 1) * row_stride``,
    each ``row_length`` long (an expert call's weight rows, one row of one tensor each): one program a row, with
    no branch a row (``record_delayed_kernel`` unrolls one, which for an expert call's 129 rows took 18-20 s to
    compile)."""
    row = tl.program_id(0)
    if row == 0:
        new_amax = _finish_amax(first_amaxes, first_length, BLOCK_AMAX)
    else:
        new_amax = _finish_amax(row_amaxes + (row - 1) * row_stride, row_length, BLOCK_AMAX)
    _roll_and_record(history + row * history_len, history_len, new_amax, BLOCK_HISTORY)
    new_scale = tl.load(new_scales + row)
    tl.store(scale + row, new_scale)
    if KEEP:
        if row >= 1:
            tl.store(kept_scale + (row - 1), new_scale)
