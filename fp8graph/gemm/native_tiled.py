"""Native FP8 GEMMs of the tiled recipes, with the scale layouts cuBLAS expects.

``a`` (M, K) and ``b`` (N, K) arrive quantized tile by tile along K with
fp8graph's quantization scales (``x_fp8 = x_hp * scale``); the GEMM APIs take
dequantization factors, so every scale is inverted (exact for power-of-2 and
E8M0 scales). ``b`` is passed as ``b.t()``: (K, N), column-major.

    row-wise         torch._scaled_mm, scale_a (M, 1), scale_b (1, N), fp32        SM >= 8.9
    1x128 / 128x128  F.scaled_mm BlockWise1x128 / BlockWise128x128, fp32:          SM90
                     1x128 scales (rows, ceil(K/128)) stored rows-major, strides (1, rows);
                     128x128 scales padded along K/128 to a multiple of 4, passed as
                     (L4, rows/128) with strides (1, L4); no fast accumulation
    1x32 (MX)        F.scaled_mm BlockWise1x32, E8M0 scales swizzled 32x4x4        SM100

(Layouts as ``ScaledBlas.cpp`` checks them in torch 2.11 to 2.13.) The GEMMs
write bfloat16, which torch 2.11's row-wise kernel requires; other output
dtypes are cast from it. Tests compare each against the exact emulation on
the GPUs that have it (``tests/test_gpu.py``).
"""

from __future__ import annotations

import torch

from fp8graph.gemm.layouts import column_major
from fp8graph.gemm.padding import pad_reduction_dim
from fp8graph.numerics.tiles import ScaleKind, Tiling, e8m0_bytes

__all__ = ["native_tiled_gemm", "swizzle_mx_scales"]


def swizzle_mx_scales(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """Lay (rows, K/32) E8M0 scales out as cuBLAS's 32x4x4 swizzle wants, padded to 128 x 4 blocks.

    Each 128-row by 4-column block of scales is stored as 32 rows of 16
    bytes: row ``r`` holds rows ``r, r + 32, r + 64, r + 96`` of the block,
    4 scales each.
    """
    rows, columns = scale_e8m0.shape
    padded_rows, padded_columns = -(-rows // 128) * 128, -(-columns // 4) * 4
    padded = torch.zeros((padded_rows, padded_columns), dtype=scale_e8m0.dtype, device=scale_e8m0.device)
    padded[:rows, :columns] = scale_e8m0
    blocks = padded.view(padded_rows // 128, 128, padded_columns // 4, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def native_tiled_gemm(a_fp8, a_scale, a_tiling: Tiling, b_fp8, b_scale, b_tiling: Tiling, out_dtype,
                      use_fast_accum: bool = False) -> torch.Tensor:
    """``a @ b^T`` on the GPU's FP8 tensor cores for row-wise, block or MX tiles."""
    if a_tiling.cols is None:  # row-wise
        # Rows span the whole reduction dim, which cuBLAS wants a multiple of 16:
        # zero-pad it (the weight-gradient GEMM reduces over tokens).
        a_fp8, b_fp8_t = pad_reduction_dim(a_fp8, b_fp8.t())
        output = torch._scaled_mm(
            a_fp8.contiguous(), column_major(b_fp8_t),
            scale_a=a_scale.reciprocal().reshape(-1, 1).contiguous(),
            scale_b=b_scale.reciprocal().reshape(1, -1).contiguous(),
            out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
        return output.to(out_dtype)
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    if a_tiling.scale_kind is ScaleKind.E8M0:
        output = scaled_mm(
            a_fp8.contiguous(), column_major(b_fp8.t()),
            swizzle_mx_scales(e8m0_bytes(a_scale)), ScalingType.BlockWise1x32,
            swizzle_mx_scales(e8m0_bytes(b_scale)), ScalingType.BlockWise1x32,
            swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=SwizzleType.SWIZZLE_32_4_4,
            output_dtype=torch.bfloat16)
        return output.to(out_dtype)
    recipes = {1: ScalingType.BlockWise1x128, 128: ScalingType.BlockWise128x128}
    output = scaled_mm(
        a_fp8.contiguous(), column_major(b_fp8.t()),
        _block_scale_layout(a_scale, a_tiling), recipes[a_tiling.rows],
        _block_scale_layout(b_scale, b_tiling), recipes[b_tiling.rows],
        output_dtype=torch.bfloat16, use_fast_accum=False)  # refused with block scales
    return output.to(out_dtype)


def _block_scale_layout(scale: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """Dequantization factors of (rows / tile rows, K / 128) scales, laid out as cuBLAS reads them."""
    inverse = scale.reciprocal()
    if tiling.rows == 1:
        return column_major(inverse)  # (rows, K/128), strides (1, rows)
    padded_columns = -(-inverse.shape[1] // 4) * 4
    padded = torch.nn.functional.pad(inverse, (0, padded_columns - inverse.shape[1]), value=1.0)
    return padded.contiguous().t()  # (L4, rows/128), strides (1, L4)
