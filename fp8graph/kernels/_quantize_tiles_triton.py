"""The Triton kernel behind ``fp8graph::quantize_tiles`` (imported only where Triton is installed).

One program per tile of ``TILE_ROWS x TILE_COLS``: load the tile, reduce its
amax, turn it into a scale exactly as ``fp8graph.quantize.amax_to_scale`` or
``fp8graph.tiles.mx_scale_e8m0`` do (IEEE division, bit operations for
power-of-2 and E8M0 scales), cast, store. Tiles wider than ``CHUNK`` columns
(row-wise) are walked in chunks, twice.
"""

import triton
import triton.language as tl

_EXACT, _POWER_2, _E8M0 = 0, 1, 2
_FLOAT32_MAX = 3.4028234663852886e38


@triton.jit
def _scale_of(amax, SCALE_KIND: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MAX_EXPONENT: tl.constexpr):
    if SCALE_KIND == 2:  # E8M0: the power of two at or above amax / FP8_MAX, as 2**(127 - e)
        bits = amax.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        exponent = biased - FP8_MAX_EXPONENT + (mantissa > 0x600000).to(tl.int32)
        exponent = tl.minimum(tl.maximum(exponent, 0), 254)
        scale = (tl.maximum(254 - exponent, 1) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(exponent == 254, 5.877471754111438e-39, scale)  # 2**-127, subnormal
        scale = tl.where(biased == 0xFF, float("nan"), scale)
    else:
        usable = (amax > 0) & (amax < float("inf"))  # false for NaN
        # fp8_max / amax as torch computes a scalar over a tensor: reciprocal, then multiply.
        scale = tl.where(usable, tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * FP8_MAX, 1.0)
        scale = tl.minimum(scale, _FLOAT32_MAX)
        if SCALE_KIND == 1:
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 values in [-448, 448] to the nearest E4M3 value, ties to even, in fp32.

    The cast that follows is then exact on every backend; Triton's CPU
    interpreter rounds some values to the wrong binade on its own.
    """
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits; a carry out of the mantissa bumps the exponent.
    rounded_bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # ~0xFFFFF
    normal = rounded_bits.to(tl.float32, bitcast=True)
    # Subnormal range (|x| < 2**-6): multiples of 2**-9; adding 1.5 * 2**14 rounds there, ties to even.
    # Rounded as a magnitude so that negative values keep their sign at zero.
    magnitude = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = tl.where(x < 0, -magnitude, magnitude)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def quantize_tiles_kernel(x_ptr, out_ptr, scale_ptr, n_cols, n_cols_padded, stride_row, stride_col,
                          TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr, CHUNK: tl.constexpr,
                          SCALE_KIND: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MAX_EXPONENT: tl.constexpr):
    # out_ptr is the E4M3 output viewed as uint8; scale_ptr one fp32 per tile.
    tile_row = tl.program_id(0)
    tile_col = tl.program_id(1)
    rows = tile_row * TILE_ROWS + tl.arange(0, TILE_ROWS)[:, None]
    first_col = tile_col * TILE_COLS
    running_max = tl.zeros([TILE_ROWS, CHUNK], dtype=tl.float32)
    nan_count = 0
    for start in range(0, TILE_COLS, CHUNK):
        cols = first_col + start + tl.arange(0, CHUNK)[None, :]
        in_tile = cols < first_col + TILE_COLS
        x = tl.load(x_ptr + rows * stride_row + cols * stride_col, mask=in_tile & (cols < n_cols),
                    other=0.0).to(tl.float32)
        running_max = tl.maximum(running_max, tl.abs(x))
        nan_count += tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)
    amax = tl.max(tl.max(running_max, axis=1), axis=0)
    amax = tl.where(nan_count > 0, float("nan"), amax)
    scale = _scale_of(amax, SCALE_KIND, FP8_MAX, FP8_MAX_EXPONENT)
    for start in range(0, TILE_COLS, CHUNK):
        cols = first_col + start + tl.arange(0, CHUNK)[None, :]
        in_tile = cols < first_col + TILE_COLS
        x = tl.load(x_ptr + rows * stride_row + cols * stride_col, mask=in_tile & (cols < n_cols),
                    other=0.0).to(tl.float32)
        x_scaled = x * scale
        x_saturated = tl.minimum(tl.maximum(x_scaled, -FP8_MAX), FP8_MAX)
        x_fp8_bits = _round_to_e4m3(x_saturated).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        # NaN passes through, inf becomes NaN: E4M3 has no inf (as fp8graph.quantize.quantize).
        # Written as the NaN byte, which every backend stores alike.
        not_finite = (x_scaled != x_scaled) | (tl.abs(x_scaled) == float("inf"))
        x_fp8_bits = tl.where(not_finite, 0x7F, x_fp8_bits)
        x_fp8_bits = tl.where((x_saturated < 0) & (x_fp8_bits == 0), 0x80, x_fp8_bits)  # -0, as the CPU cast
        tl.store(out_ptr + rows * n_cols_padded + cols, x_fp8_bits, mask=in_tile & (cols < n_cols_padded))
    tl.store(scale_ptr + tile_row * tl.num_programs(1) + tile_col, scale)
