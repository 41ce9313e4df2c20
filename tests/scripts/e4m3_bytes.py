"""Shared by the interpreter check scripts (imported from their folder, the first entry of a script's path) and
tests/test_gpu.py (as ``scripts.e4m3_bytes``)."""

import torch


def e4m3_bytes(x_fp8: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes with NaN's sign cleared: a NaN has no sign to keep (the GPU writes 0x7F), and the CPU's
    reference keeps the sign bit of a BF16 NaN's conversion."""
    bits = x_fp8.view(torch.uint8)
    return torch.where(bits & 0x7F == 0x7F, 0x7F, bits)


def bytes_one_step_apart(got_fp8: torch.Tensor, expected_fp8: torch.Tensor, label=None) -> int:
    """Asserts each E4M3 byte equal to the reference's or its neighbour of the same sign (+-0 and the smallest
    subnormals each other's); returns how many differ. For a kernel whose arithmetic before the cast may differ
    from its reference's in the last bit (a sigmoid's)."""
    got, expected = e4m3_bytes(got_fp8).to(torch.int16), e4m3_bytes(expected_fp8).to(torch.int16)
    same_sign = (got & 0x80) == (expected & 0x80)
    near = ((got - expected).abs() <= 1) & same_sign | ((got & 0x7F) + (expected & 0x7F) <= 1)
    assert bool(near.all()), (label, got[~near][:8], expected[~near][:8])
    return int((got != expected).sum())


def placed_cast_checked(got, expected, offsets, label) -> int:
    """A kernel's ``(rows_fp8, placed, amax)`` against its reference's: each part's shape; the rows each byte
    within one E4M3 step (:func:`bytes_one_step_apart`); the placed layout byte for byte the kernel's own rows laid
    out (``fp8graph.kernels.group_columns.layout_reference``, groups padded to 16 rows); the amaxes within fp32
    rounding. Returns the rows' bytes that differ."""
    from fp8graph.kernels.group_columns import layout_reference

    for got_part, expected_part, part in zip(got, expected, ("rows", "placed", "amax")):
        assert got_part.shape == expected_part.shape, (label, part)
    got_rows, got_placed, got_amax = got
    assert torch.equal(e4m3_bytes(got_placed), e4m3_bytes(layout_reference(got_rows, offsets, 16))), label
    torch.testing.assert_close(got_amax, expected[2], rtol=1e-6, atol=0, msg=str(label))
    return bytes_one_step_apart(got_rows, expected[0], label)
