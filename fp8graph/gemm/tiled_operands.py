"""A tiled recipe's GEMM operands: a tensor quantized along its rows, its columns, or both, by fp8graph's kernel
or by Inductor's code (row-wise, block and MXFP8 scaling; ``fp8graph.targets.linear_tiled`` runs the GEMMs).

A tile's scale covers elements of one GEMM's reduction dimension only, so an operand that two GEMMs reduce
along different dimensions is quantized once for each; square tiles serve both transposed.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8graph.gemm.scaled_gemm import one_buffer
from fp8graph.kernels.quantize_tiles import kernel_quantizes
from fp8graph.numerics.formats import Role
from fp8graph.numerics.tiles import Tiling, reference_quantize_tiles, reference_quantize_tiles_by
from fp8graph.recipes.scaling import TiledRecipe

__all__ = ["TiledOperand", "cached_weight_operands", "expert_blocks", "kernel_casts", "quantize_both_ways"]


class TiledOperand:
    """An FP8 operand laid out (rows, reduction), with its scales and tiling."""

    def __init__(self, fp8: torch.Tensor, scale: torch.Tensor, tiling: Tiling):
        self.fp8, self.scale, self.tiling = fp8, scale, tiling

    def transposed(self) -> "TiledOperand":
        """The same quantization read the other way round (square tiles only)."""
        return TiledOperand(self.fp8.t(), self.scale.t(), self.tiling)

    def laid_out(self) -> "TiledOperand":
        """The bytes stored (rows, reduction), as a GEMM reads its second operand: an operand that several GEMMs
        read is laid out once (each native GEMM would otherwise copy a transposed view for itself)."""
        return TiledOperand(self.fp8.contiguous(), self.scale, self.tiling)


def kernel_casts(x_hp: torch.Tensor, tiling: Tiling) -> bool:
    """Whether :func:`quantize_both_ways` casts ``x_hp`` with fp8graph's kernel (on CUDA, the tilings it
    quantizes faster than Inductor's code: ``fp8graph.kernels.quantize_tiles.kernel_quantizes``)."""
    return x_hp.device.type == "cuda" and kernel_quantizes(tiling)


def quantize_both_ways(x_hp: torch.Tensor, tiling: Tiling, along_rows: bool, along_columns: bool,
                       use_kernel: bool | None = None, scales_read: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       laid_out_by_reader: bool = False) -> tuple[TiledOperand | None, TiledOperand | None]:
    """``x_hp`` (R, C) quantized along its rows (C reduced) and, transposed, along its columns (R reduced).

    On CUDA, tilings that fp8graph's kernel quantizes faster than Inductor's
    code (``fp8graph.kernels.quantize_tiles.kernel_quantizes``) run it, both
    layouts from one read. Elsewhere the plain-torch ``reference_quantize_tiles``, which
    Inductor fuses with the producer of ``x_hp``; square tiles then reuse the
    row-major quantization transposed (bit for bit what a requantization gives).
    ``use_kernel`` overrides the choice (tests run the ops' CPU reference so). ``scales_read``: what Inductor's
    code casts with is ``scales_read(scale)`` (the same values; ``reference_quantize_tiles_by``); the kernel takes
    none. ``laid_out_by_reader``: Inductor's transposed cast is left for its reader to lay out once
    (:meth:`TiledOperand.laid_out`), not realized in its own order first.
    """
    if use_kernel is None:
        use_kernel = kernel_casts(x_hp, tiling)
    if use_kernel and scales_read is not None:
        raise ValueError("fp8graph's tile kernel computes its scales itself: no scales_read")
    if use_kernel:
        tile_args = (tiling.rows, tiling.cols, tiling.scale_kind.value)
        if along_rows and along_columns:
            x_fp8, scale, x_t_fp8, scale_t = torch.ops.fp8graph.quantize_tiles_and_transpose(x_hp, *tile_args)
            return TiledOperand(x_fp8, scale, tiling), TiledOperand(x_t_fp8, scale_t, tiling)
        x_q = TiledOperand(*torch.ops.fp8graph.quantize_tiles(x_hp, *tile_args), tiling) if along_rows else None
        x_t_q = (TiledOperand(*torch.ops.fp8graph.quantize_tiles(x_hp.t(), *tile_args), tiling)
                 if along_columns else None)
        return x_q, x_t_q
    scales_read = scales_read or (lambda scale: scale)
    x_q = _inductor_quantized(x_hp, tiling, scales_read) if along_rows else None
    x_t_q = None
    if along_columns:
        x_t_q = (x_q.transposed() if tiling.is_square and x_q is not None
                 else _inductor_quantized(x_hp.t(), tiling, scales_read, one_for_every_reader=not laid_out_by_reader))
    return x_q, x_t_q


def _inductor_quantized(x_hp: torch.Tensor, tiling: Tiling, scales_read, one_for_every_reader: bool = True
                        ) -> TiledOperand:
    """``reference_quantize_tiles`` of ``x_hp``. With ``one_for_every_reader``, its FP8 values are one buffer
    however many GEMMs read them (q, k and v quantize their shared input identically: one node once the graph's
    duplicates merge). Without, the values are left to their reader to lay out (a group of sites lays its shared
    copy out once, :meth:`TiledOperand.laid_out`, where a buffer realized in the transposed view's own order
    would be copied again)."""
    x_fp8, scale = reference_quantize_tiles_by(x_hp, tiling, scales_read)
    shared = one_for_every_reader and x_hp.device.type == "cuda"
    return TiledOperand(one_buffer(x_fp8) if shared else x_fp8, scale, tiling)


def cached_weight_operands(weight_hp: torch.Tensor, recipe: TiledRecipe, use_kernel: bool | None = None
                           ) -> tuple[torch.Tensor, ...]:
    """What a kept copy of ``weight_hp`` (N, K) holds (``fp8graph.buffers.weight_cache``), in its buffers'
    order: the forward's operand (N, K) and its scales, then grad_input's (K, N) and its scales, except for
    square tiles, whose transpose grad_input reads."""
    tiling = recipe.tiling(Role.WEIGHT)
    weight_q, weight_t_q = quantize_both_ways(weight_hp, tiling, True, not tiling.is_square, use_kernel)
    if tiling.is_square:
        return weight_q.fp8, weight_q.scale
    return weight_q.fp8, weight_q.scale, weight_t_q.fp8, weight_t_q.scale


def expert_blocks(weight_hp: torch.Tensor, tiling: Tiling) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights ``weight_hp`` (E, R, C) in ``tiling``'s blocks along C (MXFP8's expert GEMMs,
    ``fp8graph.targets.grouped_blocks``): ``(weight_fp8 (E, R, C), scale (E, R, C / 32))``, contiguous whatever
    ``weight_hp``'s layout (a transposed view is cast as the view): what grad_input's GEMM reads of a weight's
    transpose, and what ``fp8graph.buffers.weight_cache.copy_layout`` keeps of each layout."""
    experts = weight_hp.shape[0]
    weight_fp8, scale = reference_quantize_tiles(weight_hp.reshape(-1, weight_hp.shape[-1]), tiling)
    return weight_fp8.reshape(experts, -1, weight_fp8.shape[1]), scale.reshape(experts, -1, scale.shape[1])
