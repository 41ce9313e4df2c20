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

A batch of matrices (B, R, C), an expert weight's cast, is transposed
matrix by matrix, and ``fp8graph::transpose_fp8_into_`` writes the transpose
into a given buffer (an expert weight's kept copy along N) rather than a new
tensor that a ``copy_`` would then write again. An input whose transpose is
already laid out contiguously (the cast of a weight stored the other way round,
read as a transposed view) is copied as it lies, no kernel of this op needed.

On CUDA it runs ``transpose_bytes_kernel`` (``_transpose_fp8_triton``);
everywhere else, and where Triton is missing, ``x.transpose(-2, -1)``'s
contiguous copy (of the gathered rows), which the tests hold the kernel to bit
for bit. A transpose is exact.
"""

from __future__ import annotations

import torch

from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available

__all__ = ["plan_transpose_fp8", "transpose_fp8", "transpose_fp8_into_", "transpose_fp8_triton"]

_BLOCK = 64  # a 64x64 tile of bytes: 16-byte vector loads and stores, 4 KB of shared memory
_NUM_WARPS = 4
_MAX_GRID = 65535  # a CUDA grid's second and third axes: column tiles, matrices


def _checked(x_fp8: torch.Tensor, source_rows: torch.Tensor | None, op: str = "transpose_fp8") -> None:
    if x_fp8.dim() not in (2, 3) or x_fp8.element_size() != 1:
        raise ValueError(f"{op} takes a 2-D tensor of 1-byte elements (or a batch of them, (B, R, C)), got "
                         f"{x_fp8.dtype} of shape {tuple(x_fp8.shape)}")
    if source_rows is not None and x_fp8.dim() == 3:
        raise ValueError(f"{op} gathers source_rows of a 2-D tensor only, got a batch of shape {tuple(x_fp8.shape)}")
    if source_rows is not None and (source_rows.dim() != 1 or source_rows.dtype != torch.int64):
        raise ValueError(f"{op}'s source_rows is a 1-D int64 tensor, got {source_rows.dtype} "
                         f"of shape {tuple(source_rows.shape)}")
    batch = x_fp8.shape[0] if x_fp8.dim() == 3 else 1
    if batch > _MAX_GRID or -(-x_fp8.shape[-1] // _BLOCK) > _MAX_GRID:
        raise ValueError(f"{op} takes at most {_MAX_GRID} matrices of at most {_MAX_GRID * _BLOCK} columns (the "
                         f"kernel's grid), got shape {tuple(x_fp8.shape)}")


def _transposed_shape(x_fp8: torch.Tensor, source_rows: torch.Tensor | None) -> tuple[int, ...]:
    rows = x_fp8.shape[-2] if source_rows is None else source_rows.shape[0]
    return (*x_fp8.shape[:-2], x_fp8.shape[-1], rows)


def _checked_destination(x_fp8: torch.Tensor, out: torch.Tensor) -> None:
    """``transpose_fp8_into_``'s arguments: ``x_fp8`` as :func:`_checked` takes it, ``out`` its transpose's shape,
    dtype and device, contiguous."""
    _checked(x_fp8, None, "transpose_fp8_into_")
    expected = _transposed_shape(x_fp8, None)
    if (tuple(out.shape) != expected or out.dtype != x_fp8.dtype or out.device != x_fp8.device
            or not out.is_contiguous()):
        raise ValueError(f"transpose_fp8_into_ writes a contiguous {x_fp8.dtype} tensor of shape {expected} on "
                         f"{x_fp8.device}, got {out.dtype} of shape {tuple(out.shape)} on {out.device}"
                         f"{'' if out.is_contiguous() else ', not contiguous'}")


def plan_transpose_fp8(x_fp8: torch.Tensor, source_rows: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> tuple[KernelLaunch, torch.Tensor]:
    """The launch that writes ``x_fp8.transpose(-2, -1).contiguous()`` of a 2-D ``x_fp8`` (of its rows
    ``source_rows``, zeros where negative, when given) or of each matrix of a 3-D one, into ``out`` if given
    (contiguous, of that shape), else into a new tensor."""
    from triton import cdiv

    from fp8graph.kernels._transpose_fp8_triton import transpose_bytes_kernel

    _checked(x_fp8, source_rows)
    if x_fp8.stride(-1) != 1 and x_fp8.shape[-1] > 1:
        x_fp8 = x_fp8.contiguous()
    batch = x_fp8.shape[0] if x_fp8.dim() == 3 else 1
    columns = x_fp8.shape[-1]
    rows = x_fp8.shape[-2] if source_rows is None else source_rows.shape[0]
    if out is None:
        out = torch.empty(_transposed_shape(x_fp8, source_rows), dtype=x_fp8.dtype, device=x_fp8.device)
    else:
        _checked_destination(x_fp8, out)
    grid = (cdiv(rows, _BLOCK), cdiv(columns, _BLOCK), batch)
    gather = source_rows is not None
    launch = KernelLaunch(transpose_bytes_kernel, grid,
                          (x_fp8.view(torch.uint8), out.view(torch.uint8),
                           source_rows.contiguous() if gather else x_fp8.view(torch.uint8), rows, columns,
                           x_fp8.stride(-2), x_fp8.stride(0) if x_fp8.dim() == 3 else 0),
                          {"GATHER": gather, "BLOCK_ROWS": _BLOCK, "BLOCK_COLUMNS": _BLOCK, "num_warps": _NUM_WARPS})
    return launch, out


def transpose_fp8_triton(x_fp8: torch.Tensor, source_rows: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the Triton kernel: ``x_fp8.transpose(-2, -1).contiguous()`` (of the rows ``source_rows`` names),
    written into ``out`` if given. A transposed view of a contiguous tensor is copied as it lies."""
    if source_rows is None and x_fp8.transpose(-2, -1).is_contiguous():
        return _transposed_copy(x_fp8, None) if out is None else _copied_into(x_fp8, out)
    launch, x_t_fp8 = plan_transpose_fp8(x_fp8, source_rows, out)
    if x_t_fp8.numel():
        launch()
    return x_t_fp8


def _transposed_copy(x_fp8: torch.Tensor, source_rows: torch.Tensor | None) -> torch.Tensor:
    """``transpose_fp8`` in torch ops, checked: the reference, and where the kernel is not needed."""
    _checked(x_fp8, source_rows)
    if source_rows is not None and x_fp8.shape[0] == 0:  # nothing to gather: every column a pad
        return x_fp8.new_zeros((x_fp8.shape[1], source_rows.shape[0]))
    if source_rows is not None:
        present = source_rows >= 0
        rows = x_fp8.view(torch.uint8).index_select(0, source_rows.clamp(min=0))
        x_fp8 = torch.where(present[:, None], rows, 0).to(torch.uint8).view(x_fp8.dtype)
    # clone, not contiguous(): the transpose of one row is contiguous already, and an op may not return an alias.
    return x_fp8.transpose(-2, -1).clone(memory_format=torch.contiguous_format)


def _copied_into(x_fp8: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``transpose_fp8_into_`` in torch ops, checked: the reference, and where the kernel is not needed."""
    _checked_destination(x_fp8, out)
    return out.copy_(x_fp8.transpose(-2, -1))


@torch.library.custom_op("fp8graph::transpose_fp8", mutates_args=())
def transpose_fp8(x_fp8: torch.Tensor, source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x_fp8.transpose(-2, -1).contiguous()``: the (C, R) row-major copy of an (R, C) FP8 matrix (of each matrix of
    a (B, R, C) batch: (B, C, R)); with ``source_rows`` (P,)
    int64, the (C, P) copy whose column ``p`` is row ``source_rows[p]`` of ``x_fp8``, zeros where negative.
    ``source_rows`` must hold row indices of ``x_fp8`` or -1, on its device: unchecked, as a check would wait
    for the device (``fp8graph.numerics.groups.padded_group_sources`` makes them so)."""
    return _transposed_copy(x_fp8, source_rows)


@transpose_fp8.register_fake
def _(x_fp8, source_rows=None):
    _checked(x_fp8, source_rows)
    return x_fp8.new_empty(_transposed_shape(x_fp8, source_rows))


@transpose_fp8.register_kernel("cuda")
def _(x_fp8, source_rows=None):
    if not triton_available():
        return _transposed_copy(x_fp8, source_rows)
    return transpose_fp8_triton(x_fp8, source_rows)


@torch.library.custom_op("fp8graph::transpose_fp8_into_", mutates_args=("out",))
def transpose_fp8_into_(x_fp8: torch.Tensor, out: torch.Tensor) -> None:
    """``out.copy_(x_fp8.transpose(-2, -1))`` for a 2-D or 3-D ``x_fp8`` and a contiguous ``out``: the transposed
    layout written straight into a buffer that keeps it (an expert weight's kept copy along N,
    ``fp8graph.targets.grouped``), where ``transpose_fp8`` and a ``copy_`` would write it twice. Inductor writes a
    graph input's mutation by this op in place (its re-inplacing of functionalized mutations)."""
    _copied_into(x_fp8, out)


@transpose_fp8_into_.register_fake
def _(x_fp8, out):
    _checked_destination(x_fp8, out)


@transpose_fp8_into_.register_kernel("cuda")
def _(x_fp8, out):
    if not triton_available():
        _copied_into(x_fp8, out)
        return
    transpose_fp8_triton(x_fp8, None, out)
