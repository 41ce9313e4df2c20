"""A Triton kernel with the error the 2026-11-23 H100 run hit: a non-constexpr global read in the kernel.

Kept apart from the test that uses it because Triton compiles a kernel from
its source file.
"""

import triton
import triton.language as tl

_NOT_CONSTEXPR = 3.0


@triton.jit
def read_global_kernel(x_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * _NOT_CONSTEXPR)
