"""What cuBLASLt and CUTLASS require of an FP8 GEMM call's arguments on SM 9.x and SM 10.x, as checks that
run on any device.

torch's ``_scaled_mm``, ``_scaled_mm_v2`` (``F.scaled_mm``) and ``_scaled_grouped_mm`` check shapes and
dtypes, then hand pointers to the GPU library. What they pass on unchecked the library refuses at run
time (``CUBLAS_STATUS_NOT_SUPPORTED`` from ``cublasLtMatmul``, a device-side assert) or reads wrongly:

- Scales: cuBLASLt reads every scale from a 16-byte aligned address (cuBLAS docs, "starting addresses of
  scaling factors must be 16B aligned", enforced from cuBLAS 12.9.1: Transformer Engine PR #1925, pytorch
  PR #159957). A one-element view of a float32 buffer at element 1 is 4 bytes off: delayed scaling's
  scales passed that way failed in ``cublasLtMatmul`` on an H200 (2026-11-27).
- Matrices: torch's ``scaled_gemm`` sets no ``CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES``, so cuBLASLt
  assumes its default, 256 bytes, for A, B, C and D (an operand 1 byte off failed with
  ``NOT_SUPPORTED``: pytorch issue 141749); leading dimensions must be multiples of 16 bytes (cuBLAS,
  "Tensor Core usage"). The grouped GEMMs (CUTLASS) need 16 bytes.

A pointer's alignment is read from its storage offset: the GPU's caching allocator starts every storage
at a multiple of 512 bytes, so a view's address is aligned exactly when its offset into the storage is,
on the CPU (whose allocator guarantees 64) as on the GPU.

Each ``*_violations`` function returns the rules one call breaks, as sentences naming the argument
(empty: the call is one the library runs). The test suite runs fp8graph's native lowering on the CPU
with these checks standing in for the libraries (``tests/gemm_rules.py``), for every recipe, so a
call the GPU would refuse fails there first. The rules, per call (``a`` (M, K) times ``b`` (K, N)):

    every form      operands E4M3 or E5M2, never both E5M2; a row-major, b column-major; K and N
                    multiples of 16; leading dimensions multiples of 16 bytes; a, b, output and bias
                    at 256 bytes (grouped: 16), every scale at 16
    per tensor      scales float32, one element each; bias bfloat16 or float16, as the output
    row-wise        scales float32, contiguous, (M, 1) and (1, N); on SM 10.x (CUTLASS) b E4M3
    1x128, 128x128  SM 9.x only; E4M3; M and N multiples of 4; scales float32: 1x128 (rows, K/128) with
                    strides (1, rows); 128x128 (L4, rows/128) with strides (1, L4), L4 the K/128 tiles
                    padded to 4; not both 128x128; no fast accumulation
    MXFP8           SM 10.x only; E4M3; K a multiple of 32; E8M0 scales swizzled 32x4x4, contiguous,
                    round_up(rows, 128) * round_up(K/32, 4) of them
    grouped         E4M3, bfloat16 out, offsets 1-D int32, sorted, within the operand, under 1024
                    groups; strides multiples of 16 bytes; row-wise scales (SM 9.x only: CUTLASS's
                    kernel is Hopper's) rows form a (S, K) x b (E, K, N): (S,) and (E, N); weights
                    form a (N, S) x b (S, K): (E N,) and (E K,), every group but the last a multiple
                    of 16 tokens; MXFP8 (SM 10.x only) operands contiguous as the kernel reads them
"""

from __future__ import annotations

import torch

from fp8graph.recipes.scaling import FP8_GEMM_DIM_MULTIPLE

__all__ = ["ARCHES", "MATRIX_ALIGNMENT_BYTES", "SCALE_ALIGNMENT_BYTES", "STRIDE_ALIGNMENT_BYTES",
           "grouped_violations", "scaled_mm_v2_violations", "scaled_mm_violations"]

SCALE_ALIGNMENT_BYTES = 16  # every scale pointer (cuBLAS >= 12.9.1)
MATRIX_ALIGNMENT_BYTES = 256  # cuBLASLt's default assumption for A, B, C and D, which torch leaves in place
STRIDE_ALIGNMENT_BYTES = 16  # leading dimensions; the grouped GEMMs' operand pointers too (CUTLASS)
ARCHES = (90, 100)  # the compute capabilities whose rules are checked: Hopper (SM 9.0) and Blackwell (SM 10.0)
_GROUP_LIMIT = 1024  # torch's _scaled_grouped_mm takes fewer groups
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_E4M3 = (torch.float8_e4m3fn,)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
# torch's ScalingType and SwizzleType enums, as F.scaled_mm passes them to aten._scaled_mm_v2 (ints).
_TENSOR_WISE, _ROW_WISE, _BLOCK_1x16, _BLOCK_1x32, _BLOCK_1x128, _BLOCK_128x128 = 0, 1, 2, 3, 4, 5
_SWIZZLE_32_4_4 = 1
_HIGH_PRECISION_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _misaligned(name: str, tensor: torch.Tensor | None, alignment: int) -> list[str]:
    """A pointer the library would read at an address that is not a multiple of ``alignment`` bytes: its offset
    into a storage the allocator aligns (see the module's doc)."""
    if tensor is None or tensor.numel() == 0:
        return []
    offset = tensor.storage_offset() * tensor.element_size()
    if offset % alignment:
        return [f"{name} is not {alignment}-byte aligned (it starts {offset} bytes into its storage)"]
    return []


def _row_major(name: str, x: torch.Tensor) -> list[str]:
    """Rows contiguous (the reduction dimension last), rows a multiple of 16 bytes apart."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return [f"{name} {tuple(x.shape)} is not row-major (strides {x.stride()})"]
    if x.shape[-2] > 1 and (x.stride(-2) * x.element_size()) % STRIDE_ALIGNMENT_BYTES:
        return [f"{name}'s leading dimension {x.stride(-2)} is not a multiple of {STRIDE_ALIGNMENT_BYTES} bytes"]
    return []


def _column_major(name: str, x: torch.Tensor) -> list[str]:
    """Columns contiguous (the reduction dimension first), columns a multiple of 16 bytes apart."""
    if x.stride(-2) != 1 and x.shape[-2] > 1:
        return [f"{name} {tuple(x.shape)} is not column-major (strides {x.stride()})"]
    if x.shape[-1] > 1 and (x.stride(-1) * x.element_size()) % STRIDE_ALIGNMENT_BYTES:
        return [f"{name}'s leading dimension {x.stride(-1)} is not a multiple of {STRIDE_ALIGNMENT_BYTES} bytes"]
    return []


def _operand_dtypes(a: torch.Tensor, b: torch.Tensor, allowed_a=_FP8, allowed_b=_FP8) -> list[str]:
    problems = [f"{name} is {x.dtype}, not {' or '.join(map(str, allowed))}"
                for name, x, allowed in (("a", a, allowed_a), ("b", b, allowed_b)) if x.dtype not in allowed]
    if a.dtype == b.dtype == torch.float8_e5m2:
        problems.append("E5M2 x E5M2 has no FP8 GEMM (one operand must be E4M3)")
    return problems


def _multiples(sizes: dict[str, int], multiple: int = FP8_GEMM_DIM_MULTIPLE) -> list[str]:
    return [f"{what} = {size} is not a multiple of {multiple}" for what, size in sizes.items() if size % multiple]


def _float32_scale(name: str, scale: torch.Tensor, shape: tuple[int, ...] | None = None,
                   contiguous: bool = True) -> list[str]:
    problems = []
    if scale.dtype != torch.float32:
        problems.append(f"{name} is {scale.dtype}, not torch.float32")
    if shape is not None and tuple(scale.shape) != shape:
        problems.append(f"{name} has shape {tuple(scale.shape)}, not {shape}")
    if contiguous and not scale.is_contiguous():
        problems.append(f"{name} is not contiguous (strides {scale.stride()})")
    return problems + _misaligned(name, scale, SCALE_ALIGNMENT_BYTES)


def _check_arch(arch: int) -> None:
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")


def _matrices(a, b, bias, out, out_dtype) -> list[str]:
    """The rules every ``_scaled_mm`` form shares (cuBLASLt's TN FP8 GEMM); the caller checked that a and b are
    matrices that multiply."""
    problems = _row_major("a", a) + _column_major("b", b) + _multiples({"K": b.shape[0], "N": b.shape[1]})
    for name, x in (("a", a), ("b", b), ("bias", bias), ("output", out)):
        problems += _misaligned(name, x, MATRIX_ALIGNMENT_BYTES)
    if out_dtype not in _HIGH_PRECISION_OUT:
        problems.append(f"fp8graph's GEMMs write {', '.join(map(str, _HIGH_PRECISION_OUT))}, not {out_dtype}")
    if bias is not None:
        if bias.dtype != out_dtype or bias.dtype not in (torch.bfloat16, torch.float16):
            problems.append(f"bias is {bias.dtype}: it must be bfloat16 or float16, as the output ({out_dtype})")
        if bias.numel() != b.shape[1] or not bias.is_contiguous():
            problems.append(f"bias must be {b.shape[1]} contiguous elements, got {tuple(bias.shape)}")
    return problems


def _shapes(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    if a.dim() != 2 or b.dim() != 2:
        return [f"a and b must be matrices, got {a.dim()}-D and {b.dim()}-D"]
    if a.shape[1] != b.shape[0]:
        return [f"a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply"]
    return []


def scaled_mm_violations(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
                         bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None, arch: int = 90) -> list[str]:
    """The rules a ``torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=...)`` call breaks on SM ``arch``
    (per-tensor or row-wise scales, told apart by their element count, as torch does)."""
    _check_arch(arch)
    problems = _shapes(a, b)
    if problems:
        return problems
    out_dtype = out_dtype or a.dtype
    problems = _matrices(a, b, bias, out, out_dtype)
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return problems + _operand_dtypes(a, b) + _float32_scale("scale_a", scale_a) \
            + _float32_scale("scale_b", scale_b)
    # Row-wise: cuBLASLt's outer-vector scales on SM 9.x, CUTLASS's kernel on SM 10.x (which takes b in E4M3).
    problems += _operand_dtypes(a, b, allowed_b=_E4M3 if arch == 100 else _FP8)
    return problems + _float32_scale("scale_a", scale_a, (a.shape[0], 1)) \
        + _float32_scale("scale_b", scale_b, (1, b.shape[1]))


def _block_scale(name: str, scale: torch.Tensor, recipe: int, rows: int, k: int) -> list[str]:
    """A 1x128 or 128x128 operand's dequantization factors as cuBLASLt reads them (SM 9.x)."""
    tiles_k = -(-k // 128)
    if recipe == _BLOCK_1x128:
        shape, strides = (rows, tiles_k), (1, rows)
    else:
        padded = _round_up(tiles_k, 4)
        shape, strides = (padded, -(-rows // 128)), (1, padded)
    problems = _float32_scale(name, scale, shape, contiguous=False)
    if tuple(scale.shape) == shape and min(shape) > 1 and scale.stride() != strides:
        problems.append(f"{name} has strides {scale.stride()}, not {strides}")
    return problems


def _mx_scale(name: str, scale: torch.Tensor, rows: int, k: int) -> list[str]:
    """An MXFP8 operand's E8M0 scales, swizzled 32x4x4 in 128 x 4 blocks (SM 10.x)."""
    problems = [] if scale.dtype == _E8M0 else [f"{name} is {scale.dtype}, not E8M0"]
    expected = _round_up(rows, 128) * _round_up(-(-k // 32), 4)
    if scale.numel() != expected:
        problems.append(f"{name} holds {scale.numel()} scales, not the {expected} of the swizzled layout")
    if not scale.is_contiguous():
        problems.append(f"{name} is not contiguous")
    return problems + _misaligned(name, scale, SCALE_ALIGNMENT_BYTES)


def scaled_mm_v2_violations(a: torch.Tensor, b: torch.Tensor, scales_a, recipes_a, swizzles_a, scales_b, recipes_b,
                            swizzles_b, *, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                            out_dtype: torch.dtype | None = None, use_fast_accum: bool = False,
                            arch: int = 90) -> list[str]:
    """The rules an ``F.scaled_mm`` call (``aten._scaled_mm_v2``: one scale, recipe and swizzle per operand)
    breaks on SM ``arch``."""
    _check_arch(arch)
    problems = _shapes(a, b)
    if problems:
        return problems
    if len(scales_a) != 1 or len(scales_b) != 1:
        return ["fp8graph passes one scale tensor per operand"]
    (scale_a,), (scale_b,), (recipe_a,), (recipe_b,) = scales_a, scales_b, recipes_a, recipes_b
    (m, k), n = a.shape, b.shape[1]
    problems = _matrices(a, b, bias, out, out_dtype or torch.bfloat16)
    blocks = (_BLOCK_1x128, _BLOCK_128x128)
    if recipe_a in blocks and recipe_b in blocks:
        if arch != 90:
            problems.append("1x128 and 128x128 block scales run on SM 9.x only (cuBLASLt)")
        if recipe_a == recipe_b == _BLOCK_128x128:
            problems.append("128x128 x 128x128 block scales are not a pair cuBLASLt runs")
        problems += _operand_dtypes(a, b, _E4M3, _E4M3) + _multiples({"M": m, "N": n}, 4)
        problems += _block_scale("scale_a", scale_a, recipe_a, m, k) + _block_scale("scale_b", scale_b, recipe_b, n, k)
        if use_fast_accum:
            problems.append("block scales refuse fast accumulation")
    elif recipe_a == recipe_b == _BLOCK_1x32:
        if arch != 100:
            problems.append("MXFP8 runs on SM 10.x only")
        problems += _operand_dtypes(a, b, _E4M3, _E4M3) + _multiples({"K": k}, 32)
        problems += _mx_scale("scale_a", scale_a, m, k) + _mx_scale("scale_b", scale_b, n, k)
        if list(swizzles_a) != [_SWIZZLE_32_4_4] or list(swizzles_b) != [_SWIZZLE_32_4_4]:
            problems.append("MXFP8 scales must be swizzled 32x4x4")
    elif recipe_a == recipe_b == _TENSOR_WISE:
        problems += _operand_dtypes(a, b) + _float32_scale("scale_a", scale_a) + _float32_scale("scale_b", scale_b)
    elif recipe_a == recipe_b == _ROW_WISE:
        problems += _operand_dtypes(a, b, allowed_b=_E4M3 if arch == 100 else _FP8)
        problems += _float32_scale("scale_a", scale_a, (m, 1)) + _float32_scale("scale_b", scale_b, (1, n))
    else:
        problems.append(f"scale recipes {recipe_a} x {recipe_b} are not a pair fp8graph uses")
    return problems


def _strides_aligned(name: str, x: torch.Tensor) -> list[str]:
    return [f"{name}'s stride {stride} is not a multiple of {STRIDE_ALIGNMENT_BYTES} bytes"
            for stride, size in zip(x.stride(), x.shape)
            if stride != 1 and size > 1 and (stride * x.element_size()) % STRIDE_ALIGNMENT_BYTES]


def _offsets(offs: torch.Tensor | None, bound: int, what: str) -> tuple[list[str], list[int]]:
    if offs is None or offs.dtype != torch.int32 or offs.dim() != 1:
        return ["offs must be a 1-D int32 tensor of group ends"], []
    ends = offs.tolist()
    problems = []
    if len(ends) >= _GROUP_LIMIT:
        problems.append(f"{len(ends)} groups: torch takes fewer than {_GROUP_LIMIT}")
    if any(later < earlier for earlier, later in zip(ends, ends[1:])) or (ends and ends[0] < 0):
        problems.append("offs is not sorted")  # a device-side assert in the kernel's setup
    if ends and ends[-1] > bound:
        problems.append(f"offs ends at {ends[-1]}, past the {bound} {what}")
    return problems, ends


def grouped_violations(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       offs: torch.Tensor | None, *, out_dtype: torch.dtype | None = None,
                       out: torch.Tensor | None = None, arch: int = 90) -> list[str]:
    """The rules a ``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=...)`` call breaks on SM
    ``arch``: the rows form (S, K) x (E, K, N) or the weights form (N, S) x (S, K), as fp8graph's expert GEMMs
    call it (``fp8graph.gemm.grouped_gemm``, ``fp8graph.gemm.grouped_mx``)."""
    _check_arch(arch)
    mx = scale_a.dtype == _E8M0
    problems = _operand_dtypes(a, b, _E4M3, _E4M3) + _row_major("a", a) + _column_major("b", b)
    for name, x in (("a", a), ("b", b), ("output", out)):
        problems += _misaligned(name, x, STRIDE_ALIGNMENT_BYTES) + ([] if x is None else _strides_aligned(name, x))
    if (out_dtype or a.dtype) != torch.bfloat16:
        problems.append(f"grouped FP8 GEMMs write bfloat16 only, not {out_dtype}")
    if mx and arch != 100:
        problems.append("MXFP8 grouped GEMMs run on SM 10.x only")
    if not mx and arch != 90:
        problems.append("row-wise grouped GEMMs run on SM 9.x only (CUTLASS's kernel is Hopper's)")
    if mx and not (a.is_contiguous() and b.transpose(-2, -1).is_contiguous()):
        problems.append("MXFP8 grouped GEMMs read a contiguous and b^T contiguous")
    if b.dim() == 3:  # rows: (S, K) x (E, K, N)
        (rows, k), (weights, _, n) = a.shape, b.shape
        offsets_problems, ends = _offsets(offs, rows, "rows of a")
        problems += offsets_problems + _multiples({"K": k, "N": n})
        if ends and weights != len(ends):
            problems.append(f"b holds {weights} experts, offs {len(ends)}")
        if mx:
            return problems + _misaligned("scale_a", scale_a, SCALE_ALIGNMENT_BYTES) \
                + _misaligned("scale_b", scale_b, SCALE_ALIGNMENT_BYTES)
        return problems + _float32_scale("scale_a", scale_a, (rows,)) + _float32_scale("scale_b", scale_b,
                                                                                           (len(ends), n))
    (n, tokens), k = a.shape, b.shape[1]  # weights: (N, S) x (S, K), every group reduced over its tokens
    offsets_problems, ends = _offsets(offs, tokens, "tokens")
    problems += offsets_problems + _multiples({"K": k, "N": n, "the tokens": tokens})
    ragged = [end for end in ends[:-1] if end % FP8_GEMM_DIM_MULTIPLE]  # a device-side assert in the kernel
    if ragged:
        problems.append(f"group ends {ragged[:4]} are not multiples of {FP8_GEMM_DIM_MULTIPLE} tokens")
    if mx:
        return problems + _misaligned("scale_a", scale_a, SCALE_ALIGNMENT_BYTES) \
            + _misaligned("scale_b", scale_b, SCALE_ALIGNMENT_BYTES)
    return problems + _float32_scale("scale_a", scale_a, (len(ends) * n,)) \
        + _float32_scale("scale_b", scale_b, (len(ends) * k,))
