"""SwiGLU's backward between two expert GEMMs, cast for the first GEMM's backward by one kernel: four ops.

A mixture of experts' expert MLP computes ``gate, up = gate_up.chunk(2, -1)``, ``h = silu(gate) * up`` between
its two grouped GEMMs. The gradient of ``gate_up`` (S, 2I), ``cat(grad_gate, grad_up)``, is the first GEMM's
grad_output: its grad_input GEMM reads it as rows, its grad_weight GEMM laid out with each group zero-padded
(``fp8graph.gemm.grouped_gemm``). Left to Inductor, one kernel computes it inside a reduction for its amax, its
cast stores the rows, and ``fp8graph::transpose_fp8`` reads them again to lay them out; the reduction over the
concatenation loads both halves' operands under masks for every element (on the H200 it ran at about 1 TB/s,
bench/results/moe-2026-11-27T132818Z.json).

``fp8graph::swiglu_backward_placed(gate_up_hp, grad_h_hp, scale, offsets, multiple)``: one read of ``gate_up``
and ``grad_h``, the gradient computed in fp32, cast with the one ``scale`` and stored as rows and in the placed
layout, with each group's amaxes (what delayed scaling records). ``fp8graph::swiglu_backward_amax(gate_up_hp,
grad_h_hp, offsets)``: the same amaxes alone, for current scaling, whose scale needs them before the cast.

Row-wise scaling casts the gradient twice, a scale a row for grad_input's GEMM and a scale a group and column for
grad_weight's: ``fp8graph::swiglu_backward_rowwise_amax(gate_up_hp, grad_h_hp, offsets)``, each row's and each
group's columns' amaxes from one read, then ``fp8graph::swiglu_backward_rowwise(gate_up_hp, grad_h_hp, row_scale,
column_scale, offsets, multiple)``, the rows and the layout from a second (the kernel above, ``ROWWISE``). Left
to Inductor and autograd, a reduction computes the gradient, stores it in BF16 and casts its rows, and
``fp8graph::quantize_group_columns_placed`` reads the BF16 gradient twice more.

On CUDA they run ``_swiglu_backward_triton``; elsewhere, and where Triton is missing, the references (the
gradient in torch ops, the cast, the padded transpose). The gradient's fp32 arithmetic is the same formula in both
(``sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))`` for silu's derivative), but their sigmoids may differ in the
last bit: the tests hold the kernel to the reference within one E4M3 step, and to its own rows in the layout
byte for byte.
"""

from __future__ import annotations

import torch

from fp8graph.kernels.group_columns import checked_groups, layout_reference, layout_rows
from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available
from fp8graph.numerics.formats import fp8_max
from fp8graph.numerics.groups import group_block_amax, group_column_amax, padded_group_bound, row_groups
from fp8graph.numerics.quantize import finite_magnitude, quantize

__all__ = ["amax_blocks", "plan_swiglu_backward", "plan_swiglu_backward_rowwise", "swiglu_backward_amax",
           "swiglu_backward_placed", "swiglu_backward_reference", "swiglu_backward_rowwise",
           "swiglu_backward_rowwise_amax"]

_FP8 = torch.float8_e4m3fn  # a grouped GEMM takes E4M3 only
_BLOCK_ROWS = 32  # 64 x 64 blocks of both halves spill registers at 4 warps (docs/benchmarks.md)
_BLOCK_COLUMNS = 64  # 128 bytes of a BF16 row a load
_NUM_WARPS = 4
_MAX_GROUPS = 1024  # every group's bounds are loaded by each program at once


def amax_blocks(width: int) -> int:
    """The amaxes a group's row holds: one a block of 64 columns of each half of the (S, 2 ``width``) gradient."""
    return 2 * -(-width // _BLOCK_COLUMNS)


def _checked(name: str, gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor, offsets: torch.Tensor,
             scale: torch.Tensor | None = None) -> None:
    for label, x in (("gate_up_hp", gate_up_hp), ("grad_h_hp", grad_h_hp)):
        if x.dim() != 2 or not x.dtype.is_floating_point or x.element_size() == 1:
            raise ValueError(f"{name}'s {label} is a 2-D high-precision tensor, got {x.dtype} of shape "
                             f"{tuple(x.shape)}")
    if gate_up_hp.shape != (grad_h_hp.shape[0], 2 * grad_h_hp.shape[1]) or gate_up_hp.device != grad_h_hp.device:
        raise ValueError(f"{name} takes gate_up_hp (S, 2 I) and grad_h_hp (S, I) on one device, got "
                         f"{tuple(gate_up_hp.shape)} on {gate_up_hp.device} and {tuple(grad_h_hp.shape)} on "
                         f"{grad_h_hp.device}")
    checked_groups(name, offsets, scale, gate_up_hp.device, _MAX_GROUPS)


def swiglu_backward_reference(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor) -> torch.Tensor:
    """``cat(grad_gate, grad_up)`` (S, 2I) in fp32, for ``h = silu(gate) * up``, ``gate, up = gate_up.chunk(2, -1)``."""
    gate, up = gate_up_hp.float().chunk(2, dim=-1)
    grad_h = grad_h_hp.float()
    sigmoid = torch.sigmoid(gate)
    return torch.cat([grad_h * up * (sigmoid * (1.0 + gate * (1.0 - sigmoid))), grad_h * (gate * sigmoid)], dim=-1)


def _blocked_amax(grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each group's (and the rows in no group's) largest finite magnitude a block of 64 columns of each half:
    (E + 1, :func:`amax_blocks`)."""
    return torch.cat([group_block_amax(half, offsets, _BLOCK_COLUMNS) for half in grad.chunk(2, dim=-1)], dim=1)


def _amax_reference(gate_up_hp, grad_h_hp, offsets):
    _checked("swiglu_backward_amax", gate_up_hp, grad_h_hp, offsets)
    return _blocked_amax(swiglu_backward_reference(gate_up_hp, grad_h_hp), offsets)


def _placed_reference(gate_up_hp, grad_h_hp, scale, offsets, multiple, layout=True):
    _checked("swiglu_backward_placed", gate_up_hp, grad_h_hp, offsets, scale)
    grad = swiglu_backward_reference(gate_up_hp, grad_h_hp)
    rows_fp8 = quantize(grad, scale.reshape(()), _FP8)
    return rows_fp8, layout_reference(rows_fp8, offsets, multiple, layout), _blocked_amax(grad, offsets)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def _launch(gate_up_hp, grad_h_hp, offsets, multiple, padded_rows, outputs, amax, column_table, cast: bool,
            rowwise: bool, layout: bool = True) -> KernelLaunch:
    """The kernel's launch: ``outputs`` its ``(scale, rows_fp8, placed)`` pointers, a program a group (and the rows
    in no group) and block of 64 columns of each half; without ``layout`` the cast stores the rows alone."""
    from triton import cdiv, knobs, next_power_of_2

    from fp8graph.kernels._swiglu_backward_triton import swiglu_backward_placed_kernel

    rows, width = grad_h_hp.shape
    groups = offsets.shape[0]
    return KernelLaunch(
        swiglu_backward_placed_kernel, (groups + 1, cdiv(width, _BLOCK_COLUMNS)),
        (gate_up_hp, grad_h_hp, offsets.contiguous(), *outputs, amax, column_table, rows, width, padded_rows,
         gate_up_hp.stride(0), grad_h_hp.stride(0), groups),
        {"MULTIPLE": multiple, "BLOCK_GROUPS": max(next_power_of_2(groups), 16), "BLOCK_ROWS": _BLOCK_ROWS,
         "BLOCK_COLUMNS": _BLOCK_COLUMNS, "FP8_MAX": fp8_max(_FP8),
         # The interpreter's own FP8 conversion is not the GPU's: round in software there.
         "SOFTWARE_ROUNDING": bool(knobs.runtime.interpret), "CAST": cast, "ROWWISE": rowwise, "LAYOUT": layout,
         "num_warps": _NUM_WARPS})


def plan_swiglu_backward(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor, offsets: torch.Tensor,
                         scale: torch.Tensor | None = None, multiple: int = 16, layout: bool = True):
    """The kernel's launch and outputs: with ``scale``, ``(launch, rows_fp8 (S, 2I), placed (2I, P), amax)``, the
    cast (``placed`` (2I, 0) without ``layout``); without, ``(launch, amax)``, the amaxes alone."""
    name = "swiglu_backward_amax" if scale is None else "swiglu_backward_placed"
    _checked(name, gate_up_hp, grad_h_hp, offsets, scale)
    gate_up_hp, grad_h_hp = _rows_contiguous(gate_up_hp), _rows_contiguous(grad_h_hp)
    rows, width = grad_h_hp.shape
    groups = offsets.shape[0]
    device = gate_up_hp.device
    amax = torch.empty((groups + 1, amax_blocks(width)), dtype=torch.float32, device=device)
    cast = scale is not None
    padded_rows = padded_group_bound(rows, groups, multiple)
    rows_fp8 = torch.empty((rows, 2 * width), dtype=_FP8, device=device) if cast else None
    placed = torch.empty((2 * width, padded_rows if layout else 0), dtype=_FP8, device=device) if cast else None
    # Without a cast the amax table's pointer stands in for the outputs the kernel does not write, and for the
    # column table, which only row-wise reads or writes.
    outputs = (scale.reshape(()), rows_fp8.view(torch.uint8), placed.view(torch.uint8)) if cast else (amax,) * 3
    launch = _launch(gate_up_hp, grad_h_hp, offsets, multiple, padded_rows, outputs, amax, amax, cast, False,
                     layout)
    return (launch, rows_fp8, placed, amax) if cast else (launch, amax)


def _rowwise_checked(name: str, gate_up_hp, grad_h_hp, offsets, row_scale=None, column_scale=None) -> None:
    _checked(name, gate_up_hp, grad_h_hp, offsets)
    rows, width = grad_h_hp.shape
    for label, scale, shape in (("row_scale", row_scale, (rows,)),
                                ("column_scale", column_scale, (offsets.shape[0] + 1, 2 * width))):
        if scale is not None and (scale.shape != shape or scale.dtype != torch.float32
                                  or scale.device != gate_up_hp.device):
            raise ValueError(f"{name}'s {label} is a float32 tensor of shape {shape} on {gate_up_hp.device}, got "
                             f"{scale.dtype} of shape {tuple(scale.shape)} on {scale.device}")


def plan_swiglu_backward_rowwise(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor, offsets: torch.Tensor,
                                 scales: tuple[torch.Tensor, torch.Tensor] | None = None, multiple: int = 16,
                                 layout: bool = True):
    """The row-wise launches and outputs: with ``scales``, ``(row_scale (S,), column_scale (E + 1, 2I))``,
    ``(launch, rows_fp8 (S, 2I), placed (2I, P))``, the casts (``placed`` (2I, 0) without ``layout``); without,
    ``(launch, row_partials (B, S), column_amax (E + 1, 2I))``, the amaxes (a row's is the max of its partials, one
    a block of 64 columns)."""
    name = "swiglu_backward_rowwise_amax" if scales is None else "swiglu_backward_rowwise"
    _rowwise_checked(name, gate_up_hp, grad_h_hp, offsets, *(scales or ()))
    gate_up_hp, grad_h_hp = _rows_contiguous(gate_up_hp), _rows_contiguous(grad_h_hp)
    rows, width = grad_h_hp.shape
    groups = offsets.shape[0]
    device = gate_up_hp.device
    padded_rows = padded_group_bound(rows, groups, multiple)
    if scales is None:
        row_partials = torch.empty((-(-width // _BLOCK_COLUMNS), rows), dtype=torch.float32, device=device)
        column_amax = torch.empty((groups + 1, 2 * width), dtype=torch.float32, device=device)
        # The partials' pointer stands in for the outputs the kernel does not write.
        launch = _launch(gate_up_hp, grad_h_hp, offsets, multiple, padded_rows, (row_partials,) * 3, row_partials,
                         column_amax, False, True)
        return launch, row_partials, column_amax
    row_scale, column_scale = (scale.contiguous() for scale in scales)
    rows_fp8 = torch.empty((rows, 2 * width), dtype=_FP8, device=device)
    placed = torch.empty((2 * width, padded_rows if layout else 0), dtype=_FP8, device=device)
    # The cast stores no amaxes: the row scales' pointer stands in for their table.
    launch = _launch(gate_up_hp, grad_h_hp, offsets, multiple, padded_rows,
                     (row_scale, rows_fp8.view(torch.uint8), placed.view(torch.uint8)), row_scale, column_scale,
                     True, True, layout)
    return launch, rows_fp8, placed


def swiglu_backward_amax_triton(gate_up_hp, grad_h_hp, offsets):
    """Run the Triton kernel without the cast (the amax op's output; no columns: no program, and nothing to write)."""
    launch, amax = plan_swiglu_backward(gate_up_hp, grad_h_hp, offsets)
    if grad_h_hp.shape[1]:
        launch()
    return amax


def swiglu_backward_placed_triton(gate_up_hp, grad_h_hp, scale, offsets, multiple, layout=True):
    """Run the Triton kernel with the cast (the op's outputs; no columns: no program, and nothing to write)."""
    launch, rows_fp8, placed, amax = plan_swiglu_backward(gate_up_hp, grad_h_hp, offsets, scale, multiple, layout)
    if grad_h_hp.shape[1]:
        launch()
    return rows_fp8, placed, amax


@torch.library.custom_op("fp8graph::swiglu_backward_amax", mutates_args=())
def swiglu_backward_amax(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of SwiGLU's input gradient (``h = silu(gate) * up``, ``gate, up =
    gate_up_hp.chunk(2, -1)``, ``grad_h_hp`` h's gradient) for each group of rows ``offsets`` (E,) ends and block of
    64 columns of each half: (E + 1, :func:`amax_blocks`), the last row the rows' in no group, the gate half's
    blocks first. Their max is the gradient's amax."""
    return _amax_reference(gate_up_hp, grad_h_hp, offsets)


@swiglu_backward_amax.register_fake
def _(gate_up_hp, grad_h_hp, offsets):
    _checked("swiglu_backward_amax", gate_up_hp, grad_h_hp, offsets)
    return gate_up_hp.new_empty((offsets.shape[0] + 1, amax_blocks(grad_h_hp.shape[1])), dtype=torch.float32)


@swiglu_backward_amax.register_kernel("cuda")
def _(gate_up_hp, grad_h_hp, offsets):
    if not triton_available():
        return _amax_reference(gate_up_hp, grad_h_hp, offsets)
    return swiglu_backward_amax_triton(gate_up_hp, grad_h_hp, offsets)


@torch.library.custom_op("fp8graph::swiglu_backward_placed", mutates_args=())
def swiglu_backward_placed(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor, scale: torch.Tensor,
                           offsets: torch.Tensor, multiple: int, layout: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU's input gradient (S, 2I) (as :func:`swiglu_backward_amax` takes it) cast to E4M3 with the one
    ``scale`` and written twice, as rows and laid out for a grouped grad_weight GEMM (each group of ``offsets``
    zero-padded to ``multiple`` rows, as ``fp8graph::quantize_rows_placed`` lays out): ``(rows_fp8 (S, 2I),
    placed (2I, P), amax (E + 1, B))``, ``amax`` as :func:`swiglu_backward_amax`'s. Without ``layout`` (no
    grad_weight GEMM reads it) ``placed`` is (2I, 0): the rows alone are stored."""
    return _placed_reference(gate_up_hp, grad_h_hp, scale, offsets, multiple, layout)


@swiglu_backward_placed.register_fake
def _(gate_up_hp, grad_h_hp, scale, offsets, multiple, layout=True):
    _checked("swiglu_backward_placed", gate_up_hp, grad_h_hp, offsets, scale)
    rows, width = grad_h_hp.shape
    return (gate_up_hp.new_empty((rows, 2 * width), dtype=_FP8),
            gate_up_hp.new_empty((2 * width, layout_rows(rows, offsets.shape[0], multiple, layout)), dtype=_FP8),
            gate_up_hp.new_empty((offsets.shape[0] + 1, amax_blocks(width)), dtype=torch.float32))


@swiglu_backward_placed.register_kernel("cuda")
def _(gate_up_hp, grad_h_hp, scale, offsets, multiple, layout=True):
    if not triton_available():
        return _placed_reference(gate_up_hp, grad_h_hp, scale, offsets, multiple, layout)
    return swiglu_backward_placed_triton(gate_up_hp, grad_h_hp, scale, offsets, multiple, layout)


def swiglu_backward_rowwise_amax_triton(gate_up_hp, grad_h_hp, offsets):
    """Run the Triton kernel's row-wise amax walk (the op's outputs; no columns: no program, every amax 0)."""
    launch, row_partials, column_amax = plan_swiglu_backward_rowwise(gate_up_hp, grad_h_hp, offsets)
    if not grad_h_hp.shape[1]:
        return row_partials.new_zeros((grad_h_hp.shape[0],)), column_amax
    launch()
    return row_partials.amax(dim=0), column_amax


def swiglu_backward_rowwise_triton(gate_up_hp, grad_h_hp, row_scale, column_scale, offsets, multiple, layout=True):
    """Run the Triton kernel's row-wise cast (the op's outputs; no columns: no program, and nothing to write)."""
    launch, rows_fp8, placed = plan_swiglu_backward_rowwise(gate_up_hp, grad_h_hp, offsets, (row_scale, column_scale),
                                                            multiple, layout)
    if grad_h_hp.shape[1]:
        launch()
    return rows_fp8, placed


def _rowwise_amax_reference(gate_up_hp, grad_h_hp, offsets):
    _rowwise_checked("swiglu_backward_rowwise_amax", gate_up_hp, grad_h_hp, offsets)
    grad = swiglu_backward_reference(gate_up_hp, grad_h_hp)
    row_amax = (finite_magnitude(grad).amax(dim=1) if grad.shape[1]
                else grad.new_zeros((grad.shape[0],)))
    return row_amax, group_column_amax(grad, offsets)


def _rowwise_reference(gate_up_hp, grad_h_hp, row_scale, column_scale, offsets, multiple, layout=True):
    _rowwise_checked("swiglu_backward_rowwise", gate_up_hp, grad_h_hp, offsets, row_scale, column_scale)
    grad = swiglu_backward_reference(gate_up_hp, grad_h_hp)
    rows_fp8 = quantize(grad, row_scale[:, None], _FP8)
    if not layout:
        return rows_fp8, layout_reference(rows_fp8, offsets, multiple, False)
    grouped_fp8 = quantize(grad, column_scale[row_groups(offsets, grad.shape[0])], _FP8)
    return rows_fp8, layout_reference(grouped_fp8, offsets, multiple)


@torch.library.custom_op("fp8graph::swiglu_backward_rowwise_amax", mutates_args=())
def swiglu_backward_rowwise_amax(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor, offsets: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest finite magnitudes of SwiGLU's input gradient (S, 2I) (as :func:`swiglu_backward_amax` takes
    it) that row-wise scaling's two casts of it need: ``(row_amax (S,), column_amax (E + 1, 2I))``, each row's,
    and each column's over each group of rows ``offsets`` (E,) ends (the last row the rows' in no group)."""
    return _rowwise_amax_reference(gate_up_hp, grad_h_hp, offsets)


@swiglu_backward_rowwise_amax.register_fake
def _(gate_up_hp, grad_h_hp, offsets):
    _rowwise_checked("swiglu_backward_rowwise_amax", gate_up_hp, grad_h_hp, offsets)
    return (gate_up_hp.new_empty((grad_h_hp.shape[0],), dtype=torch.float32),
            gate_up_hp.new_empty((offsets.shape[0] + 1, gate_up_hp.shape[1]), dtype=torch.float32))


@swiglu_backward_rowwise_amax.register_kernel("cuda")
def _(gate_up_hp, grad_h_hp, offsets):
    if not triton_available():
        return _rowwise_amax_reference(gate_up_hp, grad_h_hp, offsets)
    return swiglu_backward_rowwise_amax_triton(gate_up_hp, grad_h_hp, offsets)


@torch.library.custom_op("fp8graph::swiglu_backward_rowwise", mutates_args=())
def swiglu_backward_rowwise(gate_up_hp: torch.Tensor, grad_h_hp: torch.Tensor, row_scale: torch.Tensor,
                            column_scale: torch.Tensor, offsets: torch.Tensor, multiple: int, layout: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's input gradient (S, 2I) (as :func:`swiglu_backward_amax` takes it) cast to E4M3 twice, as row-wise
    scaling's two GEMMs read it: each row with its ``row_scale`` (S,), stored as rows (grad_input's), and each
    group's columns with that group's row of ``column_scale`` (E + 1, 2I) (the last row the rows' in no group),
    laid out for grad_weight as :func:`swiglu_backward_placed` lays out its cast: ``(rows_fp8 (S, 2I), placed (2I,
    P))``. Without ``layout`` (no grad_weight GEMM reads it) ``placed`` is (2I, 0) and ``column_scale`` unread:
    the rows alone are stored."""
    return _rowwise_reference(gate_up_hp, grad_h_hp, row_scale, column_scale, offsets, multiple, layout)


@swiglu_backward_rowwise.register_fake
def _(gate_up_hp, grad_h_hp, row_scale, column_scale, offsets, multiple, layout=True):
    _rowwise_checked("swiglu_backward_rowwise", gate_up_hp, grad_h_hp, offsets, row_scale, column_scale)
    rows, width = grad_h_hp.shape
    return (gate_up_hp.new_empty((rows, 2 * width), dtype=_FP8),
            gate_up_hp.new_empty((2 * width, layout_rows(rows, offsets.shape[0], multiple, layout)), dtype=_FP8))


@swiglu_backward_rowwise.register_kernel("cuda")
def _(gate_up_hp, grad_h_hp, row_scale, column_scale, offsets, multiple, layout=True):
    if not triton_available():
        return _rowwise_reference(gate_up_hp, grad_h_hp, row_scale, column_scale, offsets, multiple, layout)
    return swiglu_backward_rowwise_triton(gate_up_hp, grad_h_hp, row_scale, column_scale, offsets, multiple,
                                          layout)
