"""Run by tests/kernels/test_swiglu_backward.py under TRITON_INTERPRET=1: the kernel of
``fp8graph::swiglu_backward_placed`` and ``fp8graph::swiglu_backward_amax`` (and of their row-wise forms,
``swiglu_backward_rowwise`` and ``swiglu_backward_rowwise_amax``: a scale a row, a scale a group and column)
against the ops' references: groups of
every size (empty, one row, ragged, a block and more), rows in no group, widths not a multiple of the block,
row-strided operands, values that test the amax and the cast (NaN, inf, zeros, gradients that saturate); both
casts without grad_weight's layout too (the experts' weights frozen), the rows as with it. The
gradient's sigmoid is numpy's under the interpreter and torch's in the reference: each byte within one E4M3 step
of the reference's (nearly all equal), the placed layout byte for byte the kernel's own rows laid out, the amaxes
within fp32 rounding."""

import torch

from fp8graph.kernels.swiglu_backward import (_amax_reference, _placed_reference, _rowwise_amax_reference,
                                              _rowwise_reference, swiglu_backward_amax_triton,
                                              swiglu_backward_placed_triton, swiglu_backward_rowwise_amax_triton,
                                              swiglu_backward_rowwise_triton)
from fp8graph.numerics.quantize import amax_to_scale

from e4m3_bytes import bytes_one_step_apart, e4m3_bytes, placed_cast_checked


generator = torch.Generator().manual_seed(0)
cases, differing, compared = 0, 0, 0
for sizes, tail, width in [([5, 0, 70, 1], 0, 96), ([16, 16], 3, 64), ([0, 0, 0], 7, 40), ([130], 0, 130),
                           ([1, 2, 3, 4, 5, 6, 7, 8, 9], 2, 17)]:
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = sum(sizes) + tail
    for dtype, strided in [(torch.bfloat16, False), (torch.float32, True), (torch.float16, False)]:
        gate_up = torch.randn(rows, 2 * width, generator=generator) * 4
        grad_h = torch.randn(rows, width, generator=generator) * torch.logspace(-10, 6, width, base=2.0)
        if rows:
            gate_up[0, 0], grad_h[-1, -1], grad_h[0, 1] = float("nan"), float("inf"), 0.0
        gate_up, grad_h = gate_up.to(dtype), grad_h.to(dtype)
        if strided:  # the same values, each row inside a row twice as long
            gate_up = torch.cat([gate_up, torch.zeros_like(gate_up)], dim=1)[:, :2 * width]
            grad_h = torch.cat([grad_h, torch.zeros_like(grad_h)], dim=1)[:, :width]
        label = (sizes, tail, width, dtype, strided)
        expected_amax = _amax_reference(gate_up, grad_h, offsets)
        got_amax = swiglu_backward_amax_triton(gate_up, grad_h, offsets)
        assert got_amax.shape == expected_amax.shape, label
        torch.testing.assert_close(got_amax, expected_amax, rtol=1e-6, atol=0, msg=str(label))
        cases += 1
        # The largest gradients (about 2**6 times 4 times 4) saturate at 448.
        scale = torch.tensor(2.7, dtype=torch.float32)
        expected = _placed_reference(gate_up, grad_h, scale, offsets, 16)
        got = swiglu_backward_placed_triton(gate_up, grad_h, scale, offsets, 16)
        differing += placed_cast_checked(got, expected, offsets, label)
        compared += got[0].numel()
        got_rows, got_amax = got[0], got[2]
        cases += 1
        # fp32's largest scale (delayed scaling's after a history of tiny amaxes): finite products overflow fp32
        # and saturate.
        overflowing = torch.tensor(torch.finfo(torch.float32).max)
        got_overflowing = swiglu_backward_placed_triton(gate_up, grad_h, overflowing, offsets, 16)
        differing += placed_cast_checked(got_overflowing, _placed_reference(gate_up, grad_h, overflowing, offsets, 16),
                                         offsets, label)
        compared += got_overflowing[0].numel()
        cases += 1
        if dtype == torch.bfloat16:  # without the layout (the experts' weights frozen): the same rows and amaxes
            rows_alone = swiglu_backward_placed_triton(gate_up, grad_h, scale, offsets, 16, layout=False)
            assert rows_alone[1].shape == (2 * width, 0), label
            assert torch.equal(e4m3_bytes(rows_alone[0]), e4m3_bytes(got_rows)), label
            assert torch.equal(rows_alone[2], got_amax), label
            cases += 1
        # Row-wise: each row's and each group's columns' amaxes, then the casts with the scales they give (power-of-2
        # scales where the width is even: both kinds), the largest values of some rows saturating.
        expected_amaxes = _rowwise_amax_reference(gate_up, grad_h, offsets)
        got_amaxes = swiglu_backward_rowwise_amax_triton(gate_up, grad_h, offsets)
        for got_part, expected_part in zip(got_amaxes, expected_amaxes):
            assert got_part.shape == expected_part.shape, label
            torch.testing.assert_close(got_part, expected_part, rtol=1e-6, atol=0, msg=str(label))
        row_scale, column_scale = (amax_to_scale(amax, torch.float8_e4m3fn, width % 2 == 0) for amax in expected_amaxes)
        row_scale[: min(rows, 2)] *= 4.0  # saturates those rows' largest values
        expected = _rowwise_reference(gate_up, grad_h, row_scale, column_scale, offsets, 16)
        got = swiglu_backward_rowwise_triton(gate_up, grad_h, row_scale, column_scale, offsets, 16)
        for got_part, expected_part in zip(got, expected):
            assert got_part.shape == expected_part.shape, label
            differing += bytes_one_step_apart(got_part, expected_part, label)
            compared += got_part.numel()
        cases += 1
        if dtype == torch.bfloat16:  # without the layout: the same rows, nothing laid out
            rows_alone = swiglu_backward_rowwise_triton(gate_up, grad_h, row_scale, column_scale, offsets, 16,
                                                        layout=False)
            assert rows_alone[1].shape == (2 * width, 0), label
            assert torch.equal(e4m3_bytes(rows_alone[0]), e4m3_bytes(got[0])), label
            cases += 1
assert differing <= compared // 200, (differing, compared)  # nearly every byte equal
print(f"bytes one E4M3 step from the reference: {differing} of {compared}")
print(f"cases checked: {cases}")
