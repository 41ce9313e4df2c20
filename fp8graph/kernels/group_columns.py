"""A grouped GEMM's weight-gradient operand, cast and laid out for the GEMM in one kernel: two ops.

The weight-gradient GEMM of a mixture of experts reduces over each group's tokens and reads its operands (the
input, the output's gradient: (S, C), rows sorted by expert) transposed, (C, S'), with every group zero-padded to
a multiple of 16 tokens (``fp8graph.gemm.grouped_gemm``).

``fp8graph::quantize_group_columns_placed``: row-wise scaling casts those operands with one scale per group and
column. Written as torch ops that is three passes over the operand: the amax table (``torch.segment_reduce``, an
ATen kernel that reduces each output element in one thread: 11.1 ms of a 33.9 ms step on an H200 at 2048 tokens
an expert, bench/results/moe-2026-11-27T132818Z.json), the cast, and the padded transpose
(``fp8graph::transpose_fp8``). This op does it in one program a group and column block
(``_group_columns_triton``): two reads of the BF16 rows, the second from L2, one write of the FP8 bytes where the
GEMM reads them.

``fp8graph::quantize_expert_columns``: the same cast of an expert weight (E, N, K) along N, each expert's N rows a
group, stored (E, K, N) where row-wise's grad_input GEMM reads it (``quantize_expert_columns_into_``: into a
kept copy's buffers). Written as torch ops it is an amax reduction over
the weight and a second kernel that reads it again to cast it and store the transposed bytes (5 bytes an element);
here the second read of each program's columns comes from L2 (3).

``fp8graph::quantize_rows_placed``: a per-tensor scale (current or delayed scaling) casts the gathered input
once for the forward GEMM and grad_weight's. Written as torch ops the kernel that gathers the rows casts them and
``fp8graph::transpose_fp8`` reads the FP8 rows again to lay them out; this op writes both layouts from one read
of the rows, and each group's amaxes with them, a block of 64 columns each (what delayed scaling records).

``fp8graph::quantize_weighted_rows_placed``: the same cast of the rows each multiplied by its own weight, and each
row's dot product with a second tensor's row, from the same read: the backward of an expert combine,
``out[t] = sum_k weights[s] * y[s]`` over token ``t``'s routed rows ``s``, whose gradient ``g`` (T, C) gives the
down projection's grad_output ``g[t(s)] * weights[s]``, cast here for its two GEMMs, and the routing weights'
gradient ``g[t(s)] . y[s]``. Written as torch ops the kernel that gathers ``g`` casts the products and
``fp8graph::transpose_fp8`` reads the FP8 rows again to lay them out.

``fp8graph::quantize_weighted_rows_rowwise``: that gradient cast as row-wise scaling's two GEMMs read it, each
row with its own scale (grad_input's, stored as rows) and per group and column (grad_weight's, laid out), with the
dots, from two reads of the gathered rows (the second from L2). Written as torch ops autograd's combine backward
stores the weighted gradient in BF16, a reduction casts its rows, and ``quantize_group_columns_placed`` reads it
twice more.

On CUDA they run the Triton kernel; everywhere else, and where Triton is missing, the references (the torch
casts, then the padded transpose of ``padded_group_sources``), which the tests hold the kernel to bit for bit under
Triton's interpreter.
"""

from __future__ import annotations

import math

import torch

from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available
from fp8graph.kernels.transpose_fp8 import transpose_fp8
from fp8graph.numerics.formats import fp8_max, fp8_max_exponent
from fp8graph.numerics.groups import (group_block_amax, padded_group_bound, padded_group_sources,
                                      quantize_group_columns)
from fp8graph.numerics.quantize import amax_to_scale, finite_magnitude, quantize

__all__ = ["checked_groups", "column_blocks", "layout_reference", "layout_rows", "plan_quantize_expert_columns",
           "plan_quantize_group_columns_placed", "plan_quantize_rows_placed", "plan_quantize_weighted_rows_placed", "plan_quantize_weighted_rows_rowwise",
           "quantize_expert_columns", "quantize_expert_columns_into_", "quantize_group_columns_placed",
           "quantize_rows_placed", "quantize_weighted_rows_placed", "quantize_weighted_rows_rowwise",
           "takes_expert_destinations", "takes_expert_weight", "weighted_rows_reference"]

_FP8 = torch.float8_e4m3fn  # a grouped GEMM takes E4M3 only
_BLOCK_ROWS = 64
_BLOCK_COLUMNS = 64  # 128 bytes of a BF16 row a load; 64-byte runs of a transposed FP8 row a store
_NUM_WARPS = 4
_MAX_GROUPS = 1024  # every group's bounds are loaded by each program at once


def column_blocks(columns: int) -> int:
    """The blocks of columns ``fp8graph::quantize_rows_placed`` takes an amax of: one a kernel program."""
    return -(-columns // _BLOCK_COLUMNS)


def _name(tensor_scale: torch.Tensor | None, weighted: bool = False) -> str:
    return ("quantize_group_columns_placed" if tensor_scale is None else
            "quantize_weighted_rows_placed" if weighted else "quantize_rows_placed")


def checked_groups(name: str, offsets: torch.Tensor, scale: torch.Tensor | None = None,
                   device: torch.device | None = None, max_groups: int | None = None) -> None:
    """What every op that casts a grouped operand asks of its groups' ``offsets`` (a non-empty 1-D integer tensor,
    at most ``max_groups`` long) and of its one ``scale`` where it takes one (a float32 value on ``device``)."""
    if offsets.dim() != 1 or offsets.shape[0] == 0 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}'s offsets are a non-empty 1-D integer tensor, got {offsets.dtype} of shape "
                         f"{tuple(offsets.shape)}")
    if max_groups is not None and offsets.shape[0] > max_groups:
        raise ValueError(f"{name} takes at most {max_groups} groups, got {offsets.shape[0]}")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device):
        raise ValueError(f"{name}'s scale is one float32 value on {device}, got {scale.dtype} of shape "
                         f"{tuple(scale.shape)} on {scale.device}")


def _checked(x_hp: torch.Tensor, offsets: torch.Tensor, gather_index: torch.Tensor | None,
             tensor_scale: torch.Tensor | None = None, weighted: bool = False, name: str | None = None) -> None:
    name = name or _name(tensor_scale, weighted)
    if x_hp.dim() != 2 or not x_hp.dtype.is_floating_point or x_hp.element_size() == 1:
        raise ValueError(f"{name} casts a 2-D high-precision tensor, got {x_hp.dtype} of shape {tuple(x_hp.shape)}")
    if gather_index is not None and (gather_index.dim() != 1 or gather_index.dtype != torch.int64):
        raise ValueError(f"{name}'s gather_index is a 1-D int64 tensor, got {gather_index.dtype} of shape "
                         f"{tuple(gather_index.shape)}")
    checked_groups(name, offsets, tensor_scale, x_hp.device)


def _plan(x_hp: torch.Tensor, offsets: torch.Tensor, multiple: int, gather_index: torch.Tensor | None,
          tensor_scale: torch.Tensor | None, power_2_scales: bool, row_weights: torch.Tensor | None = None,
          other_hp: torch.Tensor | None = None, expert_major: bool = False,
          into: tuple[torch.Tensor, torch.Tensor] | None = None, row_scales: torch.Tensor | None = None,
          layout: bool = True):
    """The kernel's launch and outputs: ``(launch, x_t_fp8 (C, P), rows (S, C) FP8 or None, table, dots)``, the
    table the scales per group and column (E, C), or with ``tensor_scale`` the amaxes of each group's (and the rows
    in no group's) blocks of columns (E + 1, :func:`column_blocks`); with ``row_weights`` the rows are weighted
    before the cast; with ``other_hp`` ``dots`` (:func:`column_blocks`, S) are each row's partial dot products with
    ``other_hp``'s, else None; ``expert_major`` (groups of one size, a multiple of ``multiple``) lays ``x_t_fp8`` out
    (E, C, P / E), each group's transpose a block of its own; ``into`` are the ``(x_t_fp8, table)`` to write; with
    ``row_scales`` (S,) (and no ``tensor_scale``) the rows are stored too, each cast with its own scale; without
    ``layout`` (rows stored: ``tensor_scale`` or ``row_scales``) nothing is laid out, ``x_t_fp8`` is (C, 0) and a
    per-group table (E, 0)."""
    from triton import cdiv, knobs, next_power_of_2

    from fp8graph.kernels._group_columns_triton import quantize_group_columns_placed_kernel

    groups = offsets.shape[0]
    if groups > _MAX_GROUPS:
        raise ValueError(f"{_name(tensor_scale, row_weights is not None)} takes at most {_MAX_GROUPS} groups, "
                         f"got {groups}")
    if x_hp.stride(1) != 1 and x_hp.shape[1] > 1:
        x_hp = x_hp.contiguous()
    rows = x_hp.shape[0] if gather_index is None else gather_index.shape[0]
    columns = x_hp.shape[1]
    # Groups of one size, a multiple of ``multiple``, are laid out without pads.
    padded_rows = rows if expert_major else padded_group_bound(rows, groups, multiple)
    rows_fp8 = (None if tensor_scale is None and row_scales is None
                else torch.empty((rows, columns), dtype=_FP8, device=x_hp.device))
    if not layout and (rows_fp8 is None or expert_major or into is not None):
        raise ValueError("a cast without grad_weight's layout stores the rows (a tensor's scale, or a row's)")
    x_t_fp8 = (into[0] if into is not None else
               torch.empty((groups, columns, rows // groups) if expert_major
                           else (columns, padded_rows if layout else 0), dtype=_FP8, device=x_hp.device))
    table = (into[1] if into is not None else
             torch.empty((groups, columns if layout else 0), dtype=torch.float32, device=x_hp.device)
             if tensor_scale is None
             else torch.empty((groups + 1, column_blocks(columns)), dtype=torch.float32, device=x_hp.device))
    gather = gather_index is not None
    # Without tensor_scale the kernel writes the scales into the table and takes no amax table (nor rows output
    # without row_scales), without row_weights no weights, other rows or dots: the table's pointer stands in for them.
    scale_arg, rows_arg, amax_arg = ((table, table if rows_fp8 is None else rows_fp8.view(torch.uint8), table)
                                     if tensor_scale is None else (tensor_scale, rows_fp8.view(torch.uint8), table))
    weighted, dotted = row_weights is not None, other_hp is not None
    if dotted and other_hp.shape[1] > 1 and other_hp.stride(1) != 1:
        other_hp = other_hp.contiguous()
    dots = (torch.empty((column_blocks(columns), rows), dtype=torch.float32, device=x_hp.device) if dotted
            else None)
    weights_arg = row_weights.contiguous() if weighted else table
    other_arg, dots_arg = (other_hp, dots) if dotted else (table, table)
    launch = KernelLaunch(
        quantize_group_columns_placed_kernel, (groups + 1, cdiv(columns, _BLOCK_COLUMNS)),
        (x_hp, gather_index.contiguous() if gather else offsets, offsets.contiguous(), x_t_fp8.view(torch.uint8),
         scale_arg, rows_arg, amax_arg, weights_arg, other_arg, dots_arg,
         table if row_scales is None else row_scales.contiguous(), rows, columns, padded_rows, x_hp.stride(0),
         other_hp.stride(0) if dotted else 0, groups),
        {"GATHER": gather, "MULTIPLE": multiple, "BLOCK_GROUPS": max(next_power_of_2(groups), 16),
         "BLOCK_ROWS": _BLOCK_ROWS, "BLOCK_COLUMNS": _BLOCK_COLUMNS, "SCALE_KIND": int(power_2_scales),
         "FP8_MAX": fp8_max(_FP8), "FP8_MAX_EXPONENT": fp8_max_exponent(_FP8),
         # The interpreter's own FP8 conversion is not the GPU's: round in software there.
         "SOFTWARE_ROUNDING": bool(knobs.runtime.interpret), "TENSOR_SCALE": tensor_scale is not None,
         # The dots' tile of the other rows beside the rows': 4 warps spill where the columns do not divide by 8.
         "ROW_WEIGHTS": weighted, "DOTS": dotted, "EXPERT_MAJOR": expert_major, "ROW_SCALES": row_scales is not None,
         "LAYOUT": layout, "num_warps": 2 * _NUM_WARPS if dotted else _NUM_WARPS})
    return launch, x_t_fp8, rows_fp8, table, dots


def plan_quantize_group_columns_placed(x_hp: torch.Tensor, offsets: torch.Tensor, multiple: int,
                                       power_2_scales: bool, gather_index: torch.Tensor | None = None
                                       ) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor]:
    """The launch that writes the op's ``(x_t_fp8 (C, P), scale (E, C))``, and those two outputs."""
    _checked(x_hp, offsets, gather_index)
    launch, x_t_fp8, _, scale, _ = _plan(x_hp, offsets, multiple, gather_index, None, power_2_scales)
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


def layout_rows(rows: int, groups: int, multiple: int, layout: bool = True) -> int:
    """The columns of grad_weight's layout of ``rows`` rows in ``groups`` groups, each zero-padded to ``multiple``
    (:func:`fp8graph.numerics.groups.padded_group_bound`); 0 where a cast lays nothing out (``layout=False``)."""
    return padded_group_bound(rows, groups, multiple) if layout else 0


def layout_reference(x_fp8: torch.Tensor, offsets: torch.Tensor, multiple: int, layout: bool = True) -> torch.Tensor:
    """What the ops' kernels lay out, by torch ops: the cast rows ``x_fp8`` (S, C) transposed with every group of
    ``offsets`` zero-padded to ``multiple`` rows, (C, :func:`layout_rows`); (C, 0) without ``layout``."""
    if not layout:
        return x_fp8.new_empty((x_fp8.shape[1], 0))
    sources, _ = padded_group_sources(offsets, x_fp8.shape[0], multiple)
    return transpose_fp8(x_fp8, sources)


def _reference(x_hp, offsets, multiple, power_2_scales, gather_index):
    _checked(x_hp, offsets, gather_index)
    rows_hp = x_hp if gather_index is None else x_hp[gather_index]
    x_fp8, scale = quantize_group_columns(rows_hp, offsets, _FP8, power_2_scales)
    return layout_reference(x_fp8, offsets, multiple), scale


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


def _expert_checked(weight_hp: torch.Tensor) -> None:
    if weight_hp.dim() != 3 or not weight_hp.dtype.is_floating_point or weight_hp.element_size() == 1:
        raise ValueError(f"quantize_expert_columns casts a 3-D high-precision expert weight (E, N, K), got "
                         f"{weight_hp.dtype} of shape {tuple(weight_hp.shape)}")
    if weight_hp.shape[0] > _MAX_GROUPS:
        raise ValueError(f"quantize_expert_columns takes at most {_MAX_GROUPS} experts, got {weight_hp.shape[0]}")


def _expert_groups(weight_hp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``weight_hp`` (E, N, K) as the groups the kernel casts: ``(rows (E N, K), offsets (E,), multiple)``, each
    expert's N rows a group, ``multiple`` the largest power of 2 up to 16 that divides N (no pads)."""
    experts, rows, columns = weight_hp.shape
    offsets = torch.arange(1, experts + 1, dtype=torch.int32, device=weight_hp.device) * rows
    return weight_hp.reshape(experts * rows, columns), offsets, math.gcd(rows, 16)


def takes_expert_weight(weight_hp: torch.Tensor) -> bool:
    """Whether :func:`quantize_expert_columns` casts ``weight_hp`` (E, N, K): stored with K contiguous (a weight
    stored (E, K, N) and read transposed is cast along its own rows, which Inductor does in one reduction) and at
    most 1024 experts (each program loads every group's bounds at once)."""
    return weight_hp.dim() == 3 and weight_hp.stride(-1) == 1 and weight_hp.shape[0] <= _MAX_GROUPS


def plan_quantize_expert_columns(weight_hp: torch.Tensor, power_2_scales: bool,
                                 into: tuple[torch.Tensor, torch.Tensor] | None = None
                                 ) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor]:
    """The launch that writes ``fp8graph::quantize_expert_columns``'s ``(weight_t_fp8 (E, K, N), scale (E, K))``
    (into the buffers ``into``, where given), and those two."""
    _expert_checked(weight_hp)
    rows_hp, offsets, multiple = _expert_groups(weight_hp)
    launch, weight_t_fp8, _, scale, _ = _plan(rows_hp, offsets, multiple, None, None, power_2_scales,
                                              expert_major=True, into=into)
    return launch, weight_t_fp8, scale


def quantize_expert_columns_triton(weight_hp: torch.Tensor, power_2_scales: bool,
                                   into: tuple[torch.Tensor, torch.Tensor] | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel (the op's outputs, written into ``into`` where given) on a weight with elements."""
    launch, weight_t_fp8, scale = plan_quantize_expert_columns(weight_hp, power_2_scales, into)
    launch()
    return weight_t_fp8, scale


def _expert_reference(weight_hp, power_2_scales):
    _expert_checked(weight_hp)
    experts, rows, columns = weight_hp.shape
    magnitude = finite_magnitude(weight_hp)
    amax = magnitude.amax(dim=1) if rows else magnitude.new_zeros((experts, columns))  # (E, K)
    scale = amax_to_scale(amax, _FP8, power_2_scales)
    return quantize(weight_hp, scale[:, None, :], _FP8).transpose(-2, -1).contiguous(), scale


@torch.library.custom_op("fp8graph::quantize_expert_columns", mutates_args=())
def quantize_expert_columns(weight_hp: torch.Tensor, power_2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights ``weight_hp`` (E, N, K) cast to E4M3 along N, one scale per expert and column, and written
    transposed: ``(weight_t_fp8 (E, K, N), scale (E, K))``, what a row-wise grouped grad_input GEMM reads (each
    expert's N contiguous). :func:`quantize_group_columns_placed` with every expert's N rows a group and each
    group's transpose a block of its own."""
    return _expert_reference(weight_hp, power_2_scales)


@quantize_expert_columns.register_fake
def _(weight_hp, power_2_scales):
    _expert_checked(weight_hp)
    experts, rows, columns = weight_hp.shape
    return (weight_hp.new_empty((experts, columns, rows), dtype=_FP8),
            weight_hp.new_empty((experts, columns), dtype=torch.float32))


@quantize_expert_columns.register_kernel("cuda")
def _(weight_hp, power_2_scales):
    if not triton_available() or weight_hp.numel() == 0:  # nothing for a program to write the scales of
        return _expert_reference(weight_hp, power_2_scales)
    return quantize_expert_columns_triton(weight_hp, power_2_scales)


def _expert_destination_fault(weight_hp: torch.Tensor, weight_t_fp8: torch.Tensor, scale: torch.Tensor) -> str | None:
    """Why ``quantize_expert_columns_into_`` cannot write ``weight_hp``'s cast into the buffers, or None."""
    experts, rows, columns = weight_hp.shape
    for name, buffer, shape, dtype in (("weight_t_fp8", weight_t_fp8, (experts, columns, rows), _FP8),
                                       ("scale", scale, (experts, columns), torch.float32)):
        if buffer.shape != shape or buffer.dtype != dtype or not buffer.is_contiguous() or \
                buffer.device != weight_hp.device:
            return (f"quantize_expert_columns_into_ writes {name} as a contiguous {dtype} tensor of shape {shape} "
                    f"on {weight_hp.device}, got {buffer.dtype} of shape {tuple(buffer.shape)} on {buffer.device}"
                    + ("" if buffer.is_contiguous() else ", not contiguous"))
    return None


def takes_expert_destinations(weight_hp: torch.Tensor, weight_t_fp8: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether :func:`quantize_expert_columns_into_` casts ``weight_hp`` into ``weight_t_fp8`` (E, K, N) and
    ``scale`` (E, K) as they lie: :func:`takes_expert_weight`, and the buffers laid out as the op writes them."""
    return takes_expert_weight(weight_hp) and _expert_destination_fault(weight_hp, weight_t_fp8, scale) is None


def _expert_into_checked(weight_hp: torch.Tensor, weight_t_fp8: torch.Tensor, scale: torch.Tensor) -> None:
    """``quantize_expert_columns_into_``'s operands: the weight first (the buffers' shapes follow from it)."""
    _expert_checked(weight_hp)
    fault = _expert_destination_fault(weight_hp, weight_t_fp8, scale)
    if fault is not None:
        raise ValueError(fault)


def _expert_written_into(weight_hp, power_2_scales, weight_t_fp8, scale) -> None:
    """The reference, copied into the buffers."""
    _expert_into_checked(weight_hp, weight_t_fp8, scale)
    cast, cast_scale = _expert_reference(weight_hp, power_2_scales)
    weight_t_fp8.copy_(cast)
    scale.copy_(cast_scale)


@torch.library.custom_op("fp8graph::quantize_expert_columns_into_", mutates_args=("weight_t_fp8", "scale"))
def quantize_expert_columns_into_(weight_hp: torch.Tensor, power_2_scales: bool, weight_t_fp8: torch.Tensor,
                                  scale: torch.Tensor) -> None:
    """:func:`quantize_expert_columns` written straight into the buffers that keep it (a row-wise expert weight's
    kept copy for grad_input and its scales, ``fp8graph.targets.grouped``), where the op and two ``copy_`` would
    write it twice. Inductor writes a graph input's mutation by this op in place (its re-inplacing of
    functionalized mutations)."""
    _expert_written_into(weight_hp, power_2_scales, weight_t_fp8, scale)


@quantize_expert_columns_into_.register_fake
def _(weight_hp, power_2_scales, weight_t_fp8, scale):
    _expert_into_checked(weight_hp, weight_t_fp8, scale)


@quantize_expert_columns_into_.register_kernel("cuda")
def _(weight_hp, power_2_scales, weight_t_fp8, scale):
    if not triton_available() or weight_hp.numel() == 0:
        _expert_written_into(weight_hp, power_2_scales, weight_t_fp8, scale)
        return
    _expert_into_checked(weight_hp, weight_t_fp8, scale)
    quantize_expert_columns_triton(weight_hp, power_2_scales, (weight_t_fp8, scale))


def plan_quantize_rows_placed(x_hp: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, multiple: int,
                              gather_index: torch.Tensor | None = None
                              ) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch that writes ``fp8graph::quantize_rows_placed``'s ``(rows_fp8, x_t_fp8, amax)``, and those."""
    _checked(x_hp, offsets, gather_index, scale)
    launch, x_t_fp8, rows_fp8, amax, _ = _plan(x_hp, offsets, multiple, gather_index, scale.reshape(()), False)
    return launch, rows_fp8, x_t_fp8, amax


def quantize_rows_placed_triton(x_hp: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, multiple: int,
                                gather_index: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the Triton kernel (the op's outputs)."""
    launch, rows_fp8, x_t_fp8, amax = plan_quantize_rows_placed(x_hp, scale, offsets, multiple, gather_index)
    if x_t_fp8.numel():
        launch()
    return rows_fp8, x_t_fp8, amax


def _rows_reference(x_hp, scale, offsets, multiple, gather_index):
    _checked(x_hp, offsets, gather_index, scale)
    rows_hp = (x_hp if gather_index is None else x_hp[gather_index]).contiguous()
    rows_fp8 = quantize(rows_hp, scale.reshape(()), _FP8)
    return rows_fp8, layout_reference(rows_fp8, offsets, multiple), group_block_amax(rows_hp, offsets, _BLOCK_COLUMNS)


@torch.library.custom_op("fp8graph::quantize_rows_placed", mutates_args=())
def quantize_rows_placed(x_hp: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, multiple: int,
                         gather_index: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows ``x_hp`` (S, C) (``x_hp[gather_index]`` with ``gather_index``), sorted into the groups ``offsets``
    (E,) ends, cast to E4M3 with the one ``scale`` and written twice: as rows, and laid out as
    :func:`quantize_group_columns_placed` lays them out. Returns ``(rows_fp8 (S, C), x_t_fp8 (C, P), amax (E + 1,
    B))``, ``amax`` the largest finite magnitude of each group's blocks of 64 columns (:func:`column_blocks`; the
    last row the rows' in no group), whose max is the rows' amax. Per-tensor scaling's gathered input: the forward
    GEMM reads the rows, grad_weight's the layout, and one read of the rows writes both (and the amaxes delayed
    scaling records). ``gather_index`` must hold row indices of ``x_hp``: unchecked, as a check would wait for the
    device."""
    return _rows_reference(x_hp, scale, offsets, multiple, gather_index)


@quantize_rows_placed.register_fake
def _(x_hp, scale, offsets, multiple, gather_index=None):
    _checked(x_hp, offsets, gather_index, scale)
    rows = x_hp.shape[0] if gather_index is None else gather_index.shape[0]
    padded_rows = padded_group_bound(rows, offsets.shape[0], multiple)
    return (x_hp.new_empty((rows, x_hp.shape[1]), dtype=_FP8),
            x_hp.new_empty((x_hp.shape[1], padded_rows), dtype=_FP8),
            x_hp.new_empty((offsets.shape[0] + 1, column_blocks(x_hp.shape[1])), dtype=torch.float32))


@quantize_rows_placed.register_kernel("cuda")
def _(x_hp, scale, offsets, multiple, gather_index=None):
    if not triton_available():
        return _rows_reference(x_hp, scale, offsets, multiple, gather_index)
    return quantize_rows_placed_triton(x_hp, scale, offsets, multiple, gather_index)


def _weighted_checked(x_hp, row_weights, other_hp, scale, offsets, gather_index,
                      name: str = "quantize_weighted_rows_placed") -> None:
    """The operands of ``name``, one of the two ops that cast weighted rows (``scale`` a tensor's, or None)."""
    _checked(x_hp, offsets, gather_index, scale, weighted=True, name=name)
    rows = x_hp.shape[0] if gather_index is None else gather_index.shape[0]
    if row_weights.shape != (rows,) or not row_weights.dtype.is_floating_point or row_weights.device != x_hp.device:
        raise ValueError(f"{name} takes one floating-point weight a row ({rows}) on "
                         f"{x_hp.device}, got {row_weights.dtype} of shape {tuple(row_weights.shape)} on "
                         f"{row_weights.device}")
    if other_hp is not None and (other_hp.shape != (rows, x_hp.shape[1]) or not other_hp.dtype.is_floating_point
                                 or other_hp.device != x_hp.device):
        raise ValueError(f"{name}'s other rows are ({rows}, {x_hp.shape[1]}) on {x_hp.device}, "
                         f"got {other_hp.dtype} of shape {tuple(other_hp.shape)} on {other_hp.device}")


def plan_quantize_weighted_rows_placed(x_hp: torch.Tensor, row_weights: torch.Tensor, other_hp: torch.Tensor | None,
                                       scale: torch.Tensor, offsets: torch.Tensor, multiple: int,
                                       gather_index: torch.Tensor | None = None, layout: bool = True):
    """The launch that writes ``fp8graph::quantize_weighted_rows_placed``'s outputs, and ``(rows_fp8, x_t_fp8,
    amax, dot_partials (B, S) or None)``: the op's dots are the partials' sums over the blocks."""
    _weighted_checked(x_hp, row_weights, other_hp, scale, offsets, gather_index)
    launch, x_t_fp8, rows_fp8, amax, dots = _plan(x_hp, offsets, multiple, gather_index, scale.reshape(()), False,
                                                  row_weights, other_hp, layout=layout)
    return launch, rows_fp8, x_t_fp8, amax, dots


def quantize_weighted_rows_placed_triton(x_hp, row_weights, other_hp, scale, offsets, multiple, gather_index=None,
                                         layout=True):
    """Run the Triton kernel (the op's outputs)."""
    launch, rows_fp8, x_t_fp8, amax, dots = plan_quantize_weighted_rows_placed(
        x_hp, row_weights, other_hp, scale, offsets, multiple, gather_index, layout)
    if x_hp.shape[1]:  # with columns the amaxes are written even where no row is (zeros)
        launch()
    # Without columns the partials are (0, S): their sums are S zeros.
    return rows_fp8, x_t_fp8, amax, dots.sum(dim=0) if dots is not None else x_hp.new_empty((0,), dtype=torch.float32)


def weighted_rows_reference(x_hp: torch.Tensor, row_weights: torch.Tensor, other_hp: torch.Tensor | None,
                            gather_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows (S, C), dots (S,) or (0,))`` in fp32: the gathered rows each times its weight, and each gathered
    row's dot product with ``other_hp``'s (the products of two BF16 values are exact in fp32), none without it."""
    rows_hp = (x_hp if gather_index is None else x_hp[gather_index]).to(torch.float32)
    dots = (rows_hp * other_hp.to(torch.float32)).sum(dim=1) if other_hp is not None else rows_hp.new_empty((0,))
    return rows_hp * row_weights.to(torch.float32)[:, None], dots


def _weighted_reference(x_hp, row_weights, other_hp, scale, offsets, multiple, gather_index, layout=True):
    _weighted_checked(x_hp, row_weights, other_hp, scale, offsets, gather_index)
    rows, dots = weighted_rows_reference(x_hp, row_weights, other_hp, gather_index)
    rows_fp8 = quantize(rows, scale.reshape(()), _FP8)
    return (rows_fp8, layout_reference(rows_fp8, offsets, multiple, layout),
            group_block_amax(rows, offsets, _BLOCK_COLUMNS), dots)


@torch.library.custom_op("fp8graph::quantize_weighted_rows_placed", mutates_args=())
def quantize_weighted_rows_placed(x_hp: torch.Tensor, row_weights: torch.Tensor, other_hp: torch.Tensor | None,
                                  scale: torch.Tensor, offsets: torch.Tensor, multiple: int,
                                  gather_index: torch.Tensor | None = None, layout: bool = True
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows ``x_hp[gather_index]`` (S, C) (``x_hp`` without an index), each multiplied by its ``row_weights``
    (S,) in fp32, cast and laid out as :func:`quantize_rows_placed` casts and lays out its rows; and each gathered
    row's dot product with the same row of ``other_hp`` (S, C), before the weight, in fp32. Returns ``(rows_fp8
    (S, C), x_t_fp8 (C, P), amax (E + 1, B), dots (S,))``, ``amax`` of the weighted rows; without ``other_hp``
    (nothing needs the dots) ``dots`` is empty and ``other_hp`` is not read. Without ``layout`` (no grad_weight
    GEMM reads it) ``x_t_fp8`` is (C, 0): nothing is laid out. ``gather_index`` must hold row indices of ``x_hp``:
    unchecked, as a check would wait for the device."""
    return _weighted_reference(x_hp, row_weights, other_hp, scale, offsets, multiple, gather_index, layout)


@quantize_weighted_rows_placed.register_fake
def _(x_hp, row_weights, other_hp, scale, offsets, multiple, gather_index=None, layout=True):
    _weighted_checked(x_hp, row_weights, other_hp, scale, offsets, gather_index)
    rows = x_hp.shape[0] if gather_index is None else gather_index.shape[0]
    padded_rows = layout_rows(rows, offsets.shape[0], multiple, layout)
    return (x_hp.new_empty((rows, x_hp.shape[1]), dtype=_FP8),
            x_hp.new_empty((x_hp.shape[1], padded_rows), dtype=_FP8),
            x_hp.new_empty((offsets.shape[0] + 1, column_blocks(x_hp.shape[1])), dtype=torch.float32),
            x_hp.new_empty((rows if other_hp is not None else 0,), dtype=torch.float32))


@quantize_weighted_rows_placed.register_kernel("cuda")
def _(x_hp, row_weights, other_hp, scale, offsets, multiple, gather_index=None, layout=True):
    if not triton_available():
        return _weighted_reference(x_hp, row_weights, other_hp, scale, offsets, multiple, gather_index, layout)
    return quantize_weighted_rows_placed_triton(x_hp, row_weights, other_hp, scale, offsets, multiple, gather_index,
                                                layout)


def _weighted_rowwise_checked(x_hp, row_weights, other_hp, row_scale, offsets, gather_index) -> None:
    name = "quantize_weighted_rows_rowwise"
    _weighted_checked(x_hp, row_weights, other_hp, None, offsets, gather_index, name)
    rows = row_weights.shape[0]
    if row_scale.shape != (rows,) or row_scale.dtype != torch.float32 or row_scale.device != x_hp.device:
        raise ValueError(f"{name}'s row_scale is one float32 scale a row ({rows}) on {x_hp.device}, got "
                         f"{row_scale.dtype} of shape {tuple(row_scale.shape)} on {row_scale.device}")


def plan_quantize_weighted_rows_rowwise(x_hp: torch.Tensor, row_weights: torch.Tensor, other_hp: torch.Tensor | None,
                                        row_scale: torch.Tensor, offsets: torch.Tensor, multiple: int,
                                        power_2_scales: bool, gather_index: torch.Tensor | None = None,
                                        layout: bool = True):
    """The launch that writes ``fp8graph::quantize_weighted_rows_rowwise``'s outputs, and ``(rows_fp8, x_t_fp8,
    scale (E, C), dot_partials (B, S) or None)``: the op's dots are the partials' sums over the blocks."""
    _weighted_rowwise_checked(x_hp, row_weights, other_hp, row_scale, offsets, gather_index)
    launch, x_t_fp8, rows_fp8, scale, dots = _plan(x_hp, offsets, multiple, gather_index, None, power_2_scales,
                                                   row_weights, other_hp, row_scales=row_scale, layout=layout)
    return launch, rows_fp8, x_t_fp8, scale, dots


def quantize_weighted_rows_rowwise_triton(x_hp, row_weights, other_hp, row_scale, offsets, multiple, power_2_scales,
                                          gather_index=None, layout=True):
    """Run the Triton kernel (the op's outputs)."""
    launch, rows_fp8, x_t_fp8, scale, dots = plan_quantize_weighted_rows_rowwise(
        x_hp, row_weights, other_hp, row_scale, offsets, multiple, power_2_scales, gather_index, layout)
    if x_t_fp8.shape[0]:  # with columns the scales are written even where no row is
        launch()
    return rows_fp8, x_t_fp8, scale, dots.sum(dim=0) if dots is not None else x_hp.new_empty((0,), dtype=torch.float32)


def _weighted_rowwise_reference(x_hp, row_weights, other_hp, row_scale, offsets, multiple, power_2_scales,
                                gather_index, layout=True):
    _weighted_rowwise_checked(x_hp, row_weights, other_hp, row_scale, offsets, gather_index)
    rows, dots = weighted_rows_reference(x_hp, row_weights, other_hp, gather_index)
    rows_fp8 = quantize(rows, row_scale[:, None], _FP8)
    if not layout:
        no_scales = rows.new_empty((offsets.shape[0], 0))
        return rows_fp8, layout_reference(rows_fp8, offsets, multiple, False), no_scales, dots
    x_fp8, scale = quantize_group_columns(rows, offsets, _FP8, power_2_scales)
    return rows_fp8, layout_reference(x_fp8, offsets, multiple), scale, dots


@torch.library.custom_op("fp8graph::quantize_weighted_rows_rowwise", mutates_args=())
def quantize_weighted_rows_rowwise(x_hp: torch.Tensor, row_weights: torch.Tensor, other_hp: torch.Tensor | None,
                                   row_scale: torch.Tensor, offsets: torch.Tensor, multiple: int, power_2_scales: bool,
                                   gather_index: torch.Tensor | None = None, layout: bool = True
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows ``x_hp[gather_index]`` (S, C) (``x_hp`` without an index), each multiplied by its ``row_weights``
    (S,) in fp32, cast to E4M3 twice, as row-wise scaling's two GEMMs read them: each row with its own
    ``row_scale`` (S,), stored as rows (grad_input's GEMM reduces along C), and with one scale per group and column
    laid out as :func:`quantize_group_columns_placed` lays out its cast (grad_weight's reduces over each group's
    rows); and each gathered row's dot product with the same row of ``other_hp`` (S, C), before the weight, in
    fp32. Returns ``(rows_fp8 (S, C), x_t_fp8 (C, P), scale (E, C), dots (S,))``; without ``other_hp`` ``dots`` is
    empty and ``other_hp`` is not read. A row's scale needs all of its columns, which no program of the kernel
    sees: the caller makes it (the experts' combine: from each token's gradient amax and the row's weight,
    ``fp8graph.targets.grouped``). Without ``layout`` (no grad_weight GEMM reads it) the rows alone are cast,
    from one read: ``x_t_fp8`` is (C, 0) and ``scale`` (E, 0). ``gather_index`` must hold row indices of ``x_hp``:
    unchecked, as a check would wait for the device."""
    return _weighted_rowwise_reference(x_hp, row_weights, other_hp, row_scale, offsets, multiple, power_2_scales,
                                       gather_index, layout)


@quantize_weighted_rows_rowwise.register_fake
def _(x_hp, row_weights, other_hp, row_scale, offsets, multiple, power_2_scales, gather_index=None, layout=True):
    _weighted_rowwise_checked(x_hp, row_weights, other_hp, row_scale, offsets, gather_index)
    rows = row_weights.shape[0]
    padded_rows = layout_rows(rows, offsets.shape[0], multiple, layout)
    return (x_hp.new_empty((rows, x_hp.shape[1]), dtype=_FP8),
            x_hp.new_empty((x_hp.shape[1], padded_rows), dtype=_FP8),
            x_hp.new_empty((offsets.shape[0], x_hp.shape[1] if layout else 0), dtype=torch.float32),
            x_hp.new_empty((rows if other_hp is not None else 0,), dtype=torch.float32))


@quantize_weighted_rows_rowwise.register_kernel("cuda")
def _(x_hp, row_weights, other_hp, row_scale, offsets, multiple, power_2_scales, gather_index=None, layout=True):
    if not triton_available():
        return _weighted_rowwise_reference(x_hp, row_weights, other_hp, row_scale, offsets, multiple, power_2_scales,
                                           gather_index, layout)
    return quantize_weighted_rows_rowwise_triton(x_hp, row_weights, other_hp, row_scale, offsets, multiple,
                                                 power_2_scales, gather_index, layout)
