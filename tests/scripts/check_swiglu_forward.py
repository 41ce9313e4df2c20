"""Run by tests/kernels/test_swiglu_forward.py under TRITON_INTERPRET=1: the kernel of
``fp8graph::swiglu_forward_placed`` against the op's reference: groups of every size (empty, one row, ragged, a
block and more), rows in no group, widths not a multiple of the block, row-strided operands, values that test the
amax and the cast (NaN, inf, zeros, products that saturate, products that overflow fp32). silu's exp is numpy's under the interpreter and
torch's in the reference: each byte within one E4M3 step of the reference's (nearly all equal), the placed layout
byte for byte the kernel's own rows laid out, the amaxes within fp32 rounding."""

import torch

from fp8graph.kernels.swiglu_forward import _reference, swiglu_forward_placed_triton

from e4m3_bytes import placed_cast_checked


generator = torch.Generator().manual_seed(0)
cases, differing, compared = 0, 0, 0
for sizes, tail, width in [([5, 0, 70, 1], 0, 96), ([16, 16], 3, 64), ([0, 0, 0], 7, 40), ([130], 0, 130),
                           ([1, 2, 3, 4, 5, 6, 7, 8, 9], 2, 17)]:
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = sum(sizes) + tail
    for dtype, strided in [(torch.bfloat16, False), (torch.float32, True), (torch.float16, False)]:
        gate_up = torch.randn(rows, 2 * width, generator=generator) * 4
        gate_up[:, width:] *= torch.logspace(-10, 6, width, base=2.0)  # up spans 2**-10 to 2**6
        if rows:
            gate_up[0, 0], gate_up[-1, -1], gate_up[0, width + 1], gate_up[-1, 0] = (
                float("nan"), float("inf"), 0.0, -float("inf"))
        gate_up = gate_up.to(dtype)
        if strided:  # the same values, each row inside a row twice as long
            gate_up = torch.cat([gate_up, torch.zeros_like(gate_up)], dim=1)[:, :2 * width]
        label = (sizes, tail, width, dtype, strided)
        # The largest products (about 4 times 4 times 2**6) saturate at 448; with fp32's largest scale (delayed
        # scaling's after a history of tiny amaxes) every finite product overflows fp32 and saturates too.
        for scale in (torch.tensor(2.7), torch.tensor(2.0 ** -3), torch.tensor(torch.finfo(torch.float32).max)):
            expected = _reference(gate_up, scale, offsets, 16)
            got = swiglu_forward_placed_triton(gate_up, scale, offsets, 16)
            differing += placed_cast_checked(got, expected, offsets, label)
            compared += got[0].numel()
            cases += 1
assert differing <= compared // 200, (differing, compared)  # nearly every byte equal
print(f"bytes one E4M3 step from the reference: {differing} of {compared}")
print(f"cases checked: {cases}")
