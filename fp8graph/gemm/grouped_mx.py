"""MXFP8 expert GEMMs on SM 10.x: ``torch._scaled_grouped_mm`` with E8M0 scales in cuBLAS's blocked layout.

The two grouped forms (``fp8graph.gemm.grouped_gemm``), each operand in blocks of 32 along the reduction::

    rows     a (S, K) x b (E, N, K)^T -> (S, N)     groups of rows;   a's scales (S, K/32), b's (E, N, K/32)
    weights  a (N, S') x b (K, S')^T  -> (E, N, K)  groups of tokens; a's scales (N, S'/32), b's (K, S'/32)

What the kernel reads is what torch's own tests of this op build (``test_scaled_matmul_cuda.py``): every
group's scales laid out on their own, as ``swizzle_mx_scales`` lays out a matrix (128 x 4 tiles, each
swizzled 32x4x4), and the groups' layouts concatenated; each expert's weight scales the same, one row of
the (E, ...) scale tensor per expert. Groups are data-dependent, so everything is built with tensor code
on bounds known when the graph is built (``padded_group_rows``):

- rows form: each group is zero-padded to a multiple of 32 rows (the group sizes torch's tests use) and
  its scales start on a 128-row tile, so the whole scale matrix swizzled at once is the concatenation.
  Output rows are gathered back; rows in no group are zero.
- weights form: the token groups arrive padded to 32 (``targets.grouped_blocks``); a group's scale columns
  are padded to a multiple of 4 (128 tokens), and its tiles (every 128-row block of it) are put together.

Not run on a GPU yet (the project's GPUs are SM 9.x): the layouts are held to torch's reference
(``to_blocked`` per group) and the calls to torch's meta checks in ``tests/gemm/test_grouped_mx.py``;
``tests/test_gpu.py`` compares them with the emulation where an SM 10.x GPU runs it. torch builds without
its MXFP8 grouped kernel (it needs ``USE_MSLK`` / FBGEMM GenAI) raise at the first call.
"""

from __future__ import annotations

import torch

from fp8graph.gemm.layouts import column_major, row_major
from fp8graph.gemm.native_tiled import swizzle_mx_scales
from fp8graph.numerics.groups import padded_group_rows, row_groups
from fp8graph.numerics.tiles import e8m0_bytes

__all__ = ["blocked_column_groups", "blocked_row_groups", "grouped_mx_gemm", "grouped_mx_gemm_weights"]

_BLOCK = 32  # MX block: 32 elements along the reduction
_TILE_ROWS, _TILE_COLUMNS = 128, 4  # cuBLAS's scale tile: 128 rows of 4 block scales


def _padded_to(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def blocked_row_groups(scale_e8m0: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The scales (S, C) of a rows-form operand whose row groups end at ``offsets``, each group's rows laid out
    on their own (starting on a 128-row tile): 2-D, (rows bound, C padded to 4)."""
    rows, columns = scale_e8m0.shape
    destination, _, padded_rows = padded_group_rows(offsets, rows, _TILE_ROWS)
    matrix = scale_e8m0.new_zeros((padded_rows, columns)).index_copy(0, destination, scale_e8m0)
    return swizzle_mx_scales(matrix).reshape(padded_rows, _padded_to(columns, _TILE_COLUMNS))


def blocked_column_groups(scale_e8m0: torch.Tensor, column_offsets: torch.Tensor) -> torch.Tensor:
    """The scales (R, C) of a weights-form operand whose column groups end at ``column_offsets`` (in scale
    columns), each group's (R, C_e) block laid out on its own and the groups concatenated: 2-D, (R padded to
    128, the rest)."""
    rows, columns = scale_e8m0.shape
    destination, padded_offsets, padded_columns = padded_group_rows(column_offsets, columns, _TILE_COLUMNS)
    padded_rows = _padded_to(rows, _TILE_ROWS)
    placed = scale_e8m0.new_zeros((rows, padded_columns)).index_copy(1, destination, scale_e8m0)
    row_tiles, column_tiles = padded_rows // _TILE_ROWS, padded_columns // _TILE_COLUMNS
    # The whole matrix swizzled gives its tiles in (r, c) order; each group's must be together.
    tiles = swizzle_mx_scales(placed).reshape(row_tiles * column_tiles, _TILE_ROWS * _TILE_COLUMNS)
    # Group by group, each group's tiles row tile by row tile: ordered by (group, r, c).
    tile_groups = row_groups(padded_offsets // _TILE_COLUMNS, column_tiles).to(torch.int64)  # (column_tiles,)
    key = (tile_groups[None, :] * row_tiles + torch.arange(row_tiles, device=placed.device)[:, None]) \
        * column_tiles + torch.arange(column_tiles, device=placed.device)[None, :]
    return tiles[torch.argsort(key.flatten())].reshape(padded_rows, -1)


def _expert_scales(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """(E, R, C) scales of E stacked matrices, each laid out on its own: (E, R padded to 128 x C padded to 4)."""
    experts, rows, columns = scale_e8m0.shape
    padded = torch.cat([scale_e8m0, scale_e8m0.new_zeros((experts, _padded_to(rows, _TILE_ROWS) - rows, columns))], 1)
    return swizzle_mx_scales(padded.reshape(-1, columns)).reshape(experts, -1)


def grouped_mx_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, b_fp8: torch.Tensor, b_scale: torch.Tensor,
                    offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows form: ``a`` (S, K) by ``b`` (E, N, K) transposed, per group; quantization scales (S, K/32) and
    (E, N, K/32) (``x_fp8 = x * scale``, powers of two). Returns (S, N)."""
    rows = a_fp8.shape[0]
    destination, padded_offsets, padded_rows = padded_group_rows(offsets, rows, _BLOCK)
    a_padded = a_fp8.new_zeros((padded_rows, a_fp8.shape[1]), dtype=torch.uint8).index_copy(
        0, destination, a_fp8.view(torch.uint8)).view(a_fp8.dtype)
    a_scale_padded = e8m0_bytes(a_scale).view(torch.uint8)
    a_scale_padded = a_scale_padded.new_zeros((padded_rows, a_scale.shape[1])).index_copy(0, destination,
                                                                                          a_scale_padded)
    output = torch._scaled_grouped_mm(
        row_major(a_padded), column_major(b_fp8.transpose(-2, -1)),
        blocked_row_groups(a_scale_padded, padded_offsets).view(torch.float8_e8m0fnu),
        _expert_scales(e8m0_bytes(b_scale).view(torch.uint8)).view(torch.float8_e8m0fnu),
        offs=padded_offsets, out_dtype=torch.bfloat16)
    in_group = (row_groups(offsets, rows) < offsets.shape[0])[:, None]
    return torch.where(in_group, output[destination], 0).to(out_dtype)


def grouped_mx_gemm_weights(a_fp8: torch.Tensor, a_scale: torch.Tensor, b_fp8: torch.Tensor, b_scale: torch.Tensor,
                            offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Weights form: ``a`` (N, S') by ``b`` (K, S') transposed, reduced over each group of tokens (``offsets``,
    multiples of 32); quantization scales (N, S'/32) and (K, S'/32). Returns (E, N, K)."""
    column_offsets = offsets // _BLOCK
    output = torch._scaled_grouped_mm(
        row_major(a_fp8), column_major(b_fp8.t()),  # (N, S') row-major, (S', K) column-major
        blocked_column_groups(e8m0_bytes(a_scale).view(torch.uint8), column_offsets).view(torch.float8_e8m0fnu),
        blocked_column_groups(e8m0_bytes(b_scale).view(torch.uint8), column_offsets).view(torch.float8_e8m0fnu),
        offs=offsets, out_dtype=torch.bfloat16)
    return output.to(out_dtype)
