"""Padding an FP8 GEMM's reduction dimension to what cuBLAS accepts.

Shared by the per-tensor GEMMs (``fp8graph.gemm.scaled_gemm``) and the tiled ones
(``fp8graph.gemm.native_tiled``).
"""

from __future__ import annotations

import torch

from fp8graph.recipes.scaling import FP8_GEMM_DIM_MULTIPLE

__all__ = ["pad_reduction_dim"]


def pad_reduction_dim(a_fp8: torch.Tensor, b_fp8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the shared K of ``a`` (M, K) and ``b`` (K, N) to a multiple of 16.

    cuBLAS FP8 GEMMs need K and N to be multiples of 16. Site eligibility
    checks the layer's K and N, but the weight-gradient GEMM reduces over the
    token dimension M, which is free. Zeros add nothing to the products, so
    the padded GEMM is exact. The pad goes through a uint8 view (zero bits are
    +0.0 in both FP8 formats) because padding is not defined for FP8 dtypes.
    A symbolic K (dynamic shapes) is always padded, by a possibly zero amount,
    rather than guarded on.
    """
    k = a_fp8.shape[1]
    if isinstance(k, int) and k % FP8_GEMM_DIM_MULTIPLE == 0:
        return a_fp8, b_fp8
    pad = (-k) % FP8_GEMM_DIM_MULTIPLE
    a_padded = torch.nn.functional.pad(a_fp8.view(torch.uint8), (0, pad)).view(a_fp8.dtype)
    b_padded = torch.nn.functional.pad(b_fp8.view(torch.uint8), (0, 0, 0, pad)).view(b_fp8.dtype)
    return a_padded, b_padded
