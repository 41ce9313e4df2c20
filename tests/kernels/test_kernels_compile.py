"""Every Triton kernel fp8graph launches compiles for Hopper (sm_90) and Blackwell (sm_100), without a GPU.

Each case builds the launch fp8graph would make (``plan_quantize_tiles_kernel``,
``plan_quantize_tiles_and_transpose_kernel``) for an operand of a recipe's role, contiguous or
transposed, BF16, fp32 or fp16, at a token count divisible by 16 and at one
that is not (Triton specializes integer arguments on divisibility), then
compiles it to a cubin with the launch's own specialization
(``tests/triton_targets.py``).

What this proves: the kernels compile for the GPU (the interpreter, which the
numerics tests use, accepts code a GPU compile refuses, such as a
non-constexpr global); they keep every value in registers (no local-memory
spills); contiguous loads are 16-byte vector loads. What it does not: speed
or numerics on a GPU (``python -m bench quantize`` and ``tests/test_gpu.py``).
"""

import pytest
import torch

from fp8graph import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling
from fp8graph.numerics.formats import ROLES
from fp8graph.kernels.quantize_tiles import (plan_quantize_tiles_and_transpose_kernel, plan_quantize_tiles_kernel,
                                             triton_available)
from fp8graph.numerics.tiles import ScaleKind, Tiling

from triton_targets import GPU_CAPABILITIES, compile_launch, resource_usage

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

RECIPES = [Float8RowwiseScaling(), Float8RowwiseScaling(power_2_scales=False), Float8BlockScaling(),
           Float8BlockScaling(power_2_scales=False), MXFP8BlockScaling()]
# Every tiling a recipe gives a role (row-wise, 1x128, 128x128, MX 1x32; exact and power-of-2 scales).
TILINGS = sorted({recipe.tiling(role) for recipe in RECIPES for role in ROLES}, key=repr)
# (rows, columns): tokens divisible by 16 and not; 128-row tiles need rows in 128s.
SHAPES = {1: [(4096, 1024), (200, 384)], 128: [(1024, 512), (256, 384)]}


# Operand dtypes: BF16 models, and fp32 ones (master weights and fp32 inputs under autocast reach the
# linear in fp32: it quantizes with autocast off); fp16 for the plain layout.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _launch_cases():
    for tiling in TILINGS:
        for rows, columns in SHAPES[tiling.rows]:
            for dtype in DTYPES:
                layouts = [("contiguous", "one layout")] if dtype == "fp16" else [
                    ("contiguous", "one layout"), ("transposed", "one layout")]
                if tiling.cols == 128 and dtype != "fp16":
                    layouts.append(("contiguous", "both layouts"))
                for layout, count in layouts:
                    yield pytest.param(tiling, (rows, columns), dtype, layout, count,
                                       id=f"{tiling.label}-{tiling.scale_kind.value}-{rows}x{columns}-{dtype}-"
                                          f"{layout if count == 'one layout' else 'both'}")


def _launch(tiling, shape, dtype, layout, layouts):
    rows, columns = shape
    if layout == "transposed":  # an (R, C) operand that is the transpose of a row-major (C, R) tensor
        x = torch.empty(columns, rows, dtype=DTYPES[dtype]).t()
    else:
        x = torch.empty(rows, columns, dtype=DTYPES[dtype])
    plan = plan_quantize_tiles_and_transpose_kernel if layouts == "both layouts" else plan_quantize_tiles_kernel
    launch, _ = plan(x, tiling)
    return launch


@pytest.mark.parametrize("capability", GPU_CAPABILITIES.values(), ids=GPU_CAPABILITIES.keys())
@pytest.mark.parametrize("tiling,shape,dtype,layout,layouts", list(_launch_cases()))
def test_every_quantize_launch_compiles_to_a_cubin_without_spills(tiling, shape, dtype, layout, layouts, capability):
    launch = _launch(tiling, shape, dtype, layout, layouts)
    assert launch.constexprs["SOFTWARE_ROUNDING"] is False  # what a GPU runs
    compiled = compile_launch(launch, capability)
    assert compiled.asm["cubin"], "no cubin"
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"registers spill to local memory: {usage}"
    if layout == "contiguous":
        assert "ld.global.v4.b32" in compiled.asm["ptx"], "contiguous rows are not read as 16-byte vectors"


def test_the_cast_is_the_hardwares_saturating_round_to_nearest_even():
    launch = _launch(Tiling(1, 128, ScaleKind.POWER_2), (4096, 1024), "bf16", "contiguous", "both layouts")
    assert "cvt.rn.satfinite.e4m3x2.f32" in compile_launch(launch, 90).asm["ptx"]


def test_a_kernel_reading_a_non_constexpr_global_fails_to_compile_here():
    """The check reproduces the H100 run's error: a global float read inside a kernel."""
    from triton.compiler.errors import CompilationError

    from fp8graph.kernels.quantize_tiles import KernelLaunch
    from kernels_with_errors import read_global_kernel

    launch = KernelLaunch(read_global_kernel, (1,), (torch.empty(128),), {"BLOCK": 128})
    with pytest.raises(CompilationError, match="Cannot access global variable"):
        compile_launch(launch, 90)


@pytest.mark.parametrize("capability", GPU_CAPABILITIES.values(), ids=GPU_CAPABILITIES.keys())
@pytest.mark.parametrize("shape, gather", [((4096, 14336), False), ((200, 384), False), ((4096, 1000), False),
                                           ((4096, 14336), True), ((200, 384), True), ((4096, 1000), True),
                                           ((128, 1536, 2048), False)],
                         ids=["4096x14336-plain", "200x384-plain", "4096x1000-plain", "4096x14336-gathered",
                              "200x384-gathered", "4096x1000-gathered", "experts-128x1536x2048"])
def test_the_fp8_transpose_compiles_to_a_cubin_with_vector_loads_and_stores(shape, gather, capability):
    """``fp8graph::transpose_fp8`` (the transposed layout of a delayed cast): a cubin without spills whose
    loads and stores are 16-byte vectors when both lengths divide by 16 (a byte-wise transpose would run at a
    fraction of a copy's bandwidth). Not proven here: its speed (``bench quantize`` on a GPU)."""
    from fp8graph.kernels.transpose_fp8 import plan_transpose_fp8

    # gathered: a grouped GEMM's padded groups (every row a contiguous run read where it lies); experts: a batch
    # of weights, as an expert weight's kept copy along N is filled (fp8graph::transpose_fp8_into_)
    sources = torch.empty(shape[0] + 128 * 15, dtype=torch.int64) if gather else None
    launch, _ = plan_transpose_fp8(torch.empty(shape, dtype=torch.float8_e4m3fn), sources)
    compiled = compile_launch(launch, capability)
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"registers spill to local memory: {usage}"
    ptx = compiled.asm["ptx"]
    if all(length % 16 == 0 for length in shape[-2:]):
        assert "ld.global.v4.b32" in ptx, "rows are not read as 16-byte vectors"
        assert "st.global.v4.b32" in ptx, "the transposed rows are not written as 16-byte vectors"


@pytest.mark.parametrize("capability", GPU_CAPABILITIES.values(), ids=GPU_CAPABILITIES.keys())
@pytest.mark.parametrize("members, rows, keep, longest",
                         [(3, 2, False, 4096), (2, 1, False, 4096), (1, 2, False, 4096), (3, 2, True, 4096),
                          (1, 129, True, 4096), (1, 129, True, 264192), (1, 1, False, 262144)],
                         ids=["qkv-forward", "gate-up-backward", "one-forward", "qkv-fill", "experts-fill",
                              "qwen3-experts-fill", "qwen3-experts-backward"])
def test_the_delayed_state_kernel_compiles_to_a_cubin_without_spills(members, rows, keep, longest, capability):
    """``fp8graph::record_delayed_`` (a call's state moved one step; a fill also keeps the weight rows'
    scales): one kernel per member count and recorded rows, which must build for the GPUs
    fp8graph targets; an expert call's weight rows, rows of one tensor, one kernel for any count of them;
    a row of a token's magnitudes each (Qwen3-30B-A3B's 262144 gathered tokens) in blocks of 16384, 16 warps,
    still without spills. Not proven here: its speed."""
    from fp8graph.kernels.delayed_record import plan_record_delayed

    partials = [torch.empty(longest, dtype=torch.bfloat16) for _ in range(members * rows)]
    if rows > 2:  # an expert call: the input's row, then the experts' rows of one (E, N) tensor
        partials = [partials[0], *torch.empty(rows - 1, 768, dtype=torch.float32).unbind(0)]
    kept = [torch.zeros(rows - 1) for _ in range(members)] if keep else []
    launch = plan_record_delayed([torch.zeros(rows, 1024) for _ in range(members)],
                                 [torch.ones(rows) for _ in range(members)], partials, torch.ones(members, rows), kept)
    assert (launch.kernel.__name__ == "record_delayed_rows_kernel") == (rows > 2)
    assert launch.constexprs["BLOCK_AMAX"] == min(longest, 16384)
    usage = resource_usage(compile_launch(launch, capability))
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"registers spill to local memory: {usage}"


@pytest.mark.parametrize("capability", GPU_CAPABILITIES.values(), ids=GPU_CAPABILITIES.keys())
@pytest.mark.parametrize("rows, experts, columns, depth",
                         [(8, 128, 1536, 2048), (64, 128, 2048, 768), (1, 8, 1000, 100)],
                         ids=["qwen3-gate-up", "qwen3-down-64-tokens", "ragged"])
def test_the_gathered_expert_gemv_compiles_to_a_cubin_reading_fp8_as_vectors(rows, experts, columns, depth, capability):
    """``fp8graph::gathered_gemv`` (MoE decode on FP8 expert weights): a cubin without spills that reads the
    weight rows as 16-byte vectors when K divides by 16 (the step is bound by those bytes) and widens E4M3
    in hardware. Not proven here: its speed (``bench moe`` on a GPU)."""
    from fp8graph.kernels.gathered_gemv import plan_gathered_gemv

    fp8 = torch.float8_e4m3fn
    launch, _ = plan_gathered_gemv(torch.empty(rows, depth, dtype=fp8), torch.ones(rows),
                                   torch.empty(experts, columns, depth, dtype=fp8), torch.ones(experts, columns),
                                   torch.zeros(rows, dtype=torch.int64), torch.bfloat16)
    compiled = compile_launch(launch, capability)
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"registers spill to local memory: {usage}"
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx, "E4M3 is not widened by the hardware's conversion"
    if depth % 16 == 0:
        assert "ld.global.v4.b32" in ptx, "weight rows are not read as 16-byte vectors"


@pytest.mark.parametrize("capability", GPU_CAPABILITIES.values(), ids=GPU_CAPABILITIES.keys())
@pytest.mark.parametrize("op, rows, columns, experts, gather",
                         [("group columns", 262144, 2048, 128, True), ("group columns", 262144, 768, 128, False),
                          ("group columns", 200, 100, 3, False), ("rows", 262144, 2048, 128, True),
                          ("rows", 200, 100, 3, True), ("weighted rows", 262144, 2048, 128, True),
                          ("weighted rows", 200, 100, 3, True), ("weighted rows rowwise", 262144, 2048, 128, True),
                          ("weighted rows rowwise", 200, 100, 3, True),
                          ("weighted rows frozen", 262144, 2048, 128, True),
                          ("weighted rows rowwise frozen", 262144, 2048, 128, True),
                          ("expert columns", 128 * 1536, 2048, 128, False),
                          ("expert columns", 128 * 2048, 768, 128, False), ("expert columns", 300, 70, 3, False)],
                         ids=["qwen3-input-gathered", "qwen3-grad-output", "ragged", "per-tensor-qwen3-input",
                              "per-tensor-ragged", "combine-backward-qwen3", "combine-backward-ragged",
                              "rowwise-combine-backward-qwen3", "rowwise-combine-backward-ragged",
                              "frozen-combine-backward-qwen3", "frozen-rowwise-combine-backward-qwen3",
                              "qwen3-gate-up-weight", "qwen3-down-weight", "weight-ragged"])
def test_the_group_placing_casts_compile_to_a_cubin_reading_rows_and_storing_bytes_as_vectors(
        op, rows, columns, experts, gather, capability):
    """The kernel that casts a grouped GEMM's weight-gradient operand and lays it out: as
    ``fp8graph::quantize_group_columns_placed`` (row-wise's operands, cast per group and column) and as
    ``fp8graph::quantize_rows_placed`` (a per-tensor recipe's gathered input, also written as rows for the forward
    GEMM), as ``fp8graph::quantize_weighted_rows_placed`` (the combine's gradient, gathered, weighted and cast
    for the down projection, with each row's dot product with the GEMM's output), as
    ``fp8graph::quantize_weighted_rows_rowwise`` (the same gradient cast for row-wise: each row with its own scale,
    stored as rows, and per group and column, laid out; ``frozen``: the rows alone, for frozen experts), and as
    ``fp8graph::quantize_expert_columns`` (row-wise's expert weights (E, N, K) cast along N, each expert's rows a
    group, stored (E, K, N) for grad_input's GEMM). A cubin without spills that
    reads BF16 rows (and the other rows) as 16-byte vectors when the columns divide by 8, converts in hardware
    (saturating, round to nearest even) and stores the transposed bytes (and the rows) as vectors. Not proven here:
    its speed (``bench moe`` on a GPU)."""
    from fp8graph.kernels.group_columns import (plan_quantize_expert_columns, plan_quantize_group_columns_placed,
                                                plan_quantize_rows_placed, plan_quantize_weighted_rows_placed,
                                                plan_quantize_weighted_rows_rowwise)

    source = torch.empty(rows // 8 if gather else rows, columns, dtype=torch.bfloat16)
    index = torch.empty(rows, dtype=torch.int64) if gather else None
    offsets = torch.empty(experts, dtype=torch.int32)
    scale = torch.empty((), dtype=torch.float32)
    frozen = op.endswith(" frozen")
    op = op.removesuffix(" frozen")
    if op == "rows":
        launch, *_ = plan_quantize_rows_placed(source, scale, offsets, 16, index)
    elif op == "weighted rows":
        launch, *_ = plan_quantize_weighted_rows_placed(
            source, torch.empty(rows, dtype=torch.bfloat16), torch.empty(rows, columns, dtype=torch.bfloat16), scale,
            offsets, 16, index, layout=not frozen)
    elif op == "weighted rows rowwise":
        launch, *_ = plan_quantize_weighted_rows_rowwise(
            source, torch.empty(rows, dtype=torch.bfloat16), torch.empty(rows, columns, dtype=torch.bfloat16),
            torch.empty(rows, dtype=torch.float32), offsets, 16, False, index, layout=not frozen)
    elif op == "expert columns":
        launch, weight_t_fp8, scale = plan_quantize_expert_columns(source.view(experts, rows // experts, columns),
                                                                   False)
        assert weight_t_fp8.shape == (experts, columns, rows // experts) and scale.shape == (experts, columns)
    else:
        launch, *_ = plan_quantize_group_columns_placed(source, offsets, 16, True, index)
    assert launch.constexprs["SOFTWARE_ROUNDING"] is False  # what a GPU runs
    assert launch.constexprs["TENSOR_SCALE"] is (op in ("rows", "weighted rows"))
    assert launch.constexprs["EXPERT_MAJOR"] is (op == "expert columns")
    assert launch.constexprs["ROW_WEIGHTS"] is launch.constexprs["DOTS"] is op.startswith("weighted rows")
    assert launch.constexprs["ROW_SCALES"] is (op == "weighted rows rowwise")
    assert launch.constexprs["LAYOUT"] is not frozen
    compiled = compile_launch(launch, capability)
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"registers spill to local memory: {usage}"
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if columns % 8 == 0:
        assert "ld.global.v4.b32" in ptx, "rows are not read as 16-byte vectors"
        stores = ptx.count("st.global.v4.b32") + ptx.count("st.global.v2.b32")
        assert stores >= (1 if op in ("group columns", "expert columns") or frozen else 2), \
            "the bytes are not stored as vectors (both layouts, where the rows are stored too)"
        if op.startswith("weighted rows"):
            assert ptx.count("ld.global.v4.b32") >= 2, "the other rows are not read as 16-byte vectors"


@pytest.mark.parametrize("capability", GPU_CAPABILITIES.values(), ids=GPU_CAPABILITIES.keys())
@pytest.mark.parametrize("rows, width, experts, cast, rowwise, layout",
                         [(262144, 768, 128, True, False, True), (262144, 768, 128, False, False, True),
                          (200, 100, 3, True, False, True), (262144, 768, 128, True, True, True),
                          (262144, 768, 128, False, True, True), (200, 100, 3, True, True, True),
                          (262144, 768, 128, True, False, False), (262144, 768, 128, True, True, False)],
                         ids=["qwen3-cast", "qwen3-amax", "ragged", "rowwise-qwen3-cast", "rowwise-qwen3-amax",
                              "rowwise-ragged", "frozen-qwen3-cast", "frozen-rowwise-qwen3-cast"])
def test_the_swiglu_backward_compiles_to_a_cubin_reading_rows_and_storing_bytes_as_vectors(
        rows, width, experts, cast, rowwise, layout, capability):
    """``fp8graph::swiglu_backward_placed`` (SwiGLU's gradient between two expert GEMMs, cast as rows and laid out
    for grad_weight) and ``fp8graph::swiglu_backward_amax`` (its amaxes alone), and their row-wise forms
    (``swiglu_backward_rowwise``: the rows cast a scale a row, the layout a scale a group and column;
    ``swiglu_backward_rowwise_amax``: each row's and each group's columns' amaxes; the casts without the layout,
    for frozen experts): a cubin without spills that
    reads gate, up and grad_h as 16-byte vectors when the width divides by 8, converts in hardware (saturating,
    round to nearest even) and stores both layouts as vectors. Not proven here: its speed (``bench moe`` on a
    GPU)."""
    from fp8graph.kernels.swiglu_backward import plan_swiglu_backward, plan_swiglu_backward_rowwise

    gate_up, grad_h = torch.empty(rows, 2 * width, dtype=torch.bfloat16), torch.empty(rows, width, dtype=torch.bfloat16)
    offsets = torch.empty(experts, dtype=torch.int32)
    if rowwise:
        scales = (torch.empty(rows), torch.empty(experts + 1, 2 * width)) if cast else None
        launch, *_ = plan_swiglu_backward_rowwise(gate_up, grad_h, offsets, scales, layout=layout)
    else:
        launch, *_ = plan_swiglu_backward(gate_up, grad_h, offsets, torch.empty(()) if cast else None, layout=layout)
    assert launch.constexprs["SOFTWARE_ROUNDING"] is False and launch.constexprs["CAST"] is cast  # what a GPU runs
    assert launch.constexprs["ROWWISE"] is rowwise and launch.constexprs["LAYOUT"] is layout
    compiled = compile_launch(launch, capability)
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"registers spill to local memory: {usage}"
    ptx = compiled.asm["ptx"]
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) is cast
    if width % 8 == 0:
        assert ptx.count("ld.global.v4.b32") >= 3, "gate, up and grad_h are not read as 16-byte vectors"
    if cast and width % 8 == 0:
        assert ptx.count("st.global.v4.b32") >= (4 if layout else 2), \
            "bytes not stored as 16-byte vectors (both halves, both layouts or the rows alone)"


@pytest.mark.parametrize("capability", GPU_CAPABILITIES.values(), ids=GPU_CAPABILITIES.keys())
@pytest.mark.parametrize("rows, width, experts", [(262144, 768, 128), (200, 100, 3)], ids=["qwen3", "ragged"])
def test_the_swiglu_forward_compiles_to_a_cubin_reading_rows_and_storing_bytes_as_vectors(rows, width, experts,
                                                                                          capability):
    """``fp8graph::swiglu_forward_placed`` (SwiGLU between two expert GEMMs, cast as the down projection's rows and
    laid out for its grad_weight): a cubin without spills that reads gate and up as 16-byte vectors when the width
    divides by 8, is launched with libdevice's exp (Inductor's, whose kernel it replaces), converts in hardware (saturating,
    round to nearest even) and stores both layouts as vectors. Not proven here: its speed (``bench moe`` on a
    GPU)."""
    from fp8graph.kernels.swiglu_forward import plan_swiglu_forward

    gate_up = torch.empty(rows, 2 * width, dtype=torch.bfloat16)
    launch, *_ = plan_swiglu_forward(gate_up, torch.empty(()), torch.empty(experts, dtype=torch.int32))
    assert launch.constexprs["SOFTWARE_ROUNDING"] is False and launch.constexprs["LIBDEVICE_EXP"] is True
    compiled = compile_launch(launch, capability)
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"registers spill to local memory: {usage}"
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if width % 8 == 0:
        assert ptx.count("ld.global.v4.b32") >= 2, "gate and up are not read as 16-byte vectors"
        assert ptx.count("st.global.v4.b32") >= 2, "bytes not stored as 16-byte vectors (both layouts)"


@pytest.mark.parametrize("capability", GPU_CAPABILITIES.values(), ids=GPU_CAPABILITIES.keys())
@pytest.mark.parametrize("shape, stored_transposed, both", [
    ((128, 1536, 2048), False, False), ((128, 2048, 768), False, False), ((128, 1536, 2048), True, False),
    ((3, 200, 100), False, False), ((128, 1536, 2048), False, True), ((128, 1536, 2048), True, True),
    ((3, 200, 100), False, True)],
    ids=["qwen3-gate-up", "qwen3-down", "stored-ekn", "ragged", "both-qwen3-gate-up", "both-stored-ekn",
         "both-ragged"])
def test_the_transposed_weight_cast_compiles_to_a_cubin_reading_and_storing_vectors(shape, stored_transposed, both,
                                                                                    capability):
    """``fp8graph::quantize_transposed`` (an expert weight cast again in the backward, in grad_input's layout) and
    ``fp8graph::quantize_both_layouts`` (the forward's cast in both layouts, with its tiles' amaxes): a cubin
    without spills that converts in hardware and, when both lengths divide by 16, reads the BF16 weight and
    stores the bytes as vectors (both layouts' where both are written), whichever way round the weight is
    stored. Not proven here: its speed (``bench moe`` on a GPU)."""
    from fp8graph.kernels.quantize_transposed import plan_quantize_transposed

    weight = torch.empty(shape, dtype=torch.bfloat16)
    if stored_transposed:  # an (E, K, N) parameter read as (E, N, K)
        weight = torch.empty(shape[0], shape[2], shape[1], dtype=torch.bfloat16).transpose(-2, -1)
    launch, _ = plan_quantize_transposed(weight, torch.ones(shape[0]), straight=both, tile_amax=both)
    assert launch.constexprs["SOFTWARE_ROUNDING"] is False  # what a GPU runs
    compiled = compile_launch(launch, capability)
    usage = resource_usage(compiled)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"registers spill to local memory: {usage}"
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if all(length % 16 == 0 for length in shape[-2:]):
        assert "ld.global.v4.b32" in ptx, "the weight is not read as 16-byte vectors"
        assert ptx.count("st.global.v4.b32") >= (2 if both else 1), "the bytes are not stored as 16-byte vectors"
