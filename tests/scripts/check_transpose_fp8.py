"""Run by tests/kernels/test_transpose_fp8.py under TRITON_INTERPRET=1: the FP8 transpose kernel against
``x.t().contiguous()``, byte for byte, at the shapes a linear gives it (ragged and exact tiles, one row,
one column, a row-strided slice), and with source rows: each output column a gathered input row or zeros, as
a grouped GEMM's padded groups are laid out; a batch of matrices (experts' weights), into a new tensor and into a
given one, whose bytes around the written range stay as they were."""

import torch

from fp8graph.kernels.transpose_fp8 import plan_transpose_fp8, transpose_fp8_triton

generator = torch.Generator().manual_seed(0)
cases = 0
for rows, columns in [(64, 64), (200, 384), (130, 70), (1, 17), (17, 1), (3, 129)]:
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x_fp8 = torch.randint(0, 256, (rows, columns), dtype=torch.uint8, generator=generator).view(dtype)
        for operand in (x_fp8, x_fp8[:, : max(1, columns // 2)]):  # contiguous, and rows with a longer stride
            expected = operand.t().contiguous().view(torch.uint8)
            got = transpose_fp8_triton(operand)
            assert got.dtype == dtype and got.shape == expected.shape and got.is_contiguous(), (rows, columns)
            assert torch.equal(got.view(torch.uint8), expected), (rows, columns, dtype)
            cases += 1
# Gathered: more output columns than input rows (pads: -1), rows out of order, one row twice.
for rows, columns, padded in [(11, 64, 48), (200, 384, 240), (3, 70, 17)]:
    x_fp8 = torch.randint(0, 256, (rows, columns), dtype=torch.uint8, generator=generator).view(torch.float8_e4m3fn)
    sources = torch.randint(-1, rows, (padded,), generator=generator)
    sources[:2] = torch.tensor([rows - 1, rows - 1])
    expected = torch.where(sources[:, None] >= 0, x_fp8.view(torch.uint8)[sources.clamp(min=0)], 0).t().contiguous()
    got = transpose_fp8_triton(x_fp8, sources)
    assert got.shape == (columns, padded) and got.is_contiguous(), (rows, columns, padded)
    assert torch.equal(got.view(torch.uint8), expected.to(torch.uint8)), (rows, columns, padded)
    cases += 1
# A batch (E, R, C), contiguous and a view of every other expert (a batch stride of its own), into a new tensor and
# into a slice of a larger buffer: only the slice is written.
for experts, rows, columns in [(3, 64, 128), (2, 70, 33), (5, 1, 16)]:
    x_fp8 = torch.randint(0, 256, (2 * experts, rows, columns), dtype=torch.uint8, generator=generator)
    wider = torch.randint(0, 256, (experts, rows, columns + 16), dtype=torch.uint8, generator=generator)
    # contiguous, every other expert (a batch stride of its own), rows longer than the columns read, and the
    # transposed view of a contiguous batch (copied as it lies)
    stored_transposed = torch.randint(0, 256, (experts, columns, rows), dtype=torch.uint8, generator=generator)
    for operand in (x_fp8[:experts], x_fp8[::2], wider[..., :columns], stored_transposed.transpose(-2, -1)):
        expected = operand.transpose(-2, -1).contiguous()
        got = transpose_fp8_triton(operand.view(torch.float8_e4m3fn))
        assert torch.equal(got.view(torch.uint8), expected), (experts, rows, columns)
        buffer = torch.full((experts + 2, columns, rows), 7, dtype=torch.uint8)
        transpose_fp8_triton(operand.view(torch.float8_e4m3fn), None, buffer[1:-1].view(torch.float8_e4m3fn))
        assert torch.equal(buffer[1:-1], expected), (experts, rows, columns)
        assert torch.all(buffer[0] == 7) and torch.all(buffer[-1] == 7), (experts, rows, columns)
        cases += 1
print(f"cases checked: {cases}")
