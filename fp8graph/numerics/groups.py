"""Quantization of token groups: the operands of a mixture-of-experts' grouped GEMMs.

The experts' GEMMs run over the tokens sorted by expert, in groups that
``offsets`` (E,) bounds: expert ``e`` owns rows ``offsets[e-1]:offsets[e]``
(``offsets[-1]`` may be below the row count: rows past it belong to no
expert, and every grouped GEMM leaves them out). Offsets come from the
routing, so group sizes are known only when the graph runs: everything here
is tensor code over a per-row group id, never a loop over experts.

    forward      output      (S, N)    = x (S, K)      . W_e (N, K)^T     per group, reduced along K
    backward     grad_input  (S, K)    = grad (S, N)   . W_e (N, K)       per group, reduced along N
                 grad_weight (E, N, K) = grad_e^T      . x_e              reduced along the group's tokens

So an operand of the weight-gradient GEMM is scaled per group and column
(:func:`quantize_group_columns`), where the others are scaled per row
(``fp8graph.numerics.quantize`` / ``tiles``). Scales follow
``fp8graph.numerics.quantize``: ``x_fp8 = cast(x_hp * scale)``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from fp8graph.numerics.quantize import amax_to_scale, finite_magnitude, quantize

__all__ = ["group_block_amax", "group_column_amax", "group_padding", "padded_group_bound", "padded_group_offsets",
           "padded_group_rows", "padded_group_sources", "place_in_padded_groups", "quantize_group_columns", "row_groups",
           "ExpertGemm", "weight_copies_kept", "weight_copy_fits"]


def row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of ``rows`` rows (int64, (rows,)): ``e`` for rows ``offsets[e-1]:offsets[e]``,
    ``len(offsets)`` for rows past the last offset (no group)."""
    positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, positions, right=True)


def group_column_amax(x_hp: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Largest finite magnitude of each column within each group: (E + 1, C) fp32, the last row
    that of the rows in no group. An empty group's amax is 0.

    The groups are contiguous runs of rows, so each is one segment of a segment reduction: one pass over
    ``x_hp``, each output element reduced by one thread. A scatter of every element into its group's row
    (``scatter_reduce``) computes the same with an atomic per element, several times slower on a GPU
    (measured in ``docs/mixture-of-experts.md``).
    """
    # Stored for torch.segment_reduce (an ATen kernel, which reads it from memory) in x_hp's dtype: the max of
    # those values is exact in it, and each group's one amax makes both its cast's scale and its GEMM's.
    magnitude = finite_magnitude(x_hp.detach()).to(x_hp.dtype)
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    lengths = torch.cat([sizes, (magnitude.shape[0] - offsets[-1:])]).to(torch.int64)
    # unsafe: the lengths sum to the row count by construction, and checking would wait for the device.
    table = torch.segment_reduce(magnitude, "max", lengths=lengths, axis=0, unsafe=True, initial=0)
    return table.to(torch.float32)


def group_block_amax(x_hp: torch.Tensor, offsets: torch.Tensor, block: int) -> torch.Tensor:
    """Largest finite magnitude of each group's (and the rows in no group's) blocks of ``block`` columns:
    (E + 1, ceil(C / block)) fp32, a last block short where ``block`` does not divide C. What fp8graph's kernels
    that cast a grouped operand per tensor return for delayed scaling to record: their max is the amax."""
    table = group_column_amax(x_hp, offsets)
    blocks = -(-table.shape[1] // block)
    table = torch.nn.functional.pad(table, (0, blocks * block - table.shape[1]))
    return table.reshape(table.shape[0], blocks, block).amax(2)


def quantize_group_columns(x_hp: torch.Tensor, offsets: torch.Tensor, fp8_dtype: torch.dtype,
                           power_2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_hp`` (R, C) cast with one scale per group and column; returns ``(x_fp8 (R, C), scale (E, C))``.

    What the weight-gradient GEMM reduces over is a group's tokens, so each of its columns within a
    group shares a scale, as a row-wise operand's row does. An empty group's scale is 1.
    """
    scale = amax_to_scale(group_column_amax(x_hp, offsets), fp8_dtype, power_2_scales)  # (E + 1, C)
    return quantize(x_hp, scale[row_groups(offsets, x_hp.shape[0])], fp8_dtype), scale[:offsets.shape[0]]


def padded_group_rows(offsets: torch.Tensor, rows: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row goes when every group is zero-padded to a multiple of ``multiple`` rows.

    Returns ``(destination (rows,), padded_offsets (E,), padded_rows)``: row ``r`` of group ``e`` moves to
    ``destination[r]``, the groups end at ``padded_offsets``, and ``padded_rows`` (``rows + E * multiple``
    rounded up to a multiple, known when the graph is built) bounds them; rows in no group land past
    ``padded_offsets[-1]``. The weight-gradient GEMM reduces over a group's tokens, and FP8 kernels take K in
    multiples of 16: zero rows add nothing to its products.
    """
    count = offsets.shape[0]
    sizes, padded_sizes = _group_sizes(offsets, multiple)
    padded_offsets = torch.cumsum(padded_sizes, 0, dtype=offsets.dtype)
    starts = offsets - sizes
    padded_starts = padded_offsets - padded_sizes
    groups = row_groups(offsets, rows)
    in_group = groups < count
    group = groups.clamp(max=count - 1)
    positions = torch.arange(rows, device=offsets.device, dtype=torch.int64)
    inside = positions - starts[group].to(torch.int64) + padded_starts[group].to(torch.int64)
    # Rows in no group go after every padded group, in order: past padded_offsets[-1], never read.
    outside = positions - offsets[-1].to(torch.int64) + padded_offsets[-1].to(torch.int64)
    destination = torch.where(in_group, inside, outside)
    return destination, padded_offsets, padded_group_bound(rows, count, multiple)


def _group_sizes(offsets: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's rows and its rows zero-padded to a multiple of ``multiple``: ``(sizes, padded_sizes)``, (E,)."""
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return sizes, (sizes + multiple - 1) // multiple * multiple


def padded_group_offsets(offsets: torch.Tensor, multiple: int) -> torch.Tensor:
    """Where the groups ``offsets`` ends end when each is zero-padded to a multiple of ``multiple`` rows (E,)."""
    return torch.cumsum(_group_sizes(offsets, multiple)[1], 0, dtype=offsets.dtype)


def padded_group_bound(rows: int, groups: int, multiple: int) -> int:
    """Rows of the padded layout of ``rows`` rows in ``groups`` groups: ``rows + groups * multiple`` rounded up to
    a multiple, a bound known when the graph is built (each group gains fewer than ``multiple`` rows)."""
    return -(-(rows + groups * multiple) // multiple) * multiple


class ExpertGemm(NamedTuple):
    """One trained expert GEMM in FP8, as :func:`weight_copy_fits` and :func:`weight_copies_kept` weigh it: its
    input of ``routed_rows`` S rows of ``in_features`` K, and its weight of ``experts`` x ``out_features`` N x K
    elements. ``per_tensor``: a per-tensor recipe on the native path, which keeps a scale an expert for the
    weight and may keep a one-byte copy of it for grad_input; else row-wise, which keeps no copy and a scale a
    group and column for its input's grad_weight layout."""

    routed_rows: object  # an int, or a SymInt where the tokens are symbolic
    experts: int
    out_features: int
    in_features: int
    per_tensor: bool = True


_FP32 = 4  # bytes of a scale


def _input_saving(gemm: ExpertGemm, multiple: int) -> "int | torch.SymInt":
    """Bytes FP8 keeps less than BF16 for the GEMM's backward, the weight's copy aside: BF16 keeps the S input
    rows of K in 2 bytes, FP8 grad_weight's layout of them (:func:`padded_group_bound` rows) in 1, with its scales
    for the backward (per tensor, each expert's weight scale; row-wise, the layout's scale a group and column)."""
    padded = padded_group_bound(gemm.routed_rows, gemm.experts, multiple)
    scales = gemm.experts * (1 if gemm.per_tensor else gemm.in_features)
    return gemm.in_features * (2 * gemm.routed_rows - padded) - _FP32 * scales


def _copy_bytes(gemm: ExpertGemm) -> int:
    """The weight's copy for grad_input: one byte an element, and the inverse scale the forward GEMM reads, one
    fp32 an expert and output row, tied to it (``fp8graph.targets.partitioning``)."""
    return gemm.experts * gemm.out_features * (gemm.in_features + _FP32)


def weight_copy_fits(gemm: ExpertGemm, multiple: int) -> bool:
    """Whether the GEMM keeps a weight copy (a per-tensor one) that takes no more memory than FP8 saves over
    BF16 on its own input (:func:`_copy_bytes` against :func:`_input_saving`): on average a little over
    ``out_features + multiple`` tokens a group (Qwen3-30B-A3B's down projection, N = 2048: 2075). A symbolic S
    fits only where that is provable: no guard is made on it."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return gemm.per_tensor and statically_known_true(_input_saving(gemm, multiple) >= _copy_bytes(gemm))


def weight_copies_kept(gemms: Sequence[ExpertGemm], multiple: int) -> tuple[bool, ...]:
    """Which of one expert MLP's GEMMs keep their weight's copy for grad_input from the forward, so that the MLP
    keeps no more bytes for its backward than BF16's does: what FP8 saves on all of their inputs pays for the
    copies together. A GEMM whose own input pays for its copy keeps it (:func:`weight_copy_fits`); then, largest
    first, each other copy that what the inputs save beyond the copies kept still pays for. Qwen3-30B-A3B's down
    projection at 2048 tokens an expert (which on its own would need 2075) keeps its copy on what both inputs
    save beyond gate_up's copy. Where a routed-row count is symbolic, each GEMM pays for its own (no guard is made
    on the sizes)."""
    kept = [weight_copy_fits(gemm, multiple) for gemm in gemms]
    if not all(isinstance(gemm.routed_rows, int) for gemm in gemms):
        return tuple(kept)
    copies = [_copy_bytes(gemm) for gemm in gemms]
    left = sum(_input_saving(gemm, multiple) for gemm in gemms) - sum(
        copy for copy, keeps in zip(copies, kept) if keeps)
    for index in sorted(range(len(gemms)), key=lambda index: -copies[index]):
        if gemms[index].per_tensor and not kept[index] and copies[index] <= left:
            kept[index], left = True, left - copies[index]
    return tuple(kept)


def group_padding(offsets: torch.Tensor, padded_offsets: torch.Tensor, multiple: int, padded_rows: int) -> torch.Tensor:
    """The rows that pad the groups of :func:`padded_group_rows`: (E * (multiple - 1),) int64, group ``e``'s
    ``padded size - size`` rows after its own, the other slots ``padded_rows - 1``, past every group and every
    moved row (rows <= padded_rows - E * multiple), so never read. A fixed count, known when the graph is built."""
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1)).to(torch.int64)
    padded_sizes = torch.diff(padded_offsets, prepend=padded_offsets.new_zeros(1)).to(torch.int64)
    first = padded_offsets.to(torch.int64) - padded_sizes + sizes  # (E,): the row after group e's last
    slot = torch.arange(multiple - 1, device=offsets.device, dtype=torch.int64)
    used = slot[None, :] < (padded_sizes - sizes)[:, None]
    return torch.where(used, first[:, None] + slot[None, :], padded_rows - 1).reshape(-1)


def padded_group_sources(offsets: torch.Tensor, rows: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`padded_group_rows`: ``(sources (padded_rows,) int64, padded_offsets (E,))``, the row
    of the ``rows`` that each padded row holds, -1 for a pad (and for the slots past the moved rows). What a
    kernel that gathers the padded layout in one pass reads (``fp8graph::transpose_fp8``)."""
    destination, padded_offsets, padded_rows = padded_group_rows(offsets, rows, multiple)
    sources = torch.full((padded_rows,), -1, dtype=torch.int64, device=offsets.device)
    return sources.index_copy(0, destination, torch.arange(rows, device=offsets.device)), padded_offsets


def place_in_padded_groups(x: torch.Tensor, offsets: torch.Tensor, multiple: int,
                           into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s rows moved into groups zero-padded to ``multiple`` rows (:func:`padded_group_rows`):
    ``(padded, padded_offsets)``, ``padded`` row-major.

    Only what a grouped GEMM reads is written: the moved rows and the pads of each group, never the whole buffer
    (a zero fill first would write every byte twice: on an H100 a copy of the operand's size per GEMM operand).
    The rest, past ``padded_offsets[-1]``, is left as allocated. ``into`` is the buffer to write (a new one by
    default). ``x`` in high precision (MXFP8's expert operands, before their block casts); FP8 operands are laid
    out, transposed, by ``fp8graph::transpose_fp8`` of :func:`padded_group_sources`, one tiled pass."""
    destination, padded_offsets, padded_rows = padded_group_rows(offsets, x.shape[0], multiple)
    pads = group_padding(offsets, padded_offsets, multiple, padded_rows)
    padded = x.new_empty((padded_rows, *x.shape[1:])) if into is None else into
    return padded.index_fill(0, pads, 0).index_copy(0, destination, x), padded_offsets
