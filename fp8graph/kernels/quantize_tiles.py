"""``fp8graph::quantize_tiles``: tiled FP8 quantization as one read of each tile.

Inductor compiles ``fp8graph.tiles.quantize_tiled`` (amax per tile, scale,
cast) into one kernel, but, measured on its CPU backend, with two loops over
the tiles: the amax loop, then the cast loop, so a tensor larger than the
cache is read twice (``tests/test_fusion.py``). The Triton kernel here loads
a tile once, keeps it in registers for the amax, the scale and the cast, and
writes the FP8 tile and its scale. Row-wise tiles wider than one chunk are
walked twice, the second time from cache.

The op is registered with ``torch.library``: on CUDA with Triton it runs the
kernel, everywhere else the plain-torch reference ``quantize_tiled``, which
the tests compare it to (on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from fp8graph.formats import fp8_max, fp8_max_exponent
from fp8graph.tiles import ScaleKind, Tiling, quantize_tiled

__all__ = ["quantize_tiles", "quantize_tiles_triton", "triton_available"]

_SCALE_KINDS = {kind.value: index for index, kind in enumerate(ScaleKind)}
_MAX_CHUNK_ELEMENTS = 16384  # elements one program holds at a time


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _tiling(tile_rows: int, tile_cols: int, scale_kind: str) -> Tiling:
    return Tiling(tile_rows, None if tile_cols == 0 else tile_cols, ScaleKind(scale_kind))


@torch.library.custom_op("fp8graph::quantize_tiles", mutates_args=())
def quantize_tiles(x_hp: torch.Tensor, tile_rows: int, tile_cols: int,
                   scale_kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tiled(x_hp, Tiling(tile_rows, tile_cols or None, scale_kind))`` to E4M3."""
    return quantize_tiled(x_hp, _tiling(tile_rows, tile_cols, scale_kind))


@quantize_tiles.register_fake
def _(x_hp, tile_rows, tile_cols, scale_kind):
    rows, columns = x_hp.shape
    padded = columns if tile_cols == 0 else -(-columns // tile_cols) * tile_cols
    tile_columns = 1 if tile_cols == 0 else padded // tile_cols
    return (x_hp.new_empty((rows, padded), dtype=torch.float8_e4m3fn),
            x_hp.new_empty((rows // tile_rows, tile_columns), dtype=torch.float32))


@quantize_tiles.register_kernel("cuda")
def _(x_hp, tile_rows, tile_cols, scale_kind):
    if not triton_available():
        return quantize_tiled(x_hp, _tiling(tile_rows, tile_cols, scale_kind))
    return quantize_tiles_triton(x_hp, _tiling(tile_rows, tile_cols, scale_kind))


def quantize_tiles_triton(x_hp: torch.Tensor, tiling: Tiling) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel on ``x_hp`` (R, C), any strides; same results as ``quantize_tiled``."""
    import triton

    from ._quantize_tiles_triton import quantize_tiles_kernel

    rows, columns = x_hp.shape
    tile_cols = tiling.cols or columns
    padded = -(-columns // tile_cols) * tile_cols
    if rows % tiling.rows:
        raise ValueError(f"{rows} rows are no multiple of {tiling.rows}-row tiles")
    x_fp8 = torch.empty((rows, padded), dtype=torch.float8_e4m3fn, device=x_hp.device)
    scale = torch.empty((rows // tiling.rows, padded // tile_cols), dtype=torch.float32, device=x_hp.device)
    chunk = min(triton.next_power_of_2(tile_cols), max(_MAX_CHUNK_ELEMENTS // tiling.rows, 16))
    fp8_dtype = torch.float8_e4m3fn
    quantize_tiles_kernel[scale.shape](
        x_hp, x_fp8.view(torch.uint8), scale, columns, padded, x_hp.stride(0), x_hp.stride(1),
        TILE_ROWS=tiling.rows, TILE_COLS=tile_cols, CHUNK=chunk,
        SCALE_KIND=_SCALE_KINDS[tiling.scale_kind.value], FP8_MAX=fp8_max(fp8_dtype),
        FP8_MAX_EXPONENT=fp8_max_exponent(fp8_dtype),
    )
    return x_fp8, scale
