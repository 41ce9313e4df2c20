"""``fp8graph::quantize_group_columns_placed``: a grouped GEMM's weight-gradient operand, cast per group and
column and laid out for the GEMM, in one kernel.

The weight-gradient GEMM of a mixture of experts reduces over each group's tokens, so row-wise scaling casts its
operands (the input, the output's gradient: (S, C), rows sorted by expert) with one scale per group and column,
and the GEMM reads them transposed, (C, S'), with every group zero-padded to a multiple of 16 tokens. Written as
torch ops that is three passes over the operand: the amax table (``torch.segment_reduce``, an ATen kernel that
reduces each output element in one thread: 11.1 ms of a 33.9 ms step on an H200 at 2048 tokens an expert,
bench/results/moe-2026-11-27T132818Z.json), the cast, and the padded transpose (``fp8graph::transpose_fp8``).
This op does it in one program a group and column block (``_group_columns_triton``): two reads of the BF16
rows, the second from L2, one write of the FP8 bytes where the GEMM reads them.

On CUDA it runs the Triton kernel; everywhere else, and where Triton is missing, the reference
(:func:`fp8graph.numerics.groups.quantize_group_columns`, then the padded transpose of
``padded_group_sources``), which the tests hold the kernel to bit for bit under Triton's interpreter.
"""

from __future__ import annotations

import torch

from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available
from fp8graph.kernels.transpose_fp8 import transpose_fp8
from fp8graph.numerics.formats import fp8_max, fp8_max_exponent
from fp8graph.numerics.groups import padded_group_bound, padded_group_sources, quantize_group_columns

__all__ = ["plan_quantize_group_columns_placed", "quantize_group_columns_placed"]

_FP8 = torch.float8_e4m3fn  # a grouped GEMM takes E4M3 only
_BLOCK_ROWS = 64
_BLOCK_COLUMNS = 64  # 128 bytes of a BF16 row a load; 64-byte runs of a transposed FP8 row a store
_NUM_WARPS = 4
_MAX_GROUPS = 1024  # every group's bounds are loaded by each program at once


def _checked(x_hp: torch.Tensor, offsets: torch.Tensor, gather_index: torch.Tensor | None) -> None:
    if x_hp.dim() != 2 or not x_hp.dtype.is_floating_point or x_hp.element_size() == 1:
        raise ValueError(f"quantize_group_columns_placed casts a 2-D high-precision tensor, got {x_hp.dtype} "
                         f"of shape {tuple(x_hp.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] == 0 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"quantize_group_columns_placed's offsets are a non-empty 1-D integer tensor, got "
                         f"{offsets.dtype} of shape {tuple(offsets.shape)}")
    if gather_index is not None and (gather_index.dim() != 1 or gather_index.dtype != torch.int64):
        raise ValueError(f"quantize_group_columns_placed's gather_index is a 1-D int64 tensor, got "
                         f"{gather_index.dtype} of shape {tuple(gather_index.shape)}")


def plan_quantize_group_columns_placed(x_hp: torch.Tensor, offsets: torch.Tensor, multiple: int,
                                       power_2_scales: bool, gather_index: torch.Tensor | None = None
                                       ) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor]:
    """The launch that writes the op's ``(x_t_fp8 (C, P), scale (E, C))``, and those two outputs."""
    from triton import cdiv, knobs, next_power_of_2

    from fp8graph.kernels._group_columns_triton import quantize_group_columns_placed_kernel

    _checked(x_hp, offsets, gather_index)
    groups = offsets.shape[0]
    if groups > _MAX_GROUPS:
        raise ValueError(f"quantize_group_columns_placed takes at most {_MAX_GROUPS} groups, got {groups}")
    if x_hp.stride(1) != 1 and x_hp.shape[1] > 1:
        x_hp = x_hp.contiguous()
    rows = x_hp.shape[0] if gather_index is None else gather_index.shape[0]
    columns = x_hp.shape[1]
    padded_rows = padded_group_bound(rows, groups, multiple)
    x_t_fp8 = torch.empty((columns, padded_rows), dtype=_FP8, device=x_hp.device)
    scale = torch.empty((groups, columns), dtype=torch.float32, device=x_hp.device)
    gather = gather_index is not None
    launch = KernelLaunch(
        quantize_group_columns_placed_kernel, (groups + 1, cdiv(columns, _BLOCK_COLUMNS)),
        (x_hp, gather_index.contiguous() if gather else offsets, offsets.contiguous(), x_t_fp8.view(torch.uint8),
         scale, rows, columns, padded_rows, x_hp.stride(0), groups),
        {"GATHER": gather, "MULTIPLE": multiple, "BLOCK_GROUPS": max(next_power_of_2(groups), 16),
         "BLOCK_ROWS": _BLOCK_ROWS, "BLOCK_COLUMNS": _BLOCK_COLUMNS, "SCALE_KIND": int(power_2_scales),
         "FP8_MAX": fp8_max(_FP8), "FP8_MAX_EXPONENT": fp8_max_exponent(_FP8),
         # The interpreter's own FP8 conversion is not the GPU's: round in software there.
         "SOFTWARE_ROUNDING": bool(knobs.runtime.interpret), "num_warps": _NUM_WARPS})
    return launch, x_t_fp8, scale


def quantize_group_columns_placed_triton(x_hp: torch.Tensor, offsets: torch.Tensor, multiple: int,
                                         power_2_scales: bool, gather_index: torch.Tensor | None = None
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel (the op's outputs)."""
    launch, x_t_fp8, scale = plan_quantize_group_columns_placed(x_hp, offsets, multiple, power_2_scales,
                                                                gather_index)
    if x_t_fp8.shape[0]:
        launch()
    return x_t_fp8, scale


def _reference(x_hp, offsets, multiple, power_2_scales, gather_index):
    _checked(x_hp, offsets, gather_index)
    rows_hp = x_hp if gather_index is None else x_hp[gather_index]
    x_fp8, scale = quantize_group_columns(rows_hp, offsets, _FP8, power_2_scales)
    sources, _ = padded_group_sources(offsets, rows_hp.shape[0], multiple)
    return transpose_fp8(x_fp8, sources), scale


@torch.library.custom_op("fp8graph::quantize_group_columns_placed", mutates_args=())
def quantize_group_columns_placed(x_hp: torch.Tensor, offsets: torch.Tensor, multiple: int, power_2_scales: bool,
                                  gather_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``x_hp`` (S, C) (``x_hp[gather_index]`` with ``gather_index``), sorted into the groups ``offsets``
    (E,) ends, cast to E4M3 with one scale per group and column and laid out transposed with every group
    zero-padded to ``multiple`` rows: ``(x_t_fp8 (C, P), scale (E, C))``, column ``p`` of ``x_t_fp8`` the row
    ``padded_group_sources`` puts there, ``P`` :func:`fp8graph.numerics.groups.padded_group_bound`. Rows past
    ``offsets[-1]`` are cast with their own scale and laid out after the groups. ``gather_index`` must hold row
    indices of ``x_hp``: unchecked, as a check would wait for the device."""
    return _reference(x_hp, offsets, multiple, power_2_scales, gather_index)


@quantize_group_columns_placed.register_fake
def _(x_hp, offsets, multiple, power_2_scales, gather_index=None):
    _checked(x_hp, offsets, gather_index)
    rows = x_hp.shape[0] if gather_index is None else gather_index.shape[0]
    padded_rows = padded_group_bound(rows, offsets.shape[0], multiple)
    return (x_hp.new_empty((x_hp.shape[1], padded_rows), dtype=_FP8),
            x_hp.new_empty((offsets.shape[0], x_hp.shape[1]), dtype=torch.float32))


@quantize_group_columns_placed.register_kernel("cuda")
def _(x_hp, offsets, multiple, power_2_scales, gather_index=None):
    if not triton_available():
        return _reference(x_hp, offsets, multiple, power_2_scales, gather_index)
    return quantize_group_columns_placed_triton(x_hp, offsets, multiple, power_2_scales, gather_index)
