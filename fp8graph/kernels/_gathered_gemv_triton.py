"""Triton kernel behind ``fp8graph::gathered_gemv`` (imported only where Triton is installed).

One program per token row ``s`` and block of BLOCK_N output columns: it reads expert ``ids[s]``'s FP8
weight rows where they lie (no gathered copy), the row's FP8 input, and sums their products along K in
fp32, then applies both dequantization factors. A decode step is bound by the weight bytes it reads:
this reads each selected expert's weight once per token that selects it, 1 byte an element.

The FP8 operands arrive as ``uint8`` views and are bitcast to E4M3 here (FP8 pointers are not in every
Triton version's launcher); expert and weight-row offsets are 64-bit, since E N K bytes of expert weights
pass 2**31 in real models (Qwen3-30B-A3B: 128 x 1536 x 2048). K is a compile-time constant: a model has
two (its hidden size and its expert width), and the loop over it unrolls.
"""

import triton
import triton.language as tl


@triton.jit
def gathered_gemv_kernel(x_ptr, x_inverse_ptr, weight_ptr, weight_inverse_ptr, ids_ptr, output_ptr,
                         N, x_row_stride, weight_expert_stride, weight_row_stride, weight_inverse_expert_stride,
                         output_row_stride, K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_inside = column < N
    expert = tl.load(ids_ptr + row).to(tl.int64)
    weight_rows = weight_ptr + expert * weight_expert_stride + column.to(tl.int64)[:, None] * weight_row_stride
    products = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_inside = k < K
        x = tl.load(x_ptr + row * x_row_stride + k, mask=k_inside, other=0)
        w = tl.load(weight_rows + k[None, :], mask=column_inside[:, None] & k_inside[None, :], other=0)
        # Products of two E4M3 values are exact in fp32; only the sum's order differs from the emulation's.
        products += (w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                     * x.to(tl.float8e4nv, bitcast=True).to(tl.float32)[None, :])
    total = tl.sum(products, axis=1)
    x_inverse = tl.load(x_inverse_ptr + row)
    weight_inverse = tl.load(weight_inverse_ptr + expert * weight_inverse_expert_stride + column,
                             mask=column_inside, other=0.0)
    output = total * x_inverse * weight_inverse
    tl.store(output_ptr + row * output_row_stride + column, output.to(output_ptr.dtype.element_ty),
             mask=column_inside)
