"""``fp8graph::record_delayed_``: the delayed-scaling state of one call moved one step, in one launch.

A call's members (q, k and v; gate and up; or one linear) each record this
step's amaxes into some rows of their amax history and store the scales the
casts used. Written as torch ops, that is per member a roll, a record, a
history write and a scale write, plus a second reduction stage per amax:
Inductor made them about a dozen small kernels per call (hundreds a step).
As one op it is one launch per call, which also finishes the amaxes from the
per-row partial maxima the casts computed in their own pass
(``fp8graph.numerics.quantize.row_amaxes``).

Arguments: the members' ``histories`` ((rows, len), contiguous) and
``scales`` ((rows,)), every row changed in place (a forward call's input and
weight rows, a backward call's grad_output row: ``fp8graph.buffers.delayed_state``);
``row_amaxes``, member-major, one 1-D tensor of partial magnitudes per member
and row (empty for a row that records nothing, zero); ``new_scales`` (m, rows); ``kept_scales``, empty or one per member:
buffers that also receive the scales of every row but the first (a forward
call's weight rows: the scales the FP8 weight copies a fill keeps were cast
with, ``fp8graph.buffers.weight_cache``), so that keeping them costs no launch
of its own. On CUDA it runs
``record_delayed_kernel`` (``_record_delayed_triton``); everywhere else the
same steps in torch ops (``fp8graph.numerics.delayed_scaling``), which the tests hold
the kernel to exactly. On CUDA the torch steps also run, a few small kernels
per member, where Triton is missing or the state is not as fp8graph
registers it (contiguous float32 buffers of one history length: a model cast
with ``.to(torch.bfloat16)`` casts its buffers too).
"""

from __future__ import annotations

import torch

from fp8graph.numerics.delayed_scaling import record_amax, roll_history
from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available

__all__ = ["amax_block", "finished_amax", "loop_steps", "plan_record_delayed", "record_delayed_"]

# A row's partial amaxes are finished by one program, a block a loop step, each step waiting on its loads: the
# H200 ran ~0.57 us a step (docs/cost-model.md), so a row of 262144 partials (an expert GEMM's gathered input or
# grad_output, a magnitude a token) took ~150 us in blocks of 1024. Blocks grow with the longest partial, to 16384
# elements (32 a thread over 16 warps): 16 steps for that row.
_MIN_BLOCK_AMAX = 1024
_MAX_BLOCK_AMAX = 16384
_BLOCK_HISTORY = 1024


def amax_block(longest_partial: int) -> tuple[int, int]:
    """``(BLOCK_AMAX, num_warps)`` of the launch whose longest row of partial amaxes has ``longest_partial``
    elements: the whole row in one block up to 16384, at most 32 elements a thread, at least 4 warps."""
    power_of_2 = 1 << (max(longest_partial, 1) - 1).bit_length()
    block = min(max(power_of_2, _MIN_BLOCK_AMAX), _MAX_BLOCK_AMAX)
    return block, max(block // 1024, 4)


def loop_steps(longest_partial: int, history_len: int) -> int:
    """The loop steps of a launch's longest program (a program a row): its partial amaxes a block at a time, then
    its history. Each step waits on its loads, so this, not the bytes, sets the launch's time
    (``bench.costmodel.costs`` prices a step)."""
    block, _ = amax_block(longest_partial)
    return -(-longest_partial // block) + -(-history_len // _BLOCK_HISTORY)


def finished_amax(partial: torch.Tensor) -> torch.Tensor:
    """The amax of one row's partial magnitudes, as fp32; zero for none (a row that records nothing: a weight whose
    kept cast a call reuses, as the kernel's running maximum starts at zero)."""
    if partial.numel() == 0:
        return partial.new_zeros((), dtype=torch.float32)
    return partial.amax().to(torch.float32)


def _check(histories, scales, row_amaxes, new_scales, kept_scales=()) -> int:
    members, rows = new_scales.shape
    if not (len(histories) == len(scales) == members and len(row_amaxes) == members * rows):
        raise ValueError(f"record_delayed_: {len(histories)} histories, {len(scales)} scales and "
                         f"{len(row_amaxes)} amaxes for new_scales of shape {tuple(new_scales.shape)}")
    shapes = {(tuple(history.shape[:1]), tuple(scale.shape)) for history, scale in zip(histories, scales)}
    if shapes != {((rows,), (rows,))}:
        raise ValueError(f"record_delayed_: {rows} rows recorded, but the histories and scales have "
                         f"{sorted(shapes)} rows")
    if len(kept_scales) not in (0, members) or any(kept.numel() != rows - 1 for kept in kept_scales):
        raise ValueError(f"record_delayed_: the kept scales are none or one of {rows - 1} values a member each, "
                         f"got {len(kept_scales)} of {[kept.numel() for kept in kept_scales]}")
    return rows


def _record_reference(histories, scales, row_amaxes, new_scales, kept_scales=()) -> None:
    rows = _check(histories, scales, row_amaxes, new_scales, kept_scales)
    for i, (history, scale) in enumerate(zip(histories, scales)):
        new_amaxes = torch.stack([finished_amax(partial) for partial in row_amaxes[i * rows:(i + 1) * rows]])
        history.copy_(record_amax(roll_history(history), new_amaxes))
        scale.copy_(new_scales[i])
        if kept_scales:
            kept_scales[i].copy_(new_scales[i, 1:].reshape(kept_scales[i].shape))


def _row_stride(row_amaxes) -> int | None:
    """The elements between consecutive rows' partials when every row's but the first is one row of one tensor
    (equal lengths and dtype, evenly spaced in one storage: an expert call's weight amaxes ``(E, N).unbind(0)``),
    else None."""
    rest = row_amaxes[1:]
    if len(rest) < 2 or len({(partial.dtype, partial.numel(), partial.device) for partial in rest}) != 1:
        return None
    if len({partial.untyped_storage().data_ptr() for partial in rest}) != 1:
        return None
    offsets = [partial.storage_offset() for partial in rest]
    stride = offsets[1] - offsets[0]
    uniform = all(later - earlier == stride for earlier, later in zip(offsets, offsets[1:]))
    return stride if uniform and stride >= 0 else None


def plan_record_delayed(histories, scales, row_amaxes, new_scales, kept_scales=()) -> KernelLaunch:
    """The one launch that does :func:`record_delayed_` on CUDA tensors: one member whose rows but the first are
    one row of one tensor each (an expert call) runs ``record_delayed_rows_kernel``, every other call
    ``record_delayed_kernel``."""
    from fp8graph.kernels._record_delayed_triton import record_delayed_kernel, record_delayed_rows_kernel

    rows = _check(histories, scales, row_amaxes, new_scales, kept_scales)
    keep = bool(kept_scales)
    block_amax, num_warps = amax_block(max(partial.numel() for partial in row_amaxes))
    row_stride = _row_stride(row_amaxes) if len(histories) == 1 else None
    if row_stride is not None:
        history, scale, first, second = histories[0], scales[0], row_amaxes[0], row_amaxes[1]
        return KernelLaunch(record_delayed_rows_kernel, (rows,),
                            (history, scale, first, first.numel(), second, row_stride, second.numel(), new_scales,
                             kept_scales[0] if keep else scale, history.shape[1]),
                            {"KEEP": keep, "BLOCK_AMAX": block_amax, "BLOCK_HISTORY": _BLOCK_HISTORY,
                             "num_warps": num_warps})
    return KernelLaunch(record_delayed_kernel, (len(histories), rows),
                        (tuple(histories), tuple(scales), tuple(row_amaxes),
                         tuple(partial.numel() for partial in row_amaxes), new_scales,
                         # without kept buffers the kernel stores none: the scales stand in for the argument
                         tuple(kept_scales) if keep else tuple(scales), histories[0].shape[1]),
                        {"ROWS": rows, "KEEP": keep, "BLOCK_AMAX": block_amax, "BLOCK_HISTORY": _BLOCK_HISTORY,
                         "num_warps": num_warps})


def _kernel_can_run(histories, scales, row_amaxes, new_scales, kept_scales) -> bool:
    lengths = {history.shape[1] for history in histories}
    return (triton_available() and len(lengths) == 1 and new_scales.dtype == torch.float32
            and new_scales.is_contiguous()
            and all(t.is_contiguous() and t.dtype == torch.float32
                    for t in (*histories, *scales, *kept_scales))
            and all(partial.dim() == 1 and partial.is_contiguous() for partial in row_amaxes))


@torch.library.custom_op("fp8graph::record_delayed_", mutates_args=("histories", "scales", "kept_scales"))
def record_delayed_(histories: list[torch.Tensor], scales: list[torch.Tensor], row_amaxes: list[torch.Tensor],
                    new_scales: torch.Tensor, kept_scales: list[torch.Tensor]) -> None:
    """Record each member's new amaxes into every row of its history and store its scales; with kept buffers,
    also store the scales of its rows but the first there."""
    _record_reference(histories, scales, row_amaxes, new_scales, kept_scales)


@record_delayed_.register_fake
def _(histories, scales, row_amaxes, new_scales, kept_scales):
    _check(histories, scales, row_amaxes, new_scales, kept_scales)


@record_delayed_.register_kernel("cuda")
def _(histories, scales, row_amaxes, new_scales, kept_scales):
    if not _kernel_can_run(histories, scales, row_amaxes, new_scales, kept_scales):
        _record_reference(histories, scales, row_amaxes, new_scales, kept_scales)
        return
    plan_record_delayed(histories, scales, row_amaxes, new_scales, kept_scales)()
