"""Run by tests/kernels/test_gathered_gemv.py under TRITON_INTERPRET=1: the gathered FP8 GEMV kernel against
the plain-torch reference, up to the order of fp32 sums, at decode shapes (ragged N and K, one row, repeated
and unused experts, a (E, K, N) weight read transposed, a row-strided input, fp32 and BF16 outputs)."""

import torch

from fp8graph.kernels.gathered_gemv import gathered_gemv_triton, reference_gathered_gemv

generator = torch.Generator().manual_seed(0)
cases = 0
for rows, experts, columns, depth in [(8, 4, 96, 256), (1, 3, 40, 300), (5, 2, 33, 17), (16, 8, 64, 512)]:
    for out_dtype in (torch.float32, torch.bfloat16):
        x_fp8 = (torch.randn(rows, depth + 8, generator=generator) * 30).to(torch.float8_e4m3fn)[:, :depth]
        weight_fp8 = (torch.randn(experts, columns, depth, generator=generator) * 30).to(torch.float8_e4m3fn)
        for weight in (weight_fp8, weight_fp8.transpose(1, 2).contiguous().transpose(1, 2)):
            ids = torch.randint(0, experts - 1, (rows,), generator=generator)  # the last expert unused
            x_inverse = torch.rand(rows, generator=generator) + 0.5
            weight_inverse = torch.rand(experts, columns, generator=generator) + 0.5
            expected = reference_gathered_gemv(x_fp8, x_inverse, weight, weight_inverse, ids, torch.float32)
            got = gathered_gemv_triton(x_fp8, x_inverse, weight, weight_inverse, ids, out_dtype)
            assert got.dtype == out_dtype and got.shape == (rows, columns)
            tolerance = 1e-5 if out_dtype == torch.float32 else 8e-3
            torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max())
            cases += 1
print(f"cases checked: {cases}")
