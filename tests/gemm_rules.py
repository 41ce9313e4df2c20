"""The GPU's FP8 GEMM libraries stood in for on the CPU: every call fp8graph's native lowering makes, checked
against cuBLASLt's and CUTLASS's rules (``fp8graph.gemm.library_rules``) and computed exactly.

:func:`gpu_gemms` registers CPU kernels for ``aten::_scaled_mm`` (and its ``out=`` form, which Inductor's
generated code calls), ``aten::_scaled_mm_v2`` (``F.scaled_mm``: block and MXFP8 scales) and
``aten::_scaled_grouped_mm``, so the checks run wherever the call comes from: eager, aot_eager, or the
wrapper code Inductor generates. :func:`pretend_gpu` makes fp8graph choose the native lowering as it does on
an SM 9.0 or SM 10.0 GPU, so a CPU run goes through the GPU's graph: its layouts, paddings, scale views
and calls. Each kernel records the call and the rules it breaks, then computes the product from the FP8
operands and their dequantization factors in fp32 (products of FP8 values are exact there), reading every
scale layout as the library does: a wrong layout gives a wrong product, a broken rule a recorded
violation.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.testing._internal.common_quantized import from_blocked

import fp8graph
from fp8graph.gemm import library_rules

_E8M0 = torch.float8_e8m0fnu
_CUDA = torch.device("cuda")


@dataclasses.dataclass
class GemmCall:
    """One call: the op, the shapes and dtypes of what it read, and the rules it broke."""

    op: str
    operands: tuple
    violations: list[str]

    def __str__(self) -> str:
        return f"{self.op}{self.operands}: " + "; ".join(self.violations)


@dataclasses.dataclass
class GemmCalls:
    """The calls made, each checked against the rules of every compute capability in ``arches`` (the lowering
    chosen as on the first)."""

    arches: tuple[int, ...]
    calls: list[GemmCall] = dataclasses.field(default_factory=list)

    def broken(self) -> list[GemmCall]:
        return [call for call in self.calls if call.violations]

    def ops(self) -> set[str]:
        return {call.op for call in self.calls}

    def assert_every_rule_kept(self) -> None:
        assert self.calls, "no FP8 GEMM was called: nothing was checked"
        broken = self.broken()
        arches = " and ".join(f"SM {arch / 10:.1f}" for arch in self.arches)
        assert not broken, f"{len(broken)} of {len(self.calls)} calls break {arches}'s rules:\n" + \
            "\n".join(map(str, broken[:10]))


def _described(*tensors) -> tuple:
    return tuple(None if t is None else (tuple(t.shape), t.stride(), str(t.dtype).removeprefix("torch."))
                 for t in tensors)


def _to(product_fp32: torch.Tensor, bias, out_dtype, like: torch.Tensor) -> torch.Tensor:
    if bias is not None:
        product_fp32 = product_fp32 + bias.float()
    return product_fp32.to(out_dtype or like.dtype)


def _emulated_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype):
    return _to((a.float() @ b.float()) * scale_a.float() * scale_b.float(), bias, out_dtype, a)


def _block_dequantized(x_fp8: torch.Tensor, scale: torch.Tensor, recipe: int) -> torch.Tensor:
    """``x_fp8`` (rows, K) times the 1x128 or 128x128 dequantization factors cuBLAS reads for it."""
    rows, depth = x_fp8.shape
    tiles = -(-depth // 128)
    if recipe == library_rules._BLOCK_1x128:  # (rows, tiles): a factor a row and tile
        factors = scale
    else:  # (padded tiles, rows / 128): transposed, a factor a 128-row tile and K tile
        factors = scale.t()[:, :tiles].repeat_interleave(128, 0)[:rows]
    return x_fp8.float() * factors.float().repeat_interleave(128, 1)[:, :depth]


def _mx_dequantized(x_fp8: torch.Tensor, flat_scales: torch.Tensor, position: int = 0) -> tuple:
    """``x_fp8`` (R, C) dequantized with its swizzled E8M0 scales read from ``flat_scales`` at ``position``
    (R padded to 128, C / 32 padded to 4, as cuBLAS lays them out); returns it and the next position."""
    rows, columns = x_fp8.shape
    size = (-(-rows // 128) * 128) * (-(-(columns // 32) // 4) * 4)
    scales = from_blocked(x_fp8, flat_scales[position:position + size].view(_E8M0), 32)
    return x_fp8.float() * scales.float().repeat_interleave(32, 1), position + size


def _emulated_scaled_mm_v2(a, b, scales_a, recipes_a, scales_b, recipes_b, bias, out_dtype):
    (scale_a,), (scale_b,), (recipe_a,), (recipe_b,) = scales_a, scales_b, recipes_a, recipes_b
    if recipe_a == library_rules._BLOCK_1x32:
        a_fp32, _ = _mx_dequantized(a, scale_a.flatten())
        b_fp32, _ = _mx_dequantized(b.t(), scale_b.flatten())
        return _to(a_fp32 @ b_fp32.t(), bias, out_dtype, a)
    if recipe_a in (library_rules._BLOCK_1x128, library_rules._BLOCK_128x128):
        a_fp32, b_fp32 = _block_dequantized(a, scale_a, recipe_a), _block_dequantized(b.t(), scale_b, recipe_b)
        return _to(a_fp32 @ b_fp32.t(), bias, out_dtype, a)
    return _emulated_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)


def _group_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))


def _emulated_grouped(a, b, scale_a, scale_b, offs, out_dtype):
    """Both forms of ``torch._scaled_grouped_mm``, reading only inside the groups, row-wise or MXFP8 scales."""
    mx = scale_a.dtype == _E8M0
    if b.dim() == 3:  # rows: (S, K) x (E, K, N)
        output, position = torch.zeros(a.shape[0], b.shape[2]), 0
        for expert, (start, end) in enumerate(_group_bounds(offs)):
            if end <= start:
                continue
            if mx:
                rows, position = _mx_dequantized(a[start:end], scale_a.flatten(), position)
                weight, _ = _mx_dequantized(b[expert].t(), scale_b[expert])
                output[start:end] = rows @ weight.t()
            else:
                output[start:end] = ((a[start:end].float() * scale_a[start:end, None])
                                     @ (b[expert].float() * scale_b[expert][None, :]))
        return output.to(out_dtype)
    experts, rows, columns = len(offs), a.shape[0], b.shape[1]  # weights: (N, S') x (S', K)
    output, positions = torch.zeros(experts, rows, columns), [0, 0]
    for expert, (start, end) in enumerate(_group_bounds(offs)):
        if end <= start:
            continue
        if mx:
            a_group, positions[0] = _mx_dequantized(a[:, start:end], scale_a.flatten(), positions[0])
            b_group, positions[1] = _mx_dequantized(b.t()[:, start:end], scale_b.flatten(), positions[1])
            output[expert] = a_group @ b_group.t()
        else:
            output[expert] = (a[:, start:end].float() @ b[start:end].float()) \
                * scale_a.reshape(experts, rows)[expert][:, None] * scale_b.reshape(experts, columns)[expert][None, :]
    return output.to(out_dtype)


def _kernels(record: GemmCalls) -> dict:
    def note(op, check, *tensors):
        violations = [f"SM {arch / 10:.1f}: {violation}" for arch in record.arches for violation in check(arch)]
        record.calls.append(GemmCall(op, _described(*tensors), violations))

    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False,
                  out=None):
        note("_scaled_mm", lambda arch: library_rules.scaled_mm_violations(
            a, b, scale_a, scale_b, bias=bias, out=out, out_dtype=out_dtype, arch=arch), a, b, scale_a, scale_b)
        return _emulated_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)

    def scaled_mm_out(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False, *,
                      out):
        return out.copy_(scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum, out))

    def scaled_mm_v2(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias, out_dtype,
                     contraction_dim=(), use_fast_accum=False, out=None):
        note("_scaled_mm_v2", lambda arch: library_rules.scaled_mm_v2_violations(
            a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias=bias, out=out,
            out_dtype=out_dtype, use_fast_accum=use_fast_accum, arch=arch), a, b, *scale_a, *scale_b)
        return _emulated_scaled_mm_v2(a, b, scale_a, recipe_a, scale_b, recipe_b, bias, out_dtype)

    def scaled_mm_v2_out(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias, out_dtype,
                         contraction_dim=(), use_fast_accum=False, *, out):
        return out.copy_(scaled_mm_v2(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias,
                                      out_dtype, contraction_dim, use_fast_accum, out))

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                          use_fast_accum=False):
        note("_scaled_grouped_mm", lambda arch: library_rules.grouped_violations(
            a, b, scale_a, scale_b, offs, out_dtype=out_dtype, arch=arch), a, b, scale_a, scale_b, offs)
        return _emulated_grouped(a, b, scale_a, scale_b, offs, out_dtype)

    return {"_scaled_mm": scaled_mm, "_scaled_mm.out": scaled_mm_out, "_scaled_mm_v2": scaled_mm_v2,
            "_scaled_mm_v2.out": scaled_mm_v2_out, "_scaled_grouped_mm": scaled_grouped_mm}


@contextlib.contextmanager
def gpu_gemms(arches: tuple[int, ...] = (90,)):
    """Inside: every FP8 GEMM on CPU tensors checked against the rules of each compute capability of ``arches``
    and computed exactly; yields the :class:`GemmCalls` record."""
    record = GemmCalls(tuple(arches))
    library = torch.library.Library("aten", "IMPL")
    try:
        for name, kernel in _kernels(record).items():
            library.impl(name, kernel, "CPU")
        yield record
    finally:
        library._destroy()


@contextlib.contextmanager
def pretend_gpu(monkeypatch, arch: int = 90, also: tuple[int, ...] = ()):
    """fp8graph picks each site's lowering as on a GPU of compute capability ``arch / 10`` (the graph still runs
    on the CPU), and the GEMMs are checked against its rules and those of the capabilities ``also`` lists
    (where the same recipe lowers to the same calls): yields :func:`gpu_gemms`' record."""
    monkeypatch.setattr(fp8graph.passes.pipeline, "graph_device", lambda example_inputs: _CUDA)
    monkeypatch.setattr(fp8graph.gemm.scaled_gemm, "_capability", lambda device: divmod(arch, 10))
    with gpu_gemms((arch, *also)) as record:
        yield record
