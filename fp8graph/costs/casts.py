"""The memory traffic each recipe's casts add to a linear site, as this version's generated kernels move it.

For one ``nn.Linear(K, N)`` on M tokens, forward and backward, every kernel fp8graph adds (amax, scale, cast,
transposed copy) is counted against the operand whose size it scales with: ``input`` (M x K), ``weight``
(N x K) or ``grad_output`` (M x N), in bytes read and written per element of that operand; the kernels
that move under 0.1 MB or work on scales alone (scale arithmetic, delayed scaling's history update, the
second pass of a split amax) count as small launches.

The table is what ``python -m bench model linear --casts`` derives from the kernels Inductor generates for
sm_90 at 16384x4096x14336 (every operand a different size), and tests/bench/test_step_structure.py derives it
again from a fresh capture and compares: a change to what the casts read or write fails there until this
table is regenerated.

An expert site's casts (the gather, padding and per-group scales of the grouped path) are counted apart, per
element of its routed tokens' operands (``M x (K + N)``) and per element of its experts' weights
(``E x K x N``), over a MoE block's two expert GEMMs (:data:`GROUPED_CAST_TRAFFIC`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["CAST_TRAFFIC", "CastKernels", "GROUPED_CAST_TRAFFIC", "GroupedCasts", "OPERANDS", "RecipeCasts"]

OPERANDS = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class CastKernels:
    """The kernels of one operand in one pass that run at one rate."""

    operand: str  # input | weight | grad_output
    backward: bool  # run in the backward graph
    custom_op: bool  # one of fp8graph's own kernels (a custom op), else one Inductor generated
    launches: int
    read: float  # bytes per element of the operand, all launches together
    written: float


@dataclasses.dataclass(frozen=True)
class RecipeCasts:
    kernels: tuple[CastKernels, ...]
    small_launches: int  # kernels moving under 0.1 MB or working on scales only: latency
    small_backward_launches: int  # of which in the backward graph


def _k(operand, backward, custom_op, launches, read, written):
    return CastKernels(operand, backward, custom_op, launches, read, written)


# python -m bench model linear --casts (torch 2.13.0, triton 3.6.0, sm_90), regenerated with the kernels. A recipe
# with ``save_transposes`` has casts of its own ("<kind> saved-transposes"): the backward GEMMs' copies are written in
# the forward, where by default the backward casts each weight's from the weight (and a tiled recipe's each input's).
CAST_TRAFFIC: dict[str, RecipeCasts] = {
    "current": RecipeCasts((
        _k("input", False, False, 2, 4.0, 2.0),
        _k("weight", False, False, 2, 4.0, 1.0),
        _k("weight", True, False, 1, 2.0, 1.0),
        _k("grad_output", True, False, 2, 4.0, 2.0),
    ), small_launches=6, small_backward_launches=2),
    "delayed": RecipeCasts((
        _k("input", False, False, 1, 2.0, 1.0),
        _k("input", True, False, 1, 2.0, 1.0),
        _k("input", True, True, 1, 1.0, 1.0),
        _k("weight", False, False, 1, 2.0, 1.0),
        _k("weight", True, False, 1, 2.0, 1.0),
        _k("grad_output", True, False, 1, 2.0, 1.0),
        _k("grad_output", True, True, 1, 1.0, 1.0),
    ), small_launches=7, small_backward_launches=3),
    "rowwise": RecipeCasts((
        _k("input", False, False, 1, 2.0, 1.0),
        _k("input", True, False, 2, 4.0, 1.0),
        _k("weight", False, False, 1, 2.0, 1.0),
        _k("weight", True, False, 2, 4.0, 1.015625),
        _k("grad_output", True, False, 2, 4.0, 3.0),
    ), small_launches=2, small_backward_launches=2),
    "block": RecipeCasts((
        _k("input", False, True, 1, 2.0, 2.0625),
        _k("weight", False, True, 1, 2.0, 1.0),
        _k("weight", True, True, 1, 2.0, 1.0),
        _k("grad_output", True, True, 1, 2.0, 2.0625),
    ), small_launches=6, small_backward_launches=3),
    "current saved-transposes": RecipeCasts((
        _k("input", False, False, 2, 4.0, 2.0),
        _k("weight", False, False, 2, 4.0, 2.0),
        _k("grad_output", True, False, 2, 4.0, 2.0),
    ), small_launches=6, small_backward_launches=2),
    "delayed saved-transposes": RecipeCasts((
        _k("input", False, False, 1, 2.0, 1.0),
        _k("input", False, True, 1, 1.0, 1.0),
        _k("weight", False, False, 1, 2.0, 1.0),
        _k("weight", False, True, 1, 1.0, 1.0),
        _k("grad_output", True, False, 1, 2.0, 1.0),
        _k("grad_output", True, True, 1, 1.0, 1.0),
    ), small_launches=7, small_backward_launches=3),
    "rowwise saved-transposes": RecipeCasts((
        _k("input", False, False, 2, 4.0, 3.015625),
        _k("weight", False, False, 2, 4.0, 3.015625),
        _k("grad_output", True, False, 2, 4.0, 3.0),
    ), small_launches=2, small_backward_launches=0),
    "block saved-transposes": RecipeCasts((
        _k("input", False, True, 1, 2.0, 2.0625),
        _k("weight", False, True, 1, 2.0, 2.0),
        _k("grad_output", True, True, 1, 2.0, 2.0625),
    ), small_launches=6, small_backward_launches=2),
}


@dataclasses.dataclass(frozen=True)
class GroupedCasts:
    """What a recipe adds to a MoE block's two expert GEMMs over BF16's kernels, outside the GEMMs: bytes per
    routed-token element (``M x (K + N)`` of each expert GEMM) and per expert-weight element (``E x K x N``),
    in Inductor's kernels and in custom ops, and the launches it adds to the block."""

    activation: float
    activation_custom_op: float
    weight: float
    weight_custom_op: float
    block_launches: int
    # Per weight element of a site that keeps its weight's copy for grad_input from the forward
    # (fp8graph.numerics.groups.weight_copy_fits), added to ``weight`` and ``weight_custom_op``: the forward casts
    # it into both layouts by one kernel, the backward casts nothing again.
    kept_weight: float = 0.0
    kept_weight_custom_op: float = 0.0


# bench.costmodel.site_casts.derive_grouped of the committed sweep, bench/results/model-moe-2026-11-28T185953Z.json
# (Qwen3-30B-A3B's block at 256 and 1024 tokens an expert, where every site casts its weight again in the
# backward, and at 2048, where gate_up keeps its copy from the forward; a step of one micro-batch cast per call,
# sm_90, torch 2.13.0, triton 3.6.0: the three blocks are fitted, to the rates' rounding to 1/64 byte); of the
# blocks it was not solved from, the FP8 steps' Triton bytes it predicts are within 7% of Llama-4 Scout's (whose
# batched experts keep autograd's SwiGLU and combine) and within 26% of DeepSeek-V3's (tests/costs/test_sites.py). The per-tensor recipes' SwiGLU backward and combine
# backward are kernels of fp8graph's, whose bytes go with the expert width and the hidden size, not with both
# GEMMs' K + N the table's rate counts: of what a recipe adds to BF16's bytes alone the table is worse on other
# blocks (DeepSeek-V3's delayed and row-wise furthest). A negative rate: the recipe's kernels move fewer bytes per
# routed token than BF16's (an FP8 byte where BF16 stores two). The custom-op bytes are fp8graph's ops: the
# layouts of grad_weight's operands, SwiGLU's and the combine's backward casts and, per weight element, the
# per-tensor recipes' weights cast again for grad_input in the backward (fp8graph::quantize_transposed: 3 bytes);
# a site that keeps the copy from the forward casts both layouts in one op (fp8graph::quantize_both_layouts: 4
# bytes, 1 more) and no Inductor kernel casts its weight (3 bytes fewer). Regenerated with the sweep.
GROUPED_CAST_TRAFFIC: dict[str, GroupedCasts] = {
    "current": GroupedCasts(-4.671875, 5.359375, 5.015625, 3.015625, 34, -3.015625, 1.03125),
    "delayed": GroupedCasts(-5.3125, 4.640625, 3.015625, 3.03125, 28, -3.015625, 1.015625),
    "rowwise": GroupedCasts(-1.234375, 3.0, 8.015625, 0.03125, 14, 0.0, 0.0),
}
