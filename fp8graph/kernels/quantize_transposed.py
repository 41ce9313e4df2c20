"""``fp8graph::quantize_transposed``: a batch of matrices cast to E4M3, a scale a matrix, and stored transposed.

Why an op of its own: grad_input's grouped GEMM reads each expert's weight (N, K) with N contiguous, the
transpose of the forward's layout. Unless the recipe saves its transposes, the backward casts it again from the
weight with the forward's scales (``fp8graph.targets.grouped``), so that no FP8 copy of the experts' weights is
kept from forward to backward. Written in the graph, the cast and its transposed store are a pointwise kernel of
Inductor's that reads the weight (2 bytes an element) and writes the copy a tile at a time; this op is that
kernel written for the one job, as ``fp8graph::transpose_fp8`` (which reads FP8 bytes already cast) is for the
transposes of delayed casts: one read of the weight, one write of the transposed bytes.

A transposed view (a weight stored (E, K, N) and read as (E, N, K)) is read as it lies: its rows are
contiguous, and so are the stores.

On CUDA it runs ``quantize_transposed_kernel`` (``_quantize_transposed_triton``); everywhere else, and where
Triton is missing, ``quantize(x, scale).transpose(-2, -1)``'s contiguous copy, which the tests hold the kernel to
bit for bit.
"""

from __future__ import annotations

import torch

from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available
from fp8graph.numerics.formats import fp8_max
from fp8graph.numerics.quantize import quantize

__all__ = ["plan_quantize_transposed", "quantize_transposed", "quantize_transposed_triton"]

_FP8 = torch.float8_e4m3fn  # a grouped GEMM takes E4M3 only
_BLOCK = 64  # 128 bytes of a BF16 row a load; 64-byte runs of a transposed FP8 row a store
_NUM_WARPS = 4
_MAX_GRID = 65535  # a CUDA grid's second and third axes: column tiles, matrices


def _checked(x_hp: torch.Tensor, scale: torch.Tensor) -> None:
    if x_hp.dim() not in (2, 3) or not x_hp.dtype.is_floating_point or x_hp.element_size() == 1:
        raise ValueError("quantize_transposed casts a 2-D high-precision tensor (or a batch of them, (B, R, C)), "
                         f"got {x_hp.dtype} of shape {tuple(x_hp.shape)}")
    batch = x_hp.shape[0] if x_hp.dim() == 3 else 1
    if scale.numel() != batch or scale.dtype != torch.float32 or scale.device != x_hp.device:
        raise ValueError(f"quantize_transposed's scale is {batch} float32 value(s) on {x_hp.device}, one a matrix, "
                         f"got {scale.dtype} of shape {tuple(scale.shape)} on {scale.device}")
    if batch > _MAX_GRID or -(-x_hp.shape[-1] // _BLOCK) > _MAX_GRID:
        raise ValueError(f"quantize_transposed takes at most {_MAX_GRID} matrices of at most {_MAX_GRID * _BLOCK} "
                         f"columns (the kernel's grid), got shape {tuple(x_hp.shape)}")


def _transposed_shape(x_hp: torch.Tensor) -> tuple[int, ...]:
    return (*x_hp.shape[:-2], x_hp.shape[-1], x_hp.shape[-2])


def plan_quantize_transposed(x_hp: torch.Tensor, scale: torch.Tensor) -> tuple[KernelLaunch, torch.Tensor]:
    """The launch that writes ``quantize(x_hp, scale).transpose(-2, -1).contiguous()`` (matrix ``b`` of a 3-D
    ``x_hp`` scaled by ``scale.flatten()[b]``), and that output."""
    from triton import cdiv, knobs

    from fp8graph.kernels._quantize_transposed_triton import quantize_transposed_kernel

    _checked(x_hp, scale)
    batch = x_hp.shape[0] if x_hp.dim() == 3 else 1
    rows, columns = x_hp.shape[-2:]
    out = torch.empty(_transposed_shape(x_hp), dtype=_FP8, device=x_hp.device)
    launch = KernelLaunch(quantize_transposed_kernel, (cdiv(rows, _BLOCK), cdiv(columns, _BLOCK), batch),
                          (x_hp, scale.reshape(-1).contiguous(), out.view(torch.uint8), rows, columns,
                           x_hp.stride(-2), x_hp.stride(-1), x_hp.stride(0) if x_hp.dim() == 3 else 0),
                          {"FP8_MAX": fp8_max(_FP8),
                           # The interpreter's own FP8 conversion is not the GPU's: round in software there.
                           "SOFTWARE_ROUNDING": bool(knobs.runtime.interpret),
                           "BLOCK_ROWS": _BLOCK, "BLOCK_COLUMNS": _BLOCK, "num_warps": _NUM_WARPS})
    return launch, out


def quantize_transposed_triton(x_hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Run the Triton kernel (the op's output)."""
    launch, x_t_fp8 = plan_quantize_transposed(x_hp, scale)
    if x_t_fp8.numel():
        launch()
    return x_t_fp8


def _reference(x_hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _checked(x_hp, scale)
    matrix_scale = scale.reshape(-1, 1, 1) if x_hp.dim() == 3 else scale.reshape(())
    return quantize(x_hp, matrix_scale, _FP8).transpose(-2, -1).clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("fp8graph::quantize_transposed", mutates_args=())
def quantize_transposed(x_hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``quantize(x_hp, scale, float8_e4m3fn).transpose(-2, -1).contiguous()``: the (C, R) E4M3 copy of an (R, C)
    high-precision matrix cast with ``scale`` (one float32 value), or of each matrix of a (B, R, C) batch cast
    with its own of ``scale``'s B values: (B, C, R)."""
    return _reference(x_hp, scale)


@quantize_transposed.register_fake
def _(x_hp, scale):
    _checked(x_hp, scale)
    return x_hp.new_empty(_transposed_shape(x_hp), dtype=_FP8)


@quantize_transposed.register_kernel("cuda")
def _(x_hp, scale):
    if not triton_available():
        return _reference(x_hp, scale)
    return quantize_transposed_triton(x_hp, scale)
