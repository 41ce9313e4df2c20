"""``fp8graph::transpose_fp8``: the transposed, contiguous copy of a row-major FP8 matrix.

Why an op of its own: the H100's FP8 GEMMs read both layouts of an input and
of a gradient (the forward and grad_input GEMMs one, the grad_weight GEMM the
other). Written as ``x_fp8.t().contiguous()`` in the graph, Inductor inlines
the cast into the transposed copy and recomputes it from the high-precision
tensor, in the same kernel as the amax reduction of a delayed cast, which the
GPU then runs far below a copy's bandwidth (the H100's numbers: the quantize
table of ``docs/benchmarks.md``). As an
op, the transposed copy reads the FP8 bytes already written (1 byte an element
read, 1 written) in a kernel of its own, and the delayed cast keeps its one
pass: amax and row-major FP8 from one read, fused into the producer.

With ``source_rows``, column ``r`` of the copy is row ``source_rows[r]`` of
the input, zeros where that is negative: how a grouped GEMM's weight-gradient
operand is laid out, its token groups zero-padded (``fp8graph.gemm.grouped_gemm``),
in the same one pass. Scattering the columns of the transpose in place instead
writes each byte a row apart, one 32-byte memory sector a byte.

On CUDA it runs ``transpose_bytes_kernel`` (``_transpose_fp8_triton``);
everywhere else, and where Triton is missing, ``x.t().contiguous()`` (of the
gathered rows), which the tests hold the kernel to bit for bit. A transpose is exact.
"""

from __future__ import annotations

import torch

from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available

__all__ = ["plan_transpose_fp8", "transpose_fp8", "transpose_fp8_triton"]

_BLOCK = 64  # a 64x64 tile of bytes: 16-byte vector loads and stores, 4 KB of shared memory
_NUM_WARPS = 4


def plan_transpose_fp8(x_fp8: torch.Tensor, source_rows: torch.Tensor | None = None
                       ) -> tuple[KernelLaunch, torch.Tensor]:
    """The launch that writes ``x_fp8.t().contiguous()`` of a 2-D ``x_fp8`` (of its rows ``source_rows``, zeros
    where negative, when given)."""
    from triton import cdiv

    from fp8graph.kernels._transpose_fp8_triton import transpose_bytes_kernel

    if x_fp8.dim() != 2 or x_fp8.element_size() != 1:
        raise ValueError(f"transpose_fp8 takes a 2-D tensor of 1-byte elements, got {x_fp8.dtype} "
                         f"of shape {tuple(x_fp8.shape)}")
    if source_rows is not None and (source_rows.dim() != 1 or source_rows.dtype != torch.int64):
        raise ValueError(f"transpose_fp8's source_rows is a 1-D int64 tensor, got {source_rows.dtype} "
                         f"of shape {tuple(source_rows.shape)}")
    if x_fp8.stride(1) != 1 and x_fp8.shape[1] > 1:
        x_fp8 = x_fp8.contiguous()
    columns = x_fp8.shape[1]
    rows = x_fp8.shape[0] if source_rows is None else source_rows.shape[0]
    x_t_fp8 = torch.empty((columns, rows), dtype=x_fp8.dtype, device=x_fp8.device)
    grid = (cdiv(rows, _BLOCK), cdiv(columns, _BLOCK))
    gather = source_rows is not None
    launch = KernelLaunch(transpose_bytes_kernel, grid,
                          (x_fp8.view(torch.uint8), x_t_fp8.view(torch.uint8),
                           source_rows.contiguous() if gather else x_fp8.view(torch.uint8), rows, columns,
                           x_fp8.stride(0)),
                          {"GATHER": gather, "BLOCK_ROWS": _BLOCK, "BLOCK_COLUMNS": _BLOCK, "num_warps": _NUM_WARPS})
    return launch, x_t_fp8


def transpose_fp8_triton(x_fp8: torch.Tensor, source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Run the Triton kernel: ``x_fp8.t().contiguous()`` (of the rows ``source_rows`` names)."""
    launch, x_t_fp8 = plan_transpose_fp8(x_fp8, source_rows)
    if x_t_fp8.numel():
        launch()
    return x_t_fp8


def _transposed_copy(x_fp8: torch.Tensor, source_rows: torch.Tensor | None) -> torch.Tensor:
    if source_rows is not None and x_fp8.shape[0] == 0:  # nothing to gather: every column a pad
        return x_fp8.new_zeros((x_fp8.shape[1], source_rows.shape[0]))
    if source_rows is not None:
        present = source_rows >= 0
        rows = x_fp8.view(torch.uint8).index_select(0, source_rows.clamp(min=0))
        x_fp8 = torch.where(present[:, None], rows, 0).to(torch.uint8).view(x_fp8.dtype)
    # clone, not contiguous(): the transpose of one row is contiguous already, and an op may not return an alias.
    return x_fp8.t().clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("fp8graph::transpose_fp8", mutates_args=())
def transpose_fp8(x_fp8: torch.Tensor, source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x_fp8.t().contiguous()``: the (C, R) row-major copy of an (R, C) FP8 matrix; with ``source_rows`` (P,)
    int64, the (C, P) copy whose column ``p`` is row ``source_rows[p]`` of ``x_fp8``, zeros where negative.
    ``source_rows`` must hold row indices of ``x_fp8`` or -1, on its device: unchecked, as a check would wait
    for the device (``fp8graph.numerics.groups.padded_group_sources`` makes them so)."""
    return _transposed_copy(x_fp8, source_rows)


@transpose_fp8.register_fake
def _(x_fp8, source_rows=None):
    rows = x_fp8.shape[0] if source_rows is None else source_rows.shape[0]
    return x_fp8.new_empty((x_fp8.shape[1], rows))


@transpose_fp8.register_kernel("cuda")
def _(x_fp8, source_rows=None):
    if not triton_available():
        return _transposed_copy(x_fp8, source_rows)
    return transpose_fp8_triton(x_fp8, source_rows)
