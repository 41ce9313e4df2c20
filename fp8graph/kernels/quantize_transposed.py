"""``fp8graph::quantize_transposed``: a batch of matrices cast to E4M3, a scale a matrix, and stored transposed;
``fp8graph::quantize_both_layouts``: the same cast stored both ways round, with its tiles' amaxes.

Why an op of its own: grad_input's grouped GEMM reads each expert's weight (N, K) with N contiguous, the
transpose of the forward's layout. Unless the recipe saves its transposes, the backward casts it again from the
weight with the forward's scales (``fp8graph.targets.grouped``), so that no FP8 copy of the experts' weights is
kept from forward to backward. Written in the graph, the cast and its transposed store are a pointwise kernel of
Inductor's that reads the weight (2 bytes an element) and writes the copy a tile at a time; this op is that
kernel written for the one job, as ``fp8graph::transpose_fp8`` (which reads FP8 bytes already cast) is for the
transposes of delayed casts: one read of the weight, one write of the transposed bytes.

Where the forward keeps grad_input's layout for the backward (``fp8graph.targets.grouped``), the forward GEMM's
layout and grad_input's are written by one kernel, ``quantize_both_layouts``: one read of the weight for both
copies (and, for delayed scaling's history, the amax of the weight the cast read, a partial a 64 x 64 tile), where
Inductor's kernel would store the second layout a row apart from inside the amax's reduction or a second kernel
read the FP8 bytes again to transpose them.

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
from fp8graph.numerics.quantize import finite_magnitude, quantize

__all__ = ["plan_quantize_transposed", "quantize_both_layouts", "quantize_both_layouts_into_",
           "quantize_both_layouts_triton", "quantize_transposed", "quantize_transposed_triton"]

_FP8 = torch.float8_e4m3fn  # a grouped GEMM takes E4M3 only
_BLOCK = 64  # 128 bytes of a BF16 row a load; 64-byte runs of a transposed FP8 row a store
_NUM_WARPS = 4
_MAX_GRID = 65535  # a CUDA grid's second and third axes: column tiles, matrices


def _checked(x_hp: torch.Tensor, scale: torch.Tensor, op: str = "quantize_transposed") -> None:
    if x_hp.dim() not in (2, 3) or not x_hp.dtype.is_floating_point or x_hp.element_size() == 1:
        raise ValueError(f"{op} casts a 2-D high-precision tensor (or a batch of them, (B, R, C)), "
                         f"got {x_hp.dtype} of shape {tuple(x_hp.shape)}")
    batch = x_hp.shape[0] if x_hp.dim() == 3 else 1
    if scale.numel() != batch or scale.dtype != torch.float32 or scale.device != x_hp.device:
        raise ValueError(f"{op}'s scale is {batch} float32 value(s) on {x_hp.device}, one a matrix, "
                         f"got {scale.dtype} of shape {tuple(scale.shape)} on {scale.device}")
    if batch > _MAX_GRID or -(-x_hp.shape[-1] // _BLOCK) > _MAX_GRID:
        raise ValueError(f"{op} takes at most {_MAX_GRID} matrices of at most {_MAX_GRID * _BLOCK} "
                         f"columns (the kernel's grid), got shape {tuple(x_hp.shape)}")


def _transposed_shape(x_hp: torch.Tensor) -> tuple[int, ...]:
    return (*x_hp.shape[:-2], x_hp.shape[-1], x_hp.shape[-2])


def _tiles(x_hp: torch.Tensor) -> int:
    """64 x 64 tiles a matrix: the amax partials ``quantize_both_layouts`` returns for each."""
    return -(-x_hp.shape[-2] // _BLOCK) * -(-x_hp.shape[-1] // _BLOCK)


def _amax_shape(x_hp: torch.Tensor, tile_amax: bool) -> tuple[int, ...]:
    return (*x_hp.shape[:-2], _tiles(x_hp) if tile_amax else 0)


def _checked_destinations(x_hp: torch.Tensor, x_fp8: torch.Tensor, x_t_fp8: torch.Tensor) -> None:
    """``quantize_both_layouts_into_``'s buffers: contiguous E4M3 tensors of the cast's and its transpose's shapes,
    on ``x_hp``'s device."""
    for name, out, shape in (("x_fp8", x_fp8, tuple(x_hp.shape)), ("x_t_fp8", x_t_fp8, _transposed_shape(x_hp))):
        if tuple(out.shape) != shape or out.dtype != _FP8 or out.device != x_hp.device or not out.is_contiguous():
            raise ValueError(f"quantize_both_layouts_into_ writes {name} as a contiguous {_FP8} tensor of shape "
                             f"{shape} on {x_hp.device}, got {out.dtype} of shape {tuple(out.shape)} on {out.device}"
                             f"{'' if out.is_contiguous() else ', not contiguous'}")


def plan_quantize_transposed(x_hp: torch.Tensor, scale: torch.Tensor, straight: bool = False, tile_amax: bool = False,
                             outs: tuple[torch.Tensor, torch.Tensor] | None = None
                             ) -> tuple[KernelLaunch, tuple[torch.Tensor, ...]]:
    """The launch that writes ``quantize(x_hp, scale).transpose(-2, -1).contiguous()`` (matrix ``b`` of a 3-D
    ``x_hp`` scaled by ``scale.flatten()[b]``) and, with ``straight``, the cast in ``x_hp``'s own order,
    contiguous, and with ``tile_amax`` each 64 x 64 tile's amax; the outputs ``(x_t_fp8, x_fp8, amax)``, the last
    two empty where not asked for. ``outs``, ``(x_fp8, x_t_fp8)`` with ``straight``: the buffers to write."""
    from triton import cdiv, knobs

    from fp8graph.kernels._quantize_transposed_triton import quantize_transposed_kernel

    _checked(x_hp, scale, "quantize_both_layouts" if straight else "quantize_transposed")
    batch = x_hp.shape[0] if x_hp.dim() == 3 else 1
    rows, columns = x_hp.shape[-2:]
    if outs is None:
        x_t_fp8 = torch.empty(_transposed_shape(x_hp), dtype=_FP8, device=x_hp.device)
        x_fp8 = torch.empty(x_hp.shape if straight else (0,), dtype=_FP8, device=x_hp.device)
    else:
        x_fp8, x_t_fp8 = outs
    amax = torch.empty(_amax_shape(x_hp, tile_amax), dtype=torch.float32, device=x_hp.device)
    launch = KernelLaunch(quantize_transposed_kernel, (cdiv(rows, _BLOCK), cdiv(columns, _BLOCK), batch),
                          (x_hp, scale.reshape(-1).contiguous(), x_t_fp8.view(torch.uint8), x_fp8.view(torch.uint8),
                           amax, rows, columns, x_hp.stride(-2), x_hp.stride(-1),
                           x_hp.stride(0) if x_hp.dim() == 3 else 0),
                          {"FP8_MAX": fp8_max(_FP8),
                           # The interpreter's own FP8 conversion is not the GPU's: round in software there.
                           "SOFTWARE_ROUNDING": bool(knobs.runtime.interpret),
                           "BLOCK_ROWS": _BLOCK, "BLOCK_COLUMNS": _BLOCK, "STRAIGHT": straight,
                           "TILE_AMAX": tile_amax, "num_warps": _NUM_WARPS})
    return launch, (x_t_fp8, x_fp8, amax)


def quantize_transposed_triton(x_hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Run the Triton kernel (the op's output)."""
    launch, (x_t_fp8, _, _) = plan_quantize_transposed(x_hp, scale)
    if x_t_fp8.numel():
        launch()
    return x_t_fp8


def quantize_both_layouts_triton(x_hp: torch.Tensor, scale: torch.Tensor, tile_amax: bool,
                                 outs: tuple[torch.Tensor, torch.Tensor] | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the Triton kernel (the op's outputs), into ``outs`` (``(x_fp8, x_t_fp8)``) if given."""
    launch, (x_t_fp8, x_fp8, amax) = plan_quantize_transposed(x_hp, scale, straight=True, tile_amax=tile_amax,
                                                              outs=outs)
    if x_t_fp8.numel():
        launch()
    return x_fp8, x_t_fp8, amax


def _cast(x_hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    matrix_scale = scale.reshape(-1, 1, 1) if x_hp.dim() == 3 else scale.reshape(())
    return quantize(x_hp, matrix_scale, _FP8)


def _reference(x_hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _checked(x_hp, scale)
    return _cast(x_hp, scale).transpose(-2, -1).clone(memory_format=torch.contiguous_format)


def tile_amaxes_reference(x_hp: torch.Tensor) -> torch.Tensor:
    """Each 64 x 64 tile's amax of ``x_hp`` (R, C) or (B, R, C), NaN and inf as 0, row-major over the tiles:
    (tiles,) or (B, tiles)."""
    rows, columns = x_hp.shape[-2:]
    padded_rows, padded_columns = -(-rows // _BLOCK) * _BLOCK, -(-columns // _BLOCK) * _BLOCK
    magnitude = torch.nn.functional.pad(finite_magnitude(x_hp), (0, padded_columns - columns, 0, padded_rows - rows))
    tiles = magnitude.reshape(*x_hp.shape[:-2], padded_rows // _BLOCK, _BLOCK, padded_columns // _BLOCK, _BLOCK)
    return tiles.amax(dim=(-3, -1)).reshape(_amax_shape(x_hp, True))


def _both_layouts_reference(x_hp: torch.Tensor, scale: torch.Tensor, tile_amax: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _checked(x_hp, scale, "quantize_both_layouts")
    x_fp8 = _cast(x_hp, scale).contiguous()
    amax = tile_amaxes_reference(x_hp) if tile_amax else x_hp.new_empty(_amax_shape(x_hp, False),
                                                                          dtype=torch.float32)
    return x_fp8, x_fp8.transpose(-2, -1).contiguous(), amax


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


@torch.library.custom_op("fp8graph::quantize_both_layouts", mutates_args=())
def quantize_both_layouts(x_hp: torch.Tensor, scale: torch.Tensor, tile_amax: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_fp8, x_t_fp8, amax)``: ``quantize(x_hp, scale, float8_e4m3fn)`` of an (R, C) high-precision matrix (or of
    each matrix of a (B, R, C) batch with its own of ``scale``'s B values), contiguous, its transpose's contiguous
    copy (C, R), and, with ``tile_amax``, the amax of ``x_hp`` (NaN and inf as 0) of each 64 x 64 tile, row-major
    over the tiles ((tiles,) or (B, tiles); else an empty (…, 0)): the max of a matrix's partials is its amax."""
    return _both_layouts_reference(x_hp, scale, tile_amax)


@quantize_both_layouts.register_fake
def _(x_hp, scale, tile_amax):
    _checked(x_hp, scale, "quantize_both_layouts")
    return (x_hp.new_empty(x_hp.shape, dtype=_FP8), x_hp.new_empty(_transposed_shape(x_hp), dtype=_FP8),
            x_hp.new_empty(_amax_shape(x_hp, tile_amax), dtype=torch.float32))


@quantize_both_layouts.register_kernel("cuda")
def _(x_hp, scale, tile_amax):
    if not triton_available():
        return _both_layouts_reference(x_hp, scale, tile_amax)
    return quantize_both_layouts_triton(x_hp, scale, tile_amax)


@torch.library.custom_op("fp8graph::quantize_both_layouts_into_", mutates_args=("x_fp8", "x_t_fp8"))
def quantize_both_layouts_into_(x_hp: torch.Tensor, scale: torch.Tensor, tile_amax: bool, x_fp8: torch.Tensor,
                                x_t_fp8: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_both_layouts` written straight into the buffers that keep the two layouts (an expert weight's
    kept copies, ``fp8graph.targets.grouped``), where the op and two ``copy_`` would write them twice; returns the
    tiles' amaxes. Inductor writes a graph input's mutation by this op in place (its re-inplacing of
    functionalized mutations)."""
    return _written_into(x_hp, scale, tile_amax, x_fp8, x_t_fp8)


def _written_into(x_hp, scale, tile_amax, x_fp8, x_t_fp8) -> torch.Tensor:
    """The reference, copied into the buffers."""
    _checked_destinations(x_hp, x_fp8, x_t_fp8)
    cast, cast_t, amax = _both_layouts_reference(x_hp, scale, tile_amax)
    x_fp8.copy_(cast)
    x_t_fp8.copy_(cast_t)
    return amax


@quantize_both_layouts_into_.register_fake
def _(x_hp, scale, tile_amax, x_fp8, x_t_fp8):
    _checked(x_hp, scale, "quantize_both_layouts")
    _checked_destinations(x_hp, x_fp8, x_t_fp8)
    return x_hp.new_empty(_amax_shape(x_hp, tile_amax), dtype=torch.float32)


@quantize_both_layouts_into_.register_kernel("cuda")
def _(x_hp, scale, tile_amax, x_fp8, x_t_fp8):
    if not triton_available():
        return _written_into(x_hp, scale, tile_amax, x_fp8, x_t_fp8)
    _checked_destinations(x_hp, x_fp8, x_t_fp8)
    return quantize_both_layouts_triton(x_hp, scale, tile_amax, (x_fp8, x_t_fp8))[2]
