"""Run by tests/kernels/test_group_columns.py under TRITON_INTERPRET=1: the kernel of
``fp8graph::quantize_group_columns_placed`` and ``fp8graph::quantize_rows_placed`` against the ops' references (the
per-group-and-column cast, or the per-tensor one, then the padded transpose), byte for byte and scale (or amax)
for scale: groups of every size (empty, one row, ragged, a block and more), rows in no group, columns not a
multiple of the block, gathered rows, a row-strided source, values that test the amax (NaN, inf, zeros,
subnormal-range magnitudes, values that saturate), exact and power-of-2 scales."""

import torch

from fp8graph.kernels.group_columns import (_reference, _rows_reference, quantize_group_columns_placed_triton,
                                            quantize_rows_placed_triton)

from e4m3_bytes import e4m3_bytes


generator = torch.Generator().manual_seed(0)
cases = 0
for sizes, tail, columns in [([5, 0, 70, 1], 0, 96), ([16, 16], 3, 64), ([0, 0, 0], 7, 40), ([130], 0, 130),
                             ([1, 2, 3, 4, 5, 6, 7, 8, 9], 2, 17)]:
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = sum(sizes) + tail
    for dtype, gathered, strided, power_2 in [(torch.bfloat16, False, False, True), (torch.float32, False, True, False),
                                              (torch.bfloat16, True, False, False), (torch.float16, True, True, True)]:
        source_rows = max(rows // 2, 1) if gathered else rows
        x = torch.randn(source_rows, columns * (2 if strided else 1), generator=generator) * \
            torch.logspace(-12, 6, columns * (2 if strided else 1), base=2.0)
        x[0, 0], x[-1, -1] = float("nan"), float("inf")
        x[:, 1] = 0.0
        x = x.to(dtype)[:, :columns] if strided else x.to(dtype)
        index = torch.randint(0, source_rows, (rows,), generator=generator) if gathered else None
        expected_fp8, expected_scale = _reference(x, offsets, 16, power_2, index)
        got_fp8, got_scale = quantize_group_columns_placed_triton(x, offsets, 16, power_2, index)
        label = (sizes, tail, columns, dtype, gathered, strided, power_2)
        assert got_fp8.shape == expected_fp8.shape and got_scale.shape == expected_scale.shape, label
        assert torch.equal(got_scale, expected_scale), label
        assert torch.equal(e4m3_bytes(got_fp8), e4m3_bytes(expected_fp8)), label
        cases += 1
        # One scale for the tensor, a power of 2 or not; the largest values (up to about 2**8) saturate at 448.
        scale = torch.tensor(4.0 if power_2 else 2.7, dtype=torch.float32)
        expected = _rows_reference(x, scale, offsets, 16, index)
        got = quantize_rows_placed_triton(x, scale, offsets, 16, index)
        for got_part, expected_part, part in zip(got, expected, ("rows", "placed", "amax")):
            assert got_part.shape == expected_part.shape, (label, part)
            compared = (e4m3_bytes(got_part), e4m3_bytes(expected_part)) if part != "amax" else (got_part, expected_part)
            assert torch.equal(*compared), (label, part)
        cases += 1
print(f"cases checked: {cases}")
