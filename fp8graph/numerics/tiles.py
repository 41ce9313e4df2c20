"""Quantization with one scale per tile: rows, 1x128 / 128x128 blocks, and MX blocks of 32.

A 2-D operand ``x`` (R, C) whose last dimension is the GEMM's reduction
dimension is cut into tiles of ``rows x cols`` (``cols=None``: the whole row);
each tile gets its own scale from its own amax::

    row-wise        (1, C)      scale per row
    block 1x128     (1, 128)    activations and gradients (DeepSeek-V3, Transformer Engine)
    block 128x128   (128, 128)  weights
    MX              (1, 32)     OCP microscaling: E8M0 scale = the power of two at or above amax / 448

Scales follow ``fp8graph.numerics.quantize``: ``x_fp8 = cast(x_hp * scale)``, one fp32
scale per tile, shape (R / rows, C / cols). MX scales are also kept as their
E8M0 bytes (:func:`mx_scale_e8m0`), built with integer operations on the
amax's bits, because neither Inductor nor the CPU does arithmetic on E8M0.

A reduction dimension that is not a multiple of the tile width is zero-padded
(zeros change no amax and add nothing to a product); the weight-gradient GEMM
reduces over tokens, whose count is free. Plain torch ops throughout, so
Inductor fuses amax, scale and cast; these functions are also the reference
the tests hold every lowering to.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

import torch

from fp8graph.numerics.formats import fp8_max_exponent
from fp8graph.numerics.quantize import amax_to_scale, finite_magnitude, quantize, untracked

__all__ = ["ScaleKind", "Tiling", "reference_dequantize_tiles", "e8m0_bytes", "e8m0_to_scale", "expand_scale",
           "mx_scale_e8m0", "reference_quantize_tiles", "reference_quantize_tiles_and_transpose", "reference_quantize_tiles_by",
           "tile_amax"]


class ScaleKind(str, enum.Enum):
    EXACT = "exact"  # fp8_max / amax
    POWER_2 = "pow2"  # the largest power of two <= fp8_max / amax
    E8M0 = "e8m0"  # MX: 1 / (the power of two >= amax / fp8_max), an E8M0 exponent


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tiles of ``rows x cols`` over an operand (R, C) reduced along C; ``cols=None`` spans the row."""

    rows: int
    cols: int | None
    scale_kind: ScaleKind

    def tile_cols(self, x: torch.Tensor) -> int:
        return self.width_of(x.shape[1])

    def width_of(self, columns: int) -> int:
        """A tile's columns in a tensor of ``columns`` columns: a row tile spans the row, at least one column (a
        row of none, e.g. grad_weight's operand of an empty batch, is one tile of no elements)."""
        return torch.sym_max(columns, 1) if self.cols is None else self.cols

    @property
    def is_square(self) -> bool:
        """The tiles group the same elements either way round: transposed, a quantization along
        the rows is the quantization along the columns (block scaling's 128x128 weight tiles)."""
        return self.cols is not None and self.rows == self.cols

    @property
    def label(self) -> str:
        return "row" if self.cols is None else f"{self.rows}x{self.cols}"


def _pad_columns(x: torch.Tensor, multiple: int) -> torch.Tensor:
    columns = x.shape[1]
    if isinstance(columns, int) and columns % multiple == 0:
        return x
    return torch.nn.functional.pad(x, (0, (-columns) % multiple))


def _as_tiles(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(R, C) -> (R / rows, rows, C / cols, cols)."""
    return x.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)


def tile_amax(x_hp: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """Largest finite magnitude of each tile (0 if none), fp32, shape (R / rows, C / cols)."""
    cols = tiling.tile_cols(x_hp)
    return _as_tiles(finite_magnitude(untracked(x_hp)), tiling.rows, cols).amax(dim=(1, 3))


_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
# Both FP8 maxima are 1.75 * 2**p (448 = 1.75 * 2**8, 57344 = 1.75 * 2**15).
_MANTISSA_OF_1_75 = 0x600000
_E8M0_NAN = 255


def mx_scale_e8m0(amax_fp32: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """E8M0 exponent byte (uint8) of the power of two at or above ``amax / fp8_max``, per block.

    With ``amax = 2**E * f`` (f in [1, 2)) and ``fp8_max = 1.75 * 2**p``,
    ``amax / fp8_max = 2**(E - p) * f / 1.75``, so the power of two at or above
    it is ``2**(E - p)`` when ``f <= 1.75`` and ``2**(E - p + 1)`` otherwise: a
    comparison of mantissa bits, exact where ``log2``/``ceil`` could round.
    Biased by 127 as E8M0 is; 0 (2**-127, the smallest E8M0) for amax 0 and
    for amaxes so small that a smaller power would be needed; 255 (E8M0 NaN)
    for inf or NaN.
    """
    p = fp8_max_exponent(fp8_dtype)
    bits = amax_fp32.to(torch.float32).view(torch.int32)
    biased_exponent = (bits >> _MANTISSA_BITS) & 0xFF
    mantissa = bits & _MANTISSA_MASK
    exponent = biased_exponent - p + (mantissa > _MANTISSA_OF_1_75).to(torch.int32)
    exponent = torch.where(biased_exponent == 0xFF, _E8M0_NAN, exponent.clamp(min=0, max=254))
    return exponent.to(torch.uint8)


def e8m0_to_scale(e8m0: torch.Tensor) -> torch.Tensor:
    """The quantization scale ``2**(127 - e)`` of E8M0 bytes ``e`` (fp32; NaN for 255), built from bits."""
    exponent = e8m0.to(torch.int32)
    # 2**(127 - e) as an fp32 with biased exponent 254 - e (e <= 253; 254 is 2**-127, subnormal).
    scale = ((254 - exponent).clamp(min=1) << _MANTISSA_BITS).view(torch.float32)
    scale = torch.where(exponent == 254, 2.0 ** -127, scale)
    return torch.where(exponent == _E8M0_NAN, float("nan"), scale)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes of the dequantization factor ``1 / scale`` (float8_e8m0fnu): its fp32 exponent field. The inverse
    of :func:`e8m0_to_scale` (every byte, 0, 254 and 255 included), for MX scales the GEMMs and the FSDP2 gather
    take as bytes."""
    inverse = scale.reciprocal()
    return ((inverse.view(torch.int32) >> _MANTISSA_BITS) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def reference_quantize_tiles(
    x_hp: torch.Tensor, tiling: Tiling, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize (R, C) tile by tile; returns ``(x_fp8 (R, C'), scale (R / rows, C' / cols))``.

    ``C'`` is C padded with zeros to a multiple of the tile width. R must be
    a multiple of ``tiling.rows`` (site eligibility checks it).
    """
    return reference_quantize_tiles_by(x_hp, tiling, lambda scale: scale, fp8_dtype)


def reference_quantize_tiles_by(
    x_hp: torch.Tensor, tiling: Tiling, scales_read: Callable[[torch.Tensor], torch.Tensor],
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_quantize_tiles`, casting with ``scales_read(scale)``, a tensor of the same values: where
    a graph reads the scales is the caller's (``fp8graph.targets.linear_tiled`` ties a backward's cast to its
    gradient), the bytes are the same."""
    if tiling.cols is not None:
        x_hp = _pad_columns(x_hp, tiling.cols)
    amax_fp32 = tile_amax(x_hp, tiling)
    if tiling.scale_kind is ScaleKind.E8M0:
        scale = e8m0_to_scale(mx_scale_e8m0(amax_fp32, fp8_dtype))
    else:
        scale = amax_to_scale(amax_fp32, fp8_dtype, tiling.scale_kind is ScaleKind.POWER_2)
    scale = scales_read(scale)
    cols = tiling.tile_cols(x_hp)
    x_tiles = _as_tiles(x_hp, tiling.rows, cols)
    x_fp8 = quantize(x_tiles, scale[:, None, :, None], fp8_dtype)
    return x_fp8.reshape(x_hp.shape), scale


def reference_quantize_tiles_and_transpose(
    x_hp: torch.Tensor, tiling: Tiling
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`reference_quantize_tiles` of ``x_hp`` (R, C) and of its transpose: ``(x_fp8, scale, x_t_fp8, scale_t)``.

    The two layouts the linear needs of an operand (each GEMM reduces along its
    own dimension), every output row-major, as ``fp8graph::quantize_tiles_and_transpose``
    writes them: the reference that op and its kernel are held to.
    """
    layouts = (*reference_quantize_tiles(x_hp, tiling), *reference_quantize_tiles(x_hp.t(), tiling))
    return tuple(t.contiguous() for t in layouts)


def expand_scale(scale: torch.Tensor, tiling: Tiling, shape) -> torch.Tensor:
    """Each tile's scale repeated over its elements: shape ``shape`` (R, C')."""
    cols = tiling.width_of(shape[1])
    tiles = scale[:, None, :, None].expand(shape[0] // tiling.rows, tiling.rows, shape[1] // cols, cols)
    return tiles.reshape(shape)


def reference_dequantize_tiles(x_fp8: torch.Tensor, scale: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """Inverse of :func:`reference_quantize_tiles`, in fp32 (shape of ``x_fp8``, padding included)."""
    cols = tiling.tile_cols(x_fp8)
    x_tiles = _as_tiles(x_fp8.to(torch.float32), tiling.rows, cols)
    return (x_tiles / scale[:, None, :, None]).reshape(x_fp8.shape)
