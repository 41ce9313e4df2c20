"""Triton kernels behind fp8graph's tiled quantization (imported only where Triton is installed).

Each kernel reads every element of its high-precision input once, reduces the
amax of each tile, turns it into a scale exactly as ``fp8graph.numerics.quantize.amax_to_scale``
or ``fp8graph.numerics.tiles.mx_scale_e8m0`` do, casts and stores the E4M3 bytes and the
scales. The launchers and the choice between these kernels and Inductor's code
are in ``fp8graph.kernels.quantize_tiles``::

    quantize_row_tiles_kernel   tiles of 1 x TILE_COLS (1x128 blocks, MX 1x32), many tiles a program
    quantize_rows_kernel        one scale per row (row-wise), the row walked in chunks
    quantize_blocks_kernel      128 x 128 blocks, read once, written row-major and/or transposed:
                                  SQUARE   one scale per block (128x128 weight tiles): the transposed
                                           copy has the same scales
                                  else     1x128 tiles along the rows and 1x128 tiles along the
                                           columns (an activation and its transpose for the gradient GEMM)

Rules these kernels keep, which ``tests/kernels/test_kernels_compile.py`` checks by
compiling each for sm_90 and sm_100 without a GPU:

- Addresses are 64-bit from the program ids on: a tensor of 2**31 elements
  or more (a 4 GB BF16 activation) would overflow 32-bit offsets. The block
  kernel keeps 64-bit pointers to its block and 32-bit offsets inside it
  (fewer registers); its launcher refuses strides and lengths they cannot reach.

- Triton kernels may read module globals only as ``tl.constexpr``; a plain
  Python float compiles under ``TRITON_INTERPRET=1`` but not for a GPU.
- The amax is an integer max over ``|x|``'s fp32 bits (magnitudes order as
  their bits do), NaN and inf counted as 0 as in
  ``fp8graph.numerics.quantize.finite_magnitude``: a non-finite value does not
  change its tile's scale, and still casts to NaN.
- On a GPU the cast is the hardware's ``cvt.rn.satfinite.e4m3x2.f32``
  (round to nearest even, saturate, NaN stays NaN); only +-inf, which it
  would saturate, is turned into NaN first, as ``fp8graph.numerics.quantize.quantize``
  does. Triton's interpreter converts some values to the wrong binade, so
  under ``SOFTWARE_ROUNDING`` (interpreter runs only) the kernel rounds to the
  E4M3 grid itself first. Per element that is about 25 more integer
  operations, too many for a kernel meant to run at memory speed.
"""

import triton
import triton.language as tl

FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
SMALLEST_E8M0_SCALE = tl.constexpr(5.877471754111438e-39)  # 2**-127, an fp32 subnormal
E4M3_NAN_BITS = tl.constexpr(0x7F)
E4M3_NEGATIVE_ZERO_BITS = tl.constexpr(0x80)
SCALE_EXACT = tl.constexpr(0)
SCALE_POWER_2 = tl.constexpr(1)
SCALE_E8M0 = tl.constexpr(2)


@triton.jit
def _magnitude_bits(x):
    """``|x|`` of fp32 values as int32 bits, ordered as the magnitudes are; 0 for NaN and inf."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(bits < 0x7F800000, bits, 0)


@triton.jit
def _amax_from_bits(magnitude_bits, axis: tl.constexpr):
    return tl.max(magnitude_bits, axis=axis).to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(amax, SCALE_KIND: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MAX_EXPONENT: tl.constexpr):
    if SCALE_KIND == SCALE_E8M0:  # the power of two at or above amax / FP8_MAX, as 2**(127 - e)
        bits = amax.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        exponent = biased - FP8_MAX_EXPONENT + (mantissa > 0x600000).to(tl.int32)
        exponent = tl.minimum(tl.maximum(exponent, 0), 254)
        scale = (tl.maximum(254 - exponent, 1) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(exponent == 254, SMALLEST_E8M0_SCALE, scale)
        scale = tl.where(biased == 0xFF, float("nan"), scale)
    else:
        usable = (amax > 0) & (amax < float("inf"))  # false for NaN
        # fp8_max / amax as torch computes a scalar over a tensor: reciprocal, then multiply.
        scale = tl.where(usable, tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * FP8_MAX, 1.0)
        scale = tl.minimum(scale, FLOAT32_MAX)
        if SCALE_KIND == SCALE_POWER_2:
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _round_to_e4m3_grid(x):
    """Round fp32 values in [-448, 448] to the nearest E4M3 value, ties to even, in fp32."""
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
def _e4m3_bits(x, scale, FP8_MAX: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """The E4M3 bytes (uint8) of ``x * scale`` as ``fp8graph.numerics.quantize.quantize`` casts it."""
    # E4M3 has no inf: an inf of x becomes NaN (the saturating conversion would give +-448). A finite x whose
    # product with the scale overflows fp32 saturates, as every finite value beyond the range does.
    x_scaled = tl.where(tl.abs(x) == float("inf"), float("nan"), x * scale)
    if SOFTWARE_ROUNDING:
        x_saturated = tl.minimum(tl.maximum(x_scaled, -FP8_MAX), FP8_MAX)
        bits = _round_to_e4m3_grid(x_saturated).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        bits = tl.where(x_scaled != x_scaled, E4M3_NAN_BITS, bits)
        negative = x_saturated.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 too
        bits = tl.where(negative & (bits == 0), E4M3_NEGATIVE_ZERO_BITS, bits)  # -0, as the GPU
    else:
        bits = x_scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return bits


@triton.jit
def quantize_row_tiles_kernel(x_ptr, x_fp8_ptr, scale_ptr, n_rows, n_cols, n_cols_padded, stride_row, stride_col,
                              BLOCK_ROWS: tl.constexpr, TILES_PER_BLOCK: tl.constexpr, TILE_COLS: tl.constexpr,
                              SCALE_KIND: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MAX_EXPONENT: tl.constexpr,
                              SOFTWARE_ROUNDING: tl.constexpr):
    """Tiles of 1 x TILE_COLS: a program quantizes BLOCK_ROWS x TILES_PER_BLOCK of them.

    The block is loaded as (rows, tiles, columns of a tile), so each tile's
    amax is a reduction over the last axis, with no reshape.
    """
    row_ids = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]  # (BLOCK_ROWS, 1)
    tile_ids = tl.program_id(1).to(tl.int64) * TILES_PER_BLOCK + tl.arange(0, TILES_PER_BLOCK)[None, :]
    rows = row_ids[:, :, None]
    cols = tile_ids[:, :, None] * TILE_COLS + tl.arange(0, TILE_COLS)[None, None, :]
    x = tl.load(x_ptr + rows * stride_row + cols * stride_col, mask=(rows < n_rows) & (cols < n_cols),
                other=0.0).to(tl.float32)
    scale = _scale_of(_amax_from_bits(_magnitude_bits(x), 2), SCALE_KIND, FP8_MAX, FP8_MAX_EXPONENT)
    x_fp8_bits = _e4m3_bits(x, scale[:, :, None], FP8_MAX, SOFTWARE_ROUNDING)
    tl.store(x_fp8_ptr + rows * n_cols_padded + cols, x_fp8_bits, mask=(rows < n_rows) & (cols < n_cols_padded))
    n_tiles = n_cols_padded // TILE_COLS
    tl.store(scale_ptr + row_ids * n_tiles + tile_ids, scale, mask=(row_ids < n_rows) & (tile_ids < n_tiles))


@triton.jit
def quantize_rows_kernel(x_ptr, x_fp8_ptr, scale_ptr, n_rows, n_cols, stride_row, stride_col,
                         BLOCK_ROWS: tl.constexpr, CHUNK: tl.constexpr, ONE_CHUNK: tl.constexpr,
                         SCALE_KIND: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MAX_EXPONENT: tl.constexpr,
                         SOFTWARE_ROUNDING: tl.constexpr):
    """One scale per row: a program quantizes BLOCK_ROWS rows.

    A row that fits one CHUNK stays in registers; a longer one is walked
    twice, for its amax and for the cast: the second walk reads from L2,
    where the program's few rows still are, so DRAM sees each element once.
    """
    row_ids = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rows = row_ids[:, None]
    chunk_cols = tl.arange(0, CHUNK)[None, :].to(tl.int64)
    if ONE_CHUNK:
        in_bounds = (rows < n_rows) & (chunk_cols < n_cols)
        x = tl.load(x_ptr + rows * stride_row + chunk_cols * stride_col, mask=in_bounds, other=0.0).to(tl.float32)
        scale = _scale_of(_amax_from_bits(_magnitude_bits(x), 1), SCALE_KIND, FP8_MAX, FP8_MAX_EXPONENT)
        tl.store(x_fp8_ptr + rows * n_cols + chunk_cols, _e4m3_bits(x, scale[:, None], FP8_MAX, SOFTWARE_ROUNDING),
                 mask=in_bounds)
    else:
        max_bits = tl.zeros([BLOCK_ROWS, CHUNK], dtype=tl.int32)
        for start in range(0, n_cols, CHUNK):
            cols = start + chunk_cols
            x = tl.load(x_ptr + rows * stride_row + cols * stride_col, mask=(rows < n_rows) & (cols < n_cols),
                        other=0.0).to(tl.float32)
            max_bits = tl.maximum(max_bits, _magnitude_bits(x))
        scale = _scale_of(tl.max(max_bits, axis=1).to(tl.float32, bitcast=True), SCALE_KIND, FP8_MAX,
                          FP8_MAX_EXPONENT)
        for start in range(0, n_cols, CHUNK):
            cols = start + chunk_cols
            in_bounds = (rows < n_rows) & (cols < n_cols)
            x = tl.load(x_ptr + rows * stride_row + cols * stride_col, mask=in_bounds, other=0.0).to(tl.float32)
            tl.store(x_fp8_ptr + rows * n_cols + cols, _e4m3_bits(x, scale[:, None], FP8_MAX, SOFTWARE_ROUNDING),
                     mask=in_bounds)
    tl.store(scale_ptr + row_ids, scale, mask=row_ids < n_rows)


@triton.jit
def quantize_blocks_kernel(x_ptr, x_fp8_ptr, scale_ptr, x_t_fp8_ptr, scale_t_ptr,
                           n_rows, n_cols, n_rows_padded, n_cols_padded, stride_row, stride_col,
                           BLOCK: tl.constexpr, CHUNK: tl.constexpr, SQUARE: tl.constexpr, ROW_MAJOR: tl.constexpr,
                           TRANSPOSED: tl.constexpr, SCALE_KIND: tl.constexpr, FP8_MAX: tl.constexpr,
                           FP8_MAX_EXPONENT: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """A BLOCK x BLOCK block of x (R, C), written as x_fp8 (R, C') and/or x_t_fp8 (C, R').

    ``SQUARE``: the block is one tile with one scale, shared by both layouts
    (scale (R/B, C'/B), scale_t its transpose). Otherwise each row of the
    block is a 1 x BLOCK tile of x (scale (R, C'/B)) and each column a
    1 x BLOCK tile of x_t (scale_t (C, R'/B)). C' and R' are C and R padded
    with zeros to multiples of BLOCK (each layout's reduction dimension).

    The block is walked twice in chunks that hold whole tiles: CHUNK full rows
    (their amaxes, then the row-major cast), then CHUNK full columns (their
    amaxes, then the transposed cast). A whole block in registers (64 fp32 a
    thread) allowed one program per SM, which leaves nothing to hide the next
    block's load behind; chunks keep the registers low and many programs in
    flight. The second walk reads the block again from L1 or L2 (32 KB, read
    moments before), so DRAM sees each element once. Transposed stores are
    coalesced along x's rows: Triton moves the FP8 chunk through shared memory.
    """
    block_row = tl.program_id(0).to(tl.int64)
    block_col = tl.program_id(1).to(tl.int64)
    first_row, first_col = block_row * BLOCK, block_col * BLOCK
    # 64-bit pointers to the block, 32-bit offsets inside it (the launcher keeps them in range).
    x_block = x_ptr + first_row * stride_row + first_col * stride_col
    x_fp8_block = x_fp8_ptr + first_row * n_cols_padded + first_col
    x_t_fp8_block = x_t_fp8_ptr + first_col * n_rows_padded + first_row
    rows_left, cols_left, padded_cols_left = n_rows - first_row, n_cols - first_col, n_cols_padded - first_col
    block_rows = tl.arange(0, BLOCK)[:, None]  # (BLOCK, 1), in the block
    block_cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    if SQUARE:  # the block's amax first, then both casts with its scale
        max_bits = tl.zeros([CHUNK, BLOCK], dtype=tl.int32)
        for start in tl.static_range(0, BLOCK, CHUNK):
            rows = start + tl.arange(0, CHUNK)[:, None]
            x = tl.load(x_block + rows * stride_row + block_cols * stride_col,
                        mask=(rows < rows_left) & (block_cols < cols_left), other=0.0).to(tl.float32)
            max_bits = tl.maximum(max_bits, _magnitude_bits(x))
        amax = tl.max(tl.max(max_bits, axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = _scale_of(amax, SCALE_KIND, FP8_MAX, FP8_MAX_EXPONENT)
        for start in tl.static_range(0, BLOCK, CHUNK):
            cols = start + tl.arange(0, CHUNK)[None, :]
            x = tl.load(x_block + block_rows * stride_row + cols * stride_col,
                        mask=(block_rows < rows_left) & (cols < cols_left), other=0.0).to(tl.float32)
            x_fp8_bits = _e4m3_bits(x, scale, FP8_MAX, SOFTWARE_ROUNDING)
            if ROW_MAJOR:
                tl.store(x_fp8_block + block_rows * n_cols_padded + cols, x_fp8_bits, mask=cols < padded_cols_left)
            if TRANSPOSED:  # C and R are multiples of BLOCK here
                tl.store(x_t_fp8_block + cols * n_rows_padded + block_rows, x_fp8_bits)
        if ROW_MAJOR:
            tl.store(scale_ptr + block_row * (n_cols_padded // BLOCK) + block_col, scale)
        if TRANSPOSED:
            tl.store(scale_t_ptr + block_col * (n_rows_padded // BLOCK) + block_row, scale)
    else:
        if ROW_MAJOR:  # 1 x BLOCK tiles along x's rows
            row_scale_block = scale_ptr + first_row * (n_cols_padded // BLOCK) + block_col
            for start in tl.static_range(0, BLOCK, CHUNK):
                row_ids = start + tl.arange(0, CHUNK)
                rows = row_ids[:, None]
                x = tl.load(x_block + rows * stride_row + block_cols * stride_col,
                            mask=(rows < rows_left) & (block_cols < cols_left), other=0.0).to(tl.float32)
                row_scale = _scale_of(_amax_from_bits(_magnitude_bits(x), 1), SCALE_KIND, FP8_MAX, FP8_MAX_EXPONENT)
                tl.store(x_fp8_block + rows * n_cols_padded + block_cols,
                         _e4m3_bits(x, row_scale[:, None], FP8_MAX, SOFTWARE_ROUNDING),
                         mask=(rows < rows_left) & (block_cols < padded_cols_left))
                tl.store(row_scale_block + row_ids * (n_cols_padded // BLOCK), row_scale, mask=row_ids < rows_left)
        if TRANSPOSED:  # 1 x BLOCK tiles along x's columns: the rows of x_t
            col_scale_block = scale_t_ptr + first_col * (n_rows_padded // BLOCK) + block_row
            for start in tl.static_range(0, BLOCK, CHUNK):
                col_ids = start + tl.arange(0, CHUNK)
                cols = col_ids[None, :]
                x = tl.load(x_block + block_rows * stride_row + cols * stride_col,
                            mask=(block_rows < rows_left) & (cols < cols_left), other=0.0).to(tl.float32)
                col_scale = _scale_of(_amax_from_bits(_magnitude_bits(x), 0), SCALE_KIND, FP8_MAX, FP8_MAX_EXPONENT)
                tl.store(x_t_fp8_block + cols * n_rows_padded + block_rows,
                         _e4m3_bits(x, col_scale[None, :], FP8_MAX, SOFTWARE_ROUNDING), mask=cols < cols_left)
                tl.store(col_scale_block + col_ids * (n_rows_padded // BLOCK), col_scale, mask=col_ids < cols_left)
