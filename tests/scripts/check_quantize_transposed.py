"""Run by tests/kernels/test_quantize_transposed.py under TRITON_INTERPRET=1: the kernel of
``fp8graph::quantize_transposed`` against the op's reference (the cast, then the transpose's contiguous copy), byte
for byte, and of ``fp8graph::quantize_both_layouts`` (both layouts byte for byte, each tile's amax exactly, with
and without the amaxes, into new tensors and into given buffers): single matrices and batches, lengths not a
multiple of the tile, one row, one column, BF16, fp16 and fp32, a row-strided slice, every other matrix of a batch,
a transposed view (a weight stored the other way round), and values that test the cast (NaN, inf, zeros,
subnormal-range magnitudes, values that saturate, products that overflow fp32)."""

import torch

from fp8graph.kernels.quantize_transposed import (_both_layouts_reference, _reference, quantize_both_layouts_triton,
                                                  quantize_transposed_triton)

from e4m3_bytes import e4m3_bytes


generator = torch.Generator().manual_seed(0)
cases = 0
for shape in [(64, 64), (130, 70), (1, 17), (17, 1), (3, 64, 128), (2, 70, 33), (5, 1, 16)]:
    batch = shape[0] if len(shape) == 3 else 1
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        # Magnitudes from 2**-12 to 2**6 across the columns read (the stored rows hold them twice).
        stored = torch.randn(2 * batch, shape[-2], 2 * shape[-1], generator=generator) * \
            torch.logspace(-12, 6, shape[-1], base=2.0).repeat(2)
        stored[0, 0, 0], stored[-1, -1, -1], stored[0, -1, 0] = float("nan"), float("inf"), -float("inf")
        stored = stored.to(dtype)
        flipped = stored.transpose(-2, -1).contiguous().transpose(-2, -1)  # the same values, stored transposed
        operands = [stored[:batch, :, :shape[-1]],  # rows longer than the columns read
                    stored[::2, :, :shape[-1]],  # every other matrix
                    flipped[:batch, :, :shape[-1]]]  # a transposed view
        scale = torch.rand(batch, generator=generator) * 4 + 0.01
        scale[0] = 448.0  # saturates the largest values
        # fp32's largest (delayed scaling's after a history of tiny amaxes): finite products overflow and saturate.
        scale[1:2] = torch.finfo(torch.float32).max
        for operand in operands:
            operand = operand if len(shape) == 3 else operand[0]
            matrix_scale = scale if len(shape) == 3 else scale[0]
            expected = _reference(operand, matrix_scale)
            got = quantize_transposed_triton(operand, matrix_scale)
            label = (shape, dtype, operand.stride())
            assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous(), label
            assert torch.equal(e4m3_bytes(got), e4m3_bytes(expected)), label
            cases += 1
            tile_amax = dtype is not torch.float16  # both forms of the op, each on every shape
            expected_both = _both_layouts_reference(operand, matrix_scale, tile_amax)
            got_both = quantize_both_layouts_triton(operand, matrix_scale, tile_amax)
            for got_part, expected_part in zip(got_both[:2], expected_both[:2]):
                assert got_part.shape == expected_part.shape and got_part.is_contiguous(), label
                assert torch.equal(e4m3_bytes(got_part), e4m3_bytes(expected_part)), label
            assert torch.equal(got_both[2], expected_both[2]) and (expected_both[2].numel() > 0) == tile_amax, label
            cases += 1
            if dtype is torch.bfloat16:  # into given buffers: the kept copies' form
                buffers = (torch.empty_like(expected_both[0]), torch.empty_like(expected_both[1]))
                amax = quantize_both_layouts_triton(operand, matrix_scale, True, buffers)[2]
                assert all(torch.equal(e4m3_bytes(b), e4m3_bytes(e)) for b, e in zip(buffers, expected_both)), label
                assert torch.equal(amax, _both_layouts_reference(operand, matrix_scale, True)[2]), label
                cases += 1
print(f"cases checked: {cases}")
