"""How a scaled FP8 grouped GEMM (a mixture-of-experts' expert GEMMs) is executed.

Two forms, as ``torch._grouped_mm`` has them, with ``offsets`` (E,) ending each group of rows:

    rows     (S, K) x (E, K, N) -> (S, N)      rows of group e times expert e's matrix: forward, grad_input
    weights  (N, S) x (S, K)    -> (E, N, K)   each group's tokens reduced: grad_weight

Scales are dequantization factors ``1 / scale``, per row of the left operand and per expert and
column of the right one (the form ``torch._scaled_grouped_mm`` takes on SM 9.0: row-wise scales
``(S,)`` and ``(E, N)``; in the weights form ``(E, N)`` and ``(E, K)``, per group). A per-tensor
scale is the same, expanded.

Lowerings (``fp8graph.gemm.scaled_gemm.Lowering``):

- ``scaled_mm``: ``torch._scaled_grouped_mm``. E4M3 operands, A row-major, B column-major, K and N
  multiples of 16, BF16 out. In the weights form K is a group's token count, which the routing
  decides: both operands are laid out with every group zero-padded to a multiple of 16 tokens, each by one
  tiled transpose that gathers the groups' rows (``fp8graph::transpose_fp8`` of ``padded_group_sources``),
  or, where each group and column has a scale of its own (row-wise), by the kernel that casts them
  (``fp8graph::quantize_group_columns_placed``).
- ``emulated``: ``fp8graph::grouped_mm_exact`` widens the FP8 operands to fp32 and multiplies each
  group (products of FP8 values are exact in fp32, so this equals the FP8 GEMM up to the order of
  accumulation); the scales are applied to the fp32 product in plain torch ops. An op of its own
  because ``torch._grouped_mm`` traces in BF16 only and its CPU kernel rounds its output to the
  input dtype.
"""

from __future__ import annotations

import torch

from fp8graph.gemm.layouts import column_major, row_major
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.kernels import group_columns  # noqa: F401  (registers fp8graph::quantize_group_columns_placed)
from fp8graph.kernels.transpose_fp8 import transpose_fp8
from fp8graph.numerics.groups import padded_group_offsets, padded_group_sources, quantize_group_columns, row_groups
from fp8graph.recipes.scaling import FP8_GEMM_DIM_MULTIPLE

__all__ = ["group_columns_for_grad_weight", "grouped_mm_exact", "grouped_scaled_gemm", "grouped_scaled_gemm_weights",
           "placed_for_grad_weight"]


@torch.library.custom_op("fp8graph::grouped_mm_exact", mutates_args=())
def grouped_mm_exact(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each group's product in fp32: ``(S, K) x (E, K, N) -> (S, N)`` or ``(N, S) x (S, K) -> (E, N, K)``.

    Rows (columns of ``a`` in the weights form) past ``offsets[-1]`` are in no group: zero output rows
    in the first form, left out in the second. An empty group gives zeros.
    """
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        output = torch.zeros((a.shape[0], b.shape[2]), dtype=torch.float32, device=a.device)
        for expert, (start, end) in enumerate(zip(starts, ends)):
            if end > start:
                output[start:end] = a[start:end].to(torch.float32) @ b[expert].to(torch.float32)
        return output
    output = torch.zeros((len(ends), a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    for expert, (start, end) in enumerate(zip(starts, ends)):
        if end > start:
            output[expert] = a[:, start:end].to(torch.float32) @ b[start:end].to(torch.float32)
    return output


@grouped_mm_exact.register_fake
def _(a, b, offsets):
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[2]), dtype=torch.float32)
    return a.new_empty((offsets.shape[0], a.shape[0], b.shape[1]), dtype=torch.float32)


def grouped_scaled_gemm(a_fp8: torch.Tensor, a_inverse_scale: torch.Tensor, b_fp8: torch.Tensor,
                        b_inverse_scale: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                        lowering: Lowering, use_fast_accum: bool = False) -> torch.Tensor:
    """The rows form: ``a`` (S, K) with ``a_inverse_scale`` (S,), ``b`` (E, K, N) with ``b_inverse_scale``
    (E, N); returns (S, N) in ``out_dtype``."""
    if lowering is Lowering.SCALED_MM:
        output = torch._scaled_grouped_mm(row_major(a_fp8), column_major(b_fp8), a_inverse_scale.contiguous(),
                                          b_inverse_scale.contiguous(), offs=offsets, out_dtype=torch.bfloat16,
                                          use_fast_accum=use_fast_accum)
        return output.to(out_dtype)
    product_fp32 = torch.ops.fp8graph.grouped_mm_exact(a_fp8, b_fp8, offsets)  # (S, N)
    # Rows in no group have a zero product: any expert's scale leaves them zero.
    experts = row_groups(offsets, a_fp8.shape[0]).clamp(max=offsets.shape[0] - 1)
    return (product_fp32 * a_inverse_scale[:, None] * b_inverse_scale[experts]).to(out_dtype)


def placed_for_grad_weight(x_fp8: torch.Tensor, offsets: torch.Tensor, lowering: Lowering) -> torch.Tensor:
    """An operand of the weights form, ``x`` (S, C), as :func:`grouped_scaled_gemm_weights` reads it: for
    ``scaled_mm`` (C, S'), row-major, each group of tokens zero-padded to 16, so a caller can lay it out where
    ``x`` is cast (the forward, for the backward's GEMM); emulated, ``x`` itself. One tiled pass reads each row
    where it lies (a column scattered in place would be written a byte a row apart)."""
    if lowering is Lowering.SCALED_MM:
        sources, _ = padded_group_sources(offsets, x_fp8.shape[0], FP8_GEMM_DIM_MULTIPLE)
        return transpose_fp8(x_fp8, sources)
    return x_fp8


def group_columns_for_grad_weight(x_hp: torch.Tensor, offsets: torch.Tensor, lowering: Lowering,
                                  power_2_scales: bool, gather_index: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """An operand of the weights form, ``x_hp`` (S, C) (or ``x_hp[gather_index]``), cast with one scale per group
    and column and placed as :func:`placed_for_grad_weight` places it: ``(x_placed, scale (E, C))``. For
    ``scaled_mm`` one kernel casts and lays out (``fp8graph::quantize_group_columns_placed``); emulated, the
    cast's rows as they are."""
    if lowering is Lowering.SCALED_MM:
        return torch.ops.fp8graph.quantize_group_columns_placed(x_hp, offsets, FP8_GEMM_DIM_MULTIPLE,
                                                                power_2_scales, gather_index)
    rows_hp = x_hp if gather_index is None else x_hp[gather_index]
    return quantize_group_columns(rows_hp, offsets, torch.float8_e4m3fn, power_2_scales)


def grouped_scaled_gemm_weights(a_placed: torch.Tensor, a_inverse_scale: torch.Tensor, b_placed: torch.Tensor,
                                b_inverse_scale: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                                lowering: Lowering) -> torch.Tensor:
    """The weights form: ``a`` (S, N) with ``a_inverse_scale`` (E, N) and ``b`` (S, K) with ``b_inverse_scale``
    (E, K), each placed by :func:`placed_for_grad_weight` (or :func:`group_columns_for_grad_weight`); returns
    ``a_e^T . b_e`` (E, N, K) in ``out_dtype``."""
    if lowering is Lowering.SCALED_MM:  # a_placed (N, S'), b_placed (K, S')
        output = torch._scaled_grouped_mm(a_placed, b_placed.t(), a_inverse_scale.reshape(-1).contiguous(),
                                          b_inverse_scale.reshape(-1).contiguous(),
                                          offs=padded_group_offsets(offsets, FP8_GEMM_DIM_MULTIPLE),
                                          out_dtype=torch.bfloat16)
        return output.to(out_dtype)
    product_fp32 = torch.ops.fp8graph.grouped_mm_exact(a_placed.t(), b_placed, offsets)  # (E, N, K)
    return (product_fp32 * a_inverse_scale[:, :, None] * b_inverse_scale[:, None, :]).to(out_dtype)

