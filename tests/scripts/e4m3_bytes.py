"""Shared by the interpreter check scripts (imported from their folder, the first entry of a script's path)."""

import torch


def e4m3_bytes(x_fp8: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes with NaN's sign cleared: a NaN has no sign to keep (the GPU writes 0x7F), and the CPU's
    reference keeps the sign bit of a BF16 NaN's conversion."""
    bits = x_fp8.view(torch.uint8)
    return torch.where(bits & 0x7F == 0x7F, 0x7F, bits)
