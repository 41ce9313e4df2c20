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

__all__ = ["CAST_TRAFFIC", "CastKernels", "GROUPED_CAST_TRAFFIC", "GROUPED_STAGE_CAST_TRAFFIC", "GroupedCasts",
           "KernelBytes", "NO_BYTES", "OPERANDS", "RecipeCasts"]

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
        _k("input", False, True, 1, 2.0, 1.03125),
        _k("input", True, True, 1, 2.0, 1.03125),
        _k("weight", False, True, 1, 2.0, 1.0),
        _k("weight", True, True, 1, 2.0, 1.0),
        _k("grad_output", True, True, 1, 2.0, 2.0625),
    ), small_launches=6, small_backward_launches=4),
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
class KernelBytes:
    """Bytes per element, by the rate the kernels that move them run at: a GPU runs Inductor's FP8 casts (amax,
    saturation, 1-byte stores) slower than its other kernels (fp8graph.costs.gpus.GPU.cast_fraction), and
    fp8graph's ops store tiles transposed (``transposed_store_fraction``)."""

    cast: float  # Inductor's kernels that cast to FP8
    plain: float  # Inductor's other kernels, over BF16's: negative where FP8's move fewer (an FP8 byte for two)
    custom_op: float  # fp8graph's ops

    def __add__(self, other: "KernelBytes") -> "KernelBytes":
        return KernelBytes(self.cast + other.cast, self.plain + other.plain, self.custom_op + other.custom_op)

    @property
    def inductor(self) -> float:
        """Inductor's kernels' bytes, casts and the rest."""
        return self.cast + self.plain


NO_BYTES = KernelBytes(0.0, 0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class GroupedCasts:
    """What a recipe adds to a MoE block's two expert GEMMs over BF16's kernels, outside the GEMMs: bytes per
    routed-token element (``M x (K + N)`` of each expert GEMM) and per expert-weight element (``E x K x N``),
    and the launches it adds to the block."""

    activation: KernelBytes
    weight: KernelBytes
    block_launches: int
    # Per weight element of a site that keeps its weight's copy for grad_input from the forward
    # (fp8graph.numerics.groups.weight_copies_kept), added to ``weight``: the forward casts it into both layouts by
    # one of fp8graph's kernels, no Inductor kernel casts it, and the backward casts nothing again.
    kept_weight: KernelBytes = NO_BYTES
    sites: int = 2  # the expert GEMMs ``block_launches`` are of: both of a block's, or one (a stage's entry)


def _b(cast: float, plain: float, custom_op: float) -> KernelBytes:
    return KernelBytes(cast, plain, custom_op)


# bench.costmodel.site_casts.derive_grouped of the committed sweep, bench/results/model-moe-2026-12-01T005146Z.json
# (Qwen3-30B-A3B's block at 256 tokens an expert, where every site casts its weight again in the backward, 1024,
# where the down projection keeps its copy from the forward, and 2048, where both keep theirs
# (fp8graph.numerics.groups.weight_copies_kept); a step of one micro-batch cast per call, sm_90, torch 2.13.0,
# triton 3.6.0: the three blocks are fitted, to the rates' rounding to 1/64 byte); of the
# blocks it was not solved from, the FP8 steps' Triton bytes it predicts are within 6% of Llama-4 Scout's (whose
# batched experts keep autograd's SwiGLU and combine) and within 33% of DeepSeek-V3's (tests/costs/test_sites.py).
# SwiGLU's and the combine's backward are kernels of fp8graph's in all three recipes, whose bytes go with the
# expert width and the hidden size, not with both GEMMs' K + N the table's rate counts: of what a recipe adds to
# BF16's bytes alone the table is worse on other blocks (DeepSeek-V3's delayed and row-wise furthest). Per
# routed-token element, Inductor's plain kernels move fewer bytes than BF16's (an FP8 byte where BF16 stores two;
# SwiGLU's and the combine's backward are fp8graph's ops); its FP8 casts are row-wise's of the gathered input and
# SwiGLU's rows (the per-tensor recipes cast every routed-token operand in fp8graph's ops, SwiGLU's forward too,
# fp8graph::swiglu_forward_placed, with current scaling's amax of it in Inductor's reduction). Per weight
# element: the cast for the forward GEMM (3 bytes) and, in current scaling, the weight's amax (2) in Inductor's
# kernels; row-wise casts along N for grad_input by fp8graph::quantize_expert_columns (3 bytes), the per-tensor
# recipes cast again for it by fp8graph::quantize_transposed (3 bytes). A site that keeps the copy from the
# forward casts both layouts by fp8graph::quantize_both_layouts (4 bytes, 1 more) and no Inductor kernel casts its
# weight (3 bytes fewer).
# Regenerated with the sweep.
GROUPED_CAST_TRAFFIC: dict[str, GroupedCasts] = {
    "current": GroupedCasts(_b(0.0, -5.28125, 5.84375), _b(3.0, 2.0, 3.015625), 30,
                            _b(-3.0, 0.0, 1.0)),
    "delayed": GroupedCasts(_b(0.0, -5.921875, 5.125), _b(3.015625, 0.0, 3.03125), 24,
                            _b(-3.0, 0.015625, 1.0)),
    "rowwise": GroupedCasts(_b(0.96875, -5.484375, 5.171875), _b(3.015625, 0.015625, 3.03125), 18,
                            _b(0.0, 0.0, 0.0)),
}


# The same per-element rates for each of an expert MLP's two GEMMs apart (fp8graph.recipes.policy.SiteInfo's
# expert_stage: 0 the first, gate_up, 1 the second, the down projection), from the same sweep
# (bench.costmodel.site_casts.derive_stages): stage 0 from the steps with the recipe on gate_up alone (the down
# projection in BF16), stage 1 from the steps with both sites in FP8 less those; per element of that GEMM's own
# routed-token operands (M x (K + N)) and weight (E x K x N). The block table above averages the two; a site's
# casts are not the block's average (current scaling's down projection carries the combine's backward cast,
# SwiGLU's amax and its weight's casts), and a site decided by the average can lose where the block model says
# it does. Each stage's kept form is solved from its own blocks: gate_up keeps its copy at 2048 tokens an expert,
# the down projection at 1024 and 2048.
# Regenerated with the sweep.
GROUPED_STAGE_CAST_TRAFFIC: dict[str, tuple[GroupedCasts, GroupedCasts]] = {
    "current": (GroupedCasts(_b(0.0, -6.71875, 5.71875), _b(3.0, 2.0, 3.015625), 13,
                             _b(-3.0, 0.0, 1.0), sites=1),
                GroupedCasts(_b(0.0, -3.4375, 6.0), _b(3.0, 2.015625, 3.03125), 17,
                             _b(-3.0, 0.0, 1.0), sites=1)),
    "delayed": (GroupedCasts(_b(0.0, -6.859375, 4.4375), _b(3.015625, 0.0, 3.015625), 11,
                             _b(-3.0, 0.0, 1.0), sites=1),
                GroupedCasts(_b(0.0, -4.71875, 6.0), _b(3.03125, 0.0, 3.03125), 13,
                             _b(-3.0, 0.0, 1.0), sites=1)),
    "rowwise": (GroupedCasts(_b(0.234375, -6.21875, 5.140625), _b(3.015625, 0.0, 3.03125), 9,
                             _b(0.0, 0.0, 0.0), sites=1),
                GroupedCasts(_b(1.921875, -4.546875, 5.1875), _b(3.015625, 0.015625, 3.03125), 9,
                             _b(0.0, 0.0, 0.0), sites=1)),
}
