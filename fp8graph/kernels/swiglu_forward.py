"""SwiGLU between two expert GEMMs, cast for the second GEMM by the kernel that computes it.

A mixture of experts' expert MLP computes ``gate, up = gate_up.chunk(2, -1)``, ``h = silu(gate) * up`` between
its two grouped GEMMs. ``h`` (S, I) is the down projection's input: its forward GEMM reads it cast as rows, its
grad_weight GEMM laid out with each group zero-padded (``fp8graph.gemm.grouped_gemm``). Left to Inductor, one
kernel computes h from ``gate_up`` and stores its cast rows, and ``fp8graph::transpose_fp8`` reads those again to
lay them out: a pass of its own for the layout.

``fp8graph::swiglu_forward_placed(gate_up_hp, scale, offsets, multiple)``: one read of ``gate_up``, h computed in
fp32, cast with the one ``scale`` and stored as rows and in the placed layout, with each group's amaxes (what
delayed scaling records; current scaling takes its amax before, from a reduction Inductor fuses with SwiGLU).

On CUDA it runs ``_swiglu_forward_triton``; elsewhere, and where Triton is missing, the reference (h in torch ops,
the cast, the padded transpose). Both compute silu as Inductor spells it, ``x / (1 + exp(-x))`` in fp32, and
never round h to BF16 before the cast; their exps may differ in the last bit: the tests hold the kernel to the
reference within one E4M3 step, and to its own rows in the layout byte for byte.
"""

from __future__ import annotations

import torch

from fp8graph.kernels.group_columns import checked_groups, layout_reference, layout_rows
from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available
from fp8graph.numerics.formats import fp8_max
from fp8graph.numerics.groups import group_block_amax, padded_group_bound
from fp8graph.numerics.quantize import quantize

__all__ = ["amax_blocks", "plan_swiglu_forward", "swiglu_forward_placed", "swiglu_reference"]

_FP8 = torch.float8_e4m3fn  # a grouped GEMM takes E4M3 only
_BLOCK_ROWS = 32
_BLOCK_COLUMNS = 64  # 128 bytes of a BF16 row a load
_NUM_WARPS = 4
_MAX_GROUPS = 1024  # every group's bounds are loaded by each program at once


def _checked(gate_up_hp: torch.Tensor, offsets: torch.Tensor, scale: torch.Tensor) -> None:
    name = "swiglu_forward_placed"
    if gate_up_hp.dim() != 2 or not gate_up_hp.dtype.is_floating_point or gate_up_hp.element_size() == 1 \
            or gate_up_hp.shape[1] % 2:
        raise ValueError(f"{name}'s gate_up_hp is a 2-D high-precision tensor of an even width (S, 2 I), got "
                         f"{gate_up_hp.dtype} of shape {tuple(gate_up_hp.shape)}")
    checked_groups(name, offsets, scale, gate_up_hp.device, _MAX_GROUPS)


def swiglu_reference(gate_up_hp: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (S, I) in fp32 of ``gate, up = gate_up_hp.chunk(2, -1)``, silu spelled as Inductor's
    fused kernels spell it."""
    gate, up = gate_up_hp.float().chunk(2, dim=-1)
    return gate / (1.0 + torch.exp(-gate)) * up


def _reference(gate_up_hp, scale, offsets, multiple):
    _checked(gate_up_hp, offsets, scale)
    h = swiglu_reference(gate_up_hp)
    rows_fp8 = quantize(h, scale.reshape(()), _FP8)
    return rows_fp8, layout_reference(rows_fp8, offsets, multiple), group_block_amax(h, offsets, _BLOCK_COLUMNS)


def amax_blocks(width: int) -> int:
    """The amaxes a group's row holds: one a block of 64 columns of h (S, ``width``)."""
    return -(-width // _BLOCK_COLUMNS)


def plan_swiglu_forward(gate_up_hp: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, multiple: int = 16):
    """The kernel's launch and outputs: ``(launch, rows_fp8 (S, I), placed (I, P), amax (E + 1, B))``, a program a
    group (and the rows in no group) and block of 64 columns of h."""
    from triton import cdiv, knobs, next_power_of_2

    from fp8graph.kernels._swiglu_forward_triton import swiglu_forward_placed_kernel

    _checked(gate_up_hp, offsets, scale)
    if gate_up_hp.stride(1) != 1:
        gate_up_hp = gate_up_hp.contiguous()
    rows, width = gate_up_hp.shape[0], gate_up_hp.shape[1] // 2
    groups = offsets.shape[0]
    device = gate_up_hp.device
    padded_rows = padded_group_bound(rows, groups, multiple)
    rows_fp8 = torch.empty((rows, width), dtype=_FP8, device=device)
    placed = torch.empty((width, padded_rows), dtype=_FP8, device=device)
    amax = torch.empty((groups + 1, amax_blocks(width)), dtype=torch.float32, device=device)
    launch = KernelLaunch(
        swiglu_forward_placed_kernel, (groups + 1, cdiv(width, _BLOCK_COLUMNS)),
        (gate_up_hp, offsets.contiguous(), scale.reshape(()), rows_fp8.view(torch.uint8), placed.view(torch.uint8),
         amax, rows, width, padded_rows, gate_up_hp.stride(0), groups),
        {"MULTIPLE": multiple, "BLOCK_GROUPS": max(next_power_of_2(groups), 16), "BLOCK_ROWS": _BLOCK_ROWS,
         "BLOCK_COLUMNS": _BLOCK_COLUMNS, "FP8_MAX": fp8_max(_FP8),
         # The interpreter's own FP8 conversion is not the GPU's: round in software there.
         "SOFTWARE_ROUNDING": bool(knobs.runtime.interpret), "LIBDEVICE_EXP": not knobs.runtime.interpret,
         "num_warps": _NUM_WARPS})
    return launch, rows_fp8, placed, amax


def swiglu_forward_placed_triton(gate_up_hp, scale, offsets, multiple):
    """Run the Triton kernel (the op's outputs; no columns: no program, and nothing to write)."""
    launch, rows_fp8, placed, amax = plan_swiglu_forward(gate_up_hp, scale, offsets, multiple)
    if gate_up_hp.shape[1]:
        launch()
    return rows_fp8, placed, amax


@torch.library.custom_op("fp8graph::swiglu_forward_placed", mutates_args=())
def swiglu_forward_placed(gate_up_hp: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, multiple: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h = silu(gate) * up`` of ``gate, up = gate_up_hp.chunk(2, -1)`` (S, I) cast to E4M3 with the one ``scale``
    and written twice, as rows and laid out for a grouped grad_weight GEMM (each group of ``offsets`` (E,)
    zero-padded to ``multiple`` rows, as ``fp8graph::quantize_rows_placed`` lays out): ``(rows_fp8 (S, I), placed
    (I, P), amax (E + 1, B))``, ``amax`` h's largest finite magnitude a group (the last row the rows' in no group)
    and block of 64 columns. h is never stored in high precision."""
    return _reference(gate_up_hp, scale, offsets, multiple)


@swiglu_forward_placed.register_fake
def _(gate_up_hp, scale, offsets, multiple):
    _checked(gate_up_hp, offsets, scale)
    rows, width = gate_up_hp.shape[0], gate_up_hp.shape[1] // 2
    return (gate_up_hp.new_empty((rows, width), dtype=_FP8),
            gate_up_hp.new_empty((width, layout_rows(rows, offsets.shape[0], multiple)), dtype=_FP8),
            gate_up_hp.new_empty((offsets.shape[0] + 1, amax_blocks(width)), dtype=torch.float32))


@swiglu_forward_placed.register_kernel("cuda")
def _(gate_up_hp, scale, offsets, multiple):
    if not triton_available():
        return _reference(gate_up_hp, scale, offsets, multiple)
    return swiglu_forward_placed_triton(gate_up_hp, scale, offsets, multiple)
