"""Run by tests/kernels/test_group_columns.py under TRITON_INTERPRET=1: the kernel of
``fp8graph::quantize_group_columns_placed``, ``fp8graph::quantize_rows_placed``,
``fp8graph::quantize_weighted_rows_placed``, ``fp8graph::quantize_weighted_rows_rowwise`` and
``fp8graph::quantize_expert_columns`` against the ops' references (the per-group-and-column cast, or the per-tensor
one of the rows or of the weighted rows, then the padded transpose; the weighted rows cast per row and per group and
column; an expert weight's cast along N, transposed), byte for byte and scale (or amax) for scale, the weighted
ops' dot products to fp32's summation order: groups of every size (empty, one row, ragged, a block and more), rows
in no group, columns not a multiple of the block, gathered rows, row-strided operands, values that test the amax
(NaN, inf, zeros, subnormal-range magnitudes, values that saturate), exact and power-of-2 scales, weights of every
sign and zero."""

import torch

from fp8graph.kernels.group_columns import (_expert_reference, _reference, _rows_reference, _weighted_reference,
                                            _weighted_rowwise_reference, quantize_expert_columns_triton,
                                            quantize_group_columns_placed_triton, quantize_rows_placed_triton,
                                            quantize_weighted_rows_placed_triton,
                                            quantize_weighted_rows_rowwise_triton)

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
        # One scale for the tensor, a power of 2 or not; the largest values (up to about 2**8) saturate at 448. With
        # fp32's largest (delayed scaling's after a history of tiny amaxes) finite products overflow and saturate.
        tensor_scales = [4.0 if power_2 else 2.7] + ([torch.finfo(torch.float32).max] if not power_2 else [])
        for scale in (torch.tensor(value, dtype=torch.float32) for value in tensor_scales):
            expected = _rows_reference(x, scale, offsets, 16, index)
            got = quantize_rows_placed_triton(x, scale, offsets, 16, index)
            for got_part, expected_part, part in zip(got, expected, ("rows", "placed", "amax")):
                assert got_part.shape == expected_part.shape, (label, part)
                compared = ((e4m3_bytes(got_part), e4m3_bytes(expected_part)) if part != "amax"
                            else (got_part, expected_part))
                assert torch.equal(*compared), (label, part)
            cases += 1
        # Each row weighted (a zero, a negative, one that saturates the row's largest values); the dots with other
        # rows, where x's NaN and inf reach only the dots of the rows gathered from theirs.
        row_weights = torch.rand(rows, generator=generator).to(dtype)
        row_weights[: min(rows, 3)] = torch.tensor([0.0, -1.5, 3.0], dtype=dtype)[: min(rows, 3)]
        other = torch.randn(rows, columns * (2 if strided else 1), generator=generator).to(dtype)[:, :columns]
        expected = _weighted_reference(x, row_weights, other, scale, offsets, 16, index)
        got = quantize_weighted_rows_placed_triton(x, row_weights, other, scale, offsets, 16, index)
        # Without other rows: the same cast, and no dots; gathered, without the layout too (the experts' weights
        # frozen): the same rows and amaxes, nothing laid out.
        for layout in (True, False) if gathered else (True,):
            without = quantize_weighted_rows_placed_triton(x, row_weights, None, scale, offsets, 16, index,
                                                           layout=layout)
            assert all(torch.equal(e4m3_bytes(without[i]) if without[i].dtype == torch.float8_e4m3fn else without[i],
                                   e4m3_bytes(got[i]) if got[i].dtype == torch.float8_e4m3fn else got[i])
                       for i in ((0, 1, 2) if layout else (0, 2))), label
            assert without[3].numel() == 0, label
            assert layout != (without[1].shape == (columns, 0)), label

        def same_parts(got, expected, parts):
            for got_part, expected_part, part in zip(got, expected, parts):
                assert got_part.shape == expected_part.shape, (label, part)
                if part == "dots":  # summed in another order: within fp32's rounding of the products' magnitudes
                    gathered = (x if index is None else x[index]).float()
                    bound = 1e-6 * (gathered * other.float()).abs().nan_to_num(0.0, 0.0, 0.0).sum(1)
                    finite = expected_part.isfinite()
                    assert torch.equal(finite, got_part.isfinite()), (label, part)
                    assert ((got_part - expected_part)[finite].abs() <= bound[finite]).all(), (label, part)
                else:
                    compared = ((e4m3_bytes(got_part), e4m3_bytes(expected_part))
                                if got_part.dtype == torch.float8_e4m3fn else (got_part, expected_part))
                    assert torch.equal(*compared), (label, part)

        same_parts(got, expected, ("rows", "placed", "amax", "dots"))
        cases += 1
        # Row-wise: each row with its own scale (zero, one, a power of 2, one that saturates the row's largest
        # values), the layout per group and column of the weighted rows.
        row_scale = torch.rand(rows, generator=generator) * 8.0
        row_scale[: min(rows, 3)] = torch.tensor([0.0, 1.0, 256.0])[: min(rows, 3)]
        expected = _weighted_rowwise_reference(x, row_weights, other, row_scale, offsets, 16, power_2, index)
        got = quantize_weighted_rows_rowwise_triton(x, row_weights, other, row_scale, offsets, 16, power_2, index)
        same_parts(got, expected, ("rows", "placed", "scale", "dots"))
        for layout in (True, False) if gathered else (True,):
            without = quantize_weighted_rows_rowwise_triton(x, row_weights, None, row_scale, offsets, 16, power_2,
                                                            index, layout=layout)
            same_parts(without[:3], expected[:3] if layout else
                       _weighted_rowwise_reference(x, row_weights, None, row_scale, offsets, 16, power_2, index, False),
                       ("rows", "placed", "scale"))
            assert without[3].numel() == 0, label
            assert layout != (without[1].shape == (columns, 0) and without[2].shape == (len(sizes), 0)), label
        cases += 1
# No routed row at all (a rank that got no tokens), without the layout: no row to store, and every group's amaxes
# written as zeros (delayed scaling records them).
empty = quantize_weighted_rows_placed_triton(torch.randn(5, 70), torch.empty(0), None, torch.tensor(2.0),
                                             torch.zeros(3, dtype=torch.int32), 16, torch.empty(0, dtype=torch.int64),
                                             layout=False)
assert empty[0].shape == (0, 70) and empty[1].shape == (70, 0) and torch.equal(empty[2], torch.zeros(4, 2))
cases += 1
# fp8graph::quantize_expert_columns: expert weights (E, N, K) cast along N and stored (E, K, N); N a multiple of 16,
# of 2 only, odd; K not a multiple of the block; a (E, N, K) view of rows strided apart.
for experts, rows, columns in [(3, 48, 40), (2, 24, 130), (4, 7, 17), (1, 200, 64)]:
    for dtype, strided, power_2 in [(torch.bfloat16, False, False), (torch.float32, True, True),
                                    (torch.float16, False, True)]:
        weight = torch.randn(experts, rows, columns * (2 if strided else 1), generator=generator) * \
            torch.logspace(-12, 6, columns * (2 if strided else 1), base=2.0)
        weight[0, 0, 0], weight[-1, -1, -1] = float("nan"), float("inf")
        weight[:, :, 1] = 0.0
        weight = weight.to(dtype)[:, :, :columns] if strided else weight.to(dtype)
        expected_fp8, expected_scale = _expert_reference(weight, power_2)
        got_fp8, got_scale = quantize_expert_columns_triton(weight, power_2)
        label = (experts, rows, columns, dtype, strided, power_2)
        assert got_fp8.shape == expected_fp8.shape == (experts, columns, rows) and got_fp8.is_contiguous(), label
        assert torch.equal(got_scale, expected_scale), label
        assert torch.equal(e4m3_bytes(got_fp8), e4m3_bytes(expected_fp8)), label
        # Written into given buffers (a kept copy's), the same bytes and scales.
        into = (torch.empty_like(expected_fp8), torch.empty_like(expected_scale))
        quantize_expert_columns_triton(weight, power_2, into)
        assert torch.equal(into[1], expected_scale) and torch.equal(e4m3_bytes(into[0]), e4m3_bytes(expected_fp8)), label
        cases += 1
print(f"cases checked: {cases}")
