"""The cost model proper: rows of per-kernel bytes and FLOPs from a capture, and the time an H100 takes for them.

Triton kernel (Inductor's)   bytes read + written, as Inductor's ``estimate_kernel_num_bytes`` counts them
                             (each buffer argument once: whole, or the slices the kernel touches), plus the
                             sectors that its scattered stores move (``coalescing``), timed at
                             a bandwidth: a device copy's (3.0 TB/s) or the rate Inductor's kernels reached on
                             the H100 in the stored decoder profiles (2.25 TB/s). Never less than 3 us.
GEMM (cuBLAS, extern)        FLOPs at a rate per operand type and scaling, or its bytes at copy bandwidth;
                             a grouped GEMM (a MoE's experts) 2 S K N FLOPs summed over its groups, at a
                             grouped rate.
attention (cuDNN SDPA)       FLOPs (4 B H Sq Sk D forward, 2.5x that backward; the triangle of them for a call
                             with is_causal, every tile for one given a mask) at a fitted rate.
other extern (custom ops)    operand bytes at copy bandwidth: what a custom kernel really achieves is unknown;
                             an ATen kernel a GPU measured far below it (MEASURED_EXTERN_BANDWIDTH) at
                             the bandwidth measured (a gathering op's rows as gathered, GATHERING_OPS);
                             fp8graph's kernels that store transposed tiles at the
                             fraction of it the H200's transposes ran at (TRANSPOSED_STORE_OPS); one bound
                             by dependent loop steps (fp8graph's delayed record: MEASURED_EXTERN_STEP_US) at
                             least its steps at the time a step measured.
optimizer                    bench decoder's eager SGD (``p.add_(p.grad)``): 3 passes over each parameter.

``bench model`` re-times here the rows its child processes captured, and ``bench show`` re-reads them from a
result file; the H100's rates are fp8graph's own (``fp8graph.costs.gpus``), which per-site decisions use too.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from bench.costmodel.coalescing import scattered_bytes

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "float8_e8m0fnu": 1, "uint8": 1, "int8": 1, "bool": 1, "int16": 2, "int32": 4,
               "int64": 8, "float64": 8, "complex64": 8}
TINY_BYTES = 100_000  # a launch moving under 0.1 MB is all launch latency and tail on an H100


def _h100(rate):
    """A Machine field defaulting to ``rate(fp8graph.costs.gpus.H100)``, read when a Machine is made: the
    capture's child processes import this module beside an earlier commit's fp8graph (calibration), which
    has no fp8graph.costs, and make no Machine."""
    def default():
        from fp8graph.costs.gpus import H100

        return rate(H100)

    return dataclasses.field(default_factory=default)


# Machine's fields from an fp8graph.costs.gpus.GPU's (those not here keep their defaults).
_GPU_RATES = {
    "copy_bandwidth": lambda gpu: gpu.copy_bandwidth,
    "triton_bandwidth": lambda gpu: gpu.triton_bandwidth,
    "launch_floor_us": lambda gpu: gpu.launch_floor_us,
    "bf16_flops": lambda gpu: gpu.bf16_flops,
    "fp8_flops": lambda gpu: gpu.fp8_gemm_flops["current"],
    "fp8_rowwise_flops": lambda gpu: gpu.fp8_gemm_flops["rowwise"],
    "fp8_blockwise_flops": lambda gpu: gpu.fp8_gemm_flops["block"],
    "grouped_bf16_flops": lambda gpu: gpu.grouped_bf16_flops,
    "grouped_fp8_flops": lambda gpu: gpu.grouped_fp8_flops,
    "grouped_bf16_flops_large": lambda gpu: gpu.grouped_bf16_flops_large,
    "grouped_fp8_flops_large": lambda gpu: gpu.grouped_fp8_flops_large,
    "gemm_floor_us": lambda gpu: gpu.gemm_floor_us,
    "cast_fraction": lambda gpu: gpu.cast_fraction,
    "transposed_store_fraction": lambda gpu: gpu.transposed_store_fraction,
}


@dataclasses.dataclass
class Machine:
    """The H100's rates (fp8graph.costs.gpus.H100, where each is sourced): the copy bandwidth is measured, the
    others are fitted to the stored H100 runs of 2026-11-23 (torch 2.11; bench/results/), so ``bench model
    calibrate`` on those runs shows a fit. ``bench model``'s rate options override them."""

    copy_bandwidth: float = _h100(_GPU_RATES["copy_bandwidth"])
    triton_bandwidth: float = _h100(_GPU_RATES["triton_bandwidth"])
    launch_floor_us: float = _h100(_GPU_RATES["launch_floor_us"])  # launch latency and tail (no CPU overhead)
    bf16_flops: float = _h100(_GPU_RATES["bf16_flops"])
    fp8_flops: float = _h100(_GPU_RATES["fp8_flops"])  # FP8 tensorwise
    fp8_rowwise_flops: float = _h100(_GPU_RATES["fp8_rowwise_flops"])
    fp8_blockwise_flops: float = _h100(_GPU_RATES["fp8_blockwise_flops"])
    # cuDNN flash fwd+bwd on the FLOPs it computes: fitted to the H100's decoder profiles, whose calls were given
    # HuggingFace's causal mask as a tensor (every tile computed): 12.5-13.4 ms (4 layers)
    attention_flops: float = 290e12
    grouped_bf16_flops: float = _h100(_GPU_RATES["grouped_bf16_flops"])
    grouped_fp8_flops: float = _h100(_GPU_RATES["grouped_fp8_flops"])
    grouped_bf16_flops_large: float = _h100(_GPU_RATES["grouped_bf16_flops_large"])
    grouped_fp8_flops_large: float = _h100(_GPU_RATES["grouped_fp8_flops_large"])
    gemm_floor_us: float = _h100(_GPU_RATES["gemm_floor_us"])
    cast_fraction: float = _h100(_GPU_RATES["cast_fraction"])  # FP8 casts against Inductor's other kernels
    transposed_store_fraction: float = _h100(_GPU_RATES["transposed_store_fraction"])  # fp8graph's transposes
    gpu: str = "H100"  # whose rates these are (fp8graph.costs.gpus), as the model's results name the device

    @classmethod
    def of(cls, gpu_name: str) -> "Machine":
        """The rates of the GPU ``fp8graph.costs.gpus`` knows by ``gpu_name`` ("H100", "H200", "B200")."""
        from fp8graph.costs.gpus import gpu

        rates = gpu(gpu_name)
        return cls(**{field: rate(rates) for field, rate in _GPU_RATES.items()}, gpu=rates.name)


@dataclasses.dataclass
class Row:
    graph: str  # "0:forward", "1:backward" (Inductor graph index and kind), or "optimizer"
    kind: str  # triton | gemm | attention | extern | memset | optimizer
    name: str  # kernel name, extern kernel, or op
    detail: str = ""  # Triton: pointwise / reduction / ...; GEMM: operands and MxKxN; extern: operand shapes
    count: int = 1  # launches per step (a regional graph runs once per layer)
    read: int = 0  # bytes per launch
    written: int = 0
    reread: int = 0  # bytes of inputs loaded again in a later loop of the kernel: up to this much more traffic
    duplicate_written: int = 0  # FP8 bytes that store a value already stored, at the same index, in another buffer
    scattered: int = 0  # DRAM bytes beyond read + written: stores a row apart move whole sectors (coalescing)
    flops: float = 0.0
    gemm: str = ""  # bf16 | fp8 tensorwise | fp8 rowwise | fp8 blockwise | bf16 grouped | fp8 rowwise grouped
    largest_numel: int = 0  # elements of its largest tensor operand: which of a site's operands it works on
    serial_steps: int = 0  # an extern kernel bound by dependent loop steps, not bytes (MEASURED_EXTERN_STEP_US)
    group_rows: float = 0.0  # a grouped GEMM's tokens a group, on average (its rate depends on them)
    lays_out_nothing: bool = False  # an op of TRANSPOSED_STORE_OPS whose layout came out empty (layout=False)
    regathered: int = 0  # of read, a GATHERING_OPS launch's source rows read again (a token's top_k times, less one)

    @property
    def bytes(self) -> int:
        return self.read + self.written


# The rows that move bytes outside the GEMMs, attention and the optimizer: Inductor's kernels and the custom ops (a
# recipe's casts, and BF16's own routing, norms and activations). Memsets move none.
OUTSIDE_GEMM_KINDS = ("triton", "extern")


def counted_once(row: Row) -> int:
    """``row``'s bytes with each operand counted once, as Inductor counts its own kernels' (a gather's source once,
    however many times it reads a row): the one count that sets fp8graph's gathering ops beside Inductor's gathers.
    Time prices the gathered rows (:data:`GATHERING_OPS`)."""
    return row.bytes - row.regathered


# An FP8 cast kernel of Inductor's: the cast saturates, so its name lists clamp among the ops it fused.
_FP8_CAST = re.compile(r"_clamp_")


def fp8_cast(row: Row) -> bool:
    """Whether ``row`` is a Triton kernel that casts to FP8 (:data:`_FP8_CAST`)."""
    return row.kind == "triton" and bool(_FP8_CAST.search(row.name))


def time_us(row: Row, machine: Machine, triton_bandwidth: float | None = None) -> float:
    """One launch of ``row``; Triton kernels at ``triton_bandwidth`` (default: copy bandwidth), FP8 casts at
    ``machine.cast_fraction`` of it."""
    if row.kind == "triton":
        traffic = row.bytes + row.scattered
        bandwidth = (triton_bandwidth or machine.copy_bandwidth) * (machine.cast_fraction if fp8_cast(row) else 1)
        return max(traffic / bandwidth * 1e6, machine.launch_floor_us)
    if row.kind == "gemm":
        if row.gemm.endswith("grouped"):  # fp8graph's rates (children of an earlier commit's fp8graph lack them)
            from fp8graph.costs.gpus import grouped_rate
        if row.gemm == "bf16 grouped":
            rate = grouped_rate(machine.grouped_bf16_flops, machine.grouped_bf16_flops_large, row.group_rows)
        elif row.gemm == "fp8 rowwise grouped":
            rate = grouped_rate(machine.grouped_fp8_flops, machine.grouped_fp8_flops_large, row.group_rows)
        else:
            rate = {"bf16": machine.bf16_flops, "fp8 tensorwise": machine.fp8_flops,
                    "fp8 rowwise": machine.fp8_rowwise_flops,
                    "fp8 blockwise": machine.fp8_blockwise_flops}.get(row.gemm, machine.bf16_flops)
        return max(row.flops / rate * 1e6,
                   row.bytes / machine.copy_bandwidth * 1e6, machine.gemm_floor_us)
    if row.kind == "attention":
        return max(row.flops / machine.attention_flops * 1e6, machine.gemm_floor_us)
    bandwidth = (extern_bandwidth(extern_op(row.name), machine, transposed=not row.lays_out_nothing)
                 if row.kind == "extern" else machine.copy_bandwidth)
    steps_us = row.serial_steps * MEASURED_EXTERN_STEP_US.get(extern_op(row.name), (0.0,))[0]
    return max(row.bytes / bandwidth * 1e6, steps_us, machine.launch_floor_us)  # extern, memset, optimizer


# Extern kernels that run far from copy bandwidth, at the effective bandwidth (operand bytes over kernel time) a
# GPU measured; every other extern kernel is timed at copy bandwidth. op: (bytes/s, the measurement).
MEASURED_EXTERN_BANDWIDTH = {
    # One thread reduces each output element: latency-bound whatever the GPU's bandwidth.
    "segment_reduce": (0.30e12, "bench/results/moe-2026-11-27T132818Z.json: NVIDIA H200, fp8graph ec8f139, "
                                "row-wise MoE block at 2048 tokens an expert, 4 calls reading 3.36 GB in 11.11 ms"),
}


# Extern kernels whose time is a chain of dependent loop steps (each waiting on its loads), not their bytes: op ->
# (us a step, the measurement). The steps of a launch are counted from its operands (``Row.serial_steps``).
MEASURED_EXTERN_STEP_US = {
    # fp8graph::record_delayed_ finishes each row's partial amaxes a block a step, then rolls its history. At
    # ec8f139 one program walked every row of a call in blocks of 1024: Qwen3-30B-A3B's block at 2048 tokens an
    # expert, 4 calls of 1796 steps in all (tests/bench/test_cost_model.py counts them), 1.02 ms on the H200.
    "record_delayed_": (0.567, "bench/results/moe-2026-11-27T132818Z.json: NVIDIA H200, fp8graph ec8f139, delayed "
                               "MoE block at 2048 tokens an expert, record_delayed_kernel 1.019 ms in 4 calls"),
}


def record_delayed_steps(extern) -> int:
    """The loop steps of a ``record_delayed_`` launch's longest program, from its operands: the 1-D partial amaxes
    (read) and the histories (written in place), as the captured fp8graph's kernel runs them
    (``fp8graph.kernels.delayed_record.loop_steps``; :func:`_earlier_record_steps` for a commit without it)."""
    lengths = [_numel(shape) for shape, _ in extern.inputs if len(shape) == 1]
    history_len = max((shape[1] for shape, _ in getattr(extern, "mutated", ()) if len(shape) == 2), default=1)
    rows = next((shape[1] for shape, _ in extern.inputs if len(shape) == 2), 1)  # new_scales: (members, rows)
    try:
        from fp8graph.kernels.delayed_record import loop_steps
    except ImportError:
        return _earlier_record_steps(lengths, history_len, rows)
    return loop_steps(max(lengths, default=0), history_len)


def _earlier_record_steps(lengths: list[int], history_len: int, rows: int) -> int:
    """The record kernel's steps before its blocks grew with the rows (2026-11-28): blocks of 1024; a program a
    row since 7d80b35, before it a program a member walking its ``rows`` rows (``lengths`` member by member)."""
    import inspect

    from fp8graph.kernels import delayed_record

    steps = [-(-length // 1024) + -(-history_len // 1024) for length in lengths]
    if "(len(histories), rows)" in inspect.getsource(delayed_record.plan_record_delayed):  # a program a row
        return max(steps, default=0)
    return max((sum(steps[start:start + rows]) for start in range(0, len(steps), max(rows, 1))), default=0)


# fp8graph's Triton kernels that store tiles transposed: at ``Machine.transposed_store_fraction`` of copy bandwidth
# (fp8graph.costs.gpus, where the H200's measurement is; tests/bench/test_cost_model.py derives it).
TRANSPOSED_STORE_OPS = ("transpose_fp8", "transpose_fp8_into_", "quantize_both_layouts", "quantize_both_layouts_into_",
                        "quantize_expert_columns", "quantize_expert_columns_into_", "quantize_group_columns_placed",
                        "quantize_rows_placed", "quantize_transposed", "quantize_weighted_rows_placed",
                        "quantize_weighted_rows_rowwise", "swiglu_backward_placed", "swiglu_backward_rowwise",
                        "swiglu_forward_placed")


# Of those, the casts that take ``layout=False`` (no grad_weight: the experts' weights frozen): their first output
# is the rows, their second the layout, (C, 0) where they laid nothing out.
LAYOUT_OPTIONAL_OPS = ("quantize_weighted_rows_placed", "quantize_weighted_rows_rowwise", "swiglu_backward_placed",
                       "swiglu_backward_rowwise")


def extern_bandwidth(op: str, machine: Machine, transposed: bool = True) -> float:
    """The bandwidth an extern kernel's operand bytes move at: measured (:data:`MEASURED_EXTERN_BANDWIDTH`), a
    fraction of copy bandwidth (:data:`TRANSPOSED_STORE_OPS`, unless this launch laid nothing out:
    ``transposed=False``), else copy bandwidth."""
    if op in MEASURED_EXTERN_BANDWIDTH:
        return MEASURED_EXTERN_BANDWIDTH[op][0]
    if op in TRANSPOSED_STORE_OPS and transposed:
        return machine.copy_bandwidth * machine.transposed_store_fraction
    return machine.copy_bandwidth


def extern_op(name: str) -> str:
    """The op of an extern kernel's name: ``segment_reduce`` of ``torch.ops.aten.segment_reduce.default``."""
    parts = name.split(".")
    return parts[-2] if parts[-1] == "default" and len(parts) > 1 else parts[-1]


def summary(rows: list[Row], machine: Machine) -> dict:
    """Per-step totals (every row counted ``row.count`` times); times in ms."""
    def of(kind):
        return [r for r in rows if r.kind == kind]

    def total(selection, value):
        # The launches of each value counted first, then one correctly rounded sum: BF16's kernels in another order
        # or split otherwise between rows (policies.auto() keeping every site; a step of n micro-batches as one
        # first and n - 1 reusing ones, where BF16's runs each kernel n times) model BF16's step to the last bit,
        # not a hair slower or faster.
        launches = collections.Counter()
        for r in selection:
            launches[value(r)] += r.count
        return math.fsum(each * count for each, count in launches.items())

    triton, gemm = of("triton"), of("gemm")
    other = of("extern") + of("memset")
    result = {
        "triton_launches": sum(r.count for r in triton),
        "triton_kernels": len({(r.graph, r.name) for r in triton}),
        "triton_read_gb": total(triton, lambda r: r.read) / 1e9,
        "triton_written_gb": total(triton, lambda r: r.written) / 1e9,
        "triton_reread_gb_upper": total(triton, lambda r: r.reread) / 1e9,
        "duplicate_written_gb": total(triton, lambda r: r.duplicate_written) / 1e9,
        "triton_scattered_gb": total(triton, lambda r: r.scattered) / 1e9,
        "tiny_launches": sum(r.count for r in triton if r.bytes < TINY_BYTES),
        "triton_ms_copy": total(triton, lambda r: time_us(r, machine)) / 1e3,
        "triton_ms": total(triton, lambda r: time_us(r, machine, machine.triton_bandwidth)) / 1e3,
        "gemms": sum(r.count for r in gemm),
        "gemm_tflop": total(gemm, lambda r: r.flops) / 1e12,
        "gemm_ms": total(gemm, lambda r: time_us(r, machine)) / 1e3,
        "attention_ms": total(of("attention"), lambda r: time_us(r, machine)) / 1e3,
        "other_externs": sum(r.count for r in other),
        "other_ms": total(other, lambda r: time_us(r, machine)) / 1e3,
        "optimizer_ms": total(of("optimizer"), lambda r: time_us(r, machine)) / 1e3,
        "outside_gemm_gb": total([r for r in rows if r.kind in OUTSIDE_GEMM_KINDS], counted_once) / 1e9,
    }
    rest = result["gemm_ms"] + result["attention_ms"] + result["other_ms"] + result["optimizer_ms"]
    result["step_ms"] = result["triton_ms"] + rest  # Triton kernels at the H100-calibrated rate
    result["step_ms_copy"] = result["triton_ms_copy"] + rest
    return result


# --- rows from a capture (duck-typed on capture.py's records, so that this module needs no torch) ----------

_KIND = {"poi": "pointwise", "red": "reduction", "per": "persistent", "tem": "template", "for": "foreach",
         "spl": "split-scan", "mix": "mix-order"}
_LOAD = re.compile(r"tl\.load\((\w+) \+")
_STORE = re.compile(r"tl\.store\((\w+) \+ \((.*?)\), (\w+),")
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_mm_v2", "scaled_mm", "_int_mm"}
# Grouped GEMMs (a mixture of experts' expert GEMMs), as Inductor's wrapper names them: extern_kernels._grouped_mm,
# extern_kernels._scaled_grouped_mm, or torch.ops.aten._scaled_grouped_mm.default as a fallback.
_GROUPED_GEMMS = {"_grouped_mm", "_scaled_grouped_mm", "_scaled_grouped_mm_v2", "grouped_mm", "scaled_grouped_mm"}


def duplicate_store_bytes(source: str, args) -> int:
    """Bytes of FP8 stores that repeat another store's value and index into a second buffer: one FP8
    tensor materialised twice (e.g. the same FP8 bytes for ``_scaled_mm`` and again for a custom op)."""
    groups: dict[tuple, list[str]] = {}
    for pointer, index, value in _STORE.findall(source):
        groups.setdefault((index, value), []).append(pointer)
    written = {a.arg: a.written for a in args or () if a.dtype.startswith("float8")}
    return sum(written.get(p, 0) for pointers in groups.values() for p in pointers[1:])


def reread_bytes(source: str, args) -> int:
    """Bytes of inputs loaded in more than one region of the kernel (before the loops, in each loop over
    the reduction, after them): a looped reduction that reads its input again, e.g. a norm whose rows are
    longer than one block. The second pass may hit L2, so DRAM traffic lies between read and read + this."""
    body = source.split("@triton.jit", 1)[-1].split("\ndef get_args", 1)[0]
    regions: dict[str, set] = {}
    region = 0
    for line in body.splitlines():
        indent = len(line) - len(line.lstrip())
        if line.strip().startswith("for ") and indent == 4:
            region += 1
            current = region
        elif indent == 4 and region:
            current = ("after", region)
        else:
            current = region if indent > 4 else 0
        for pointer in _LOAD.findall(line):
            regions.setdefault(pointer, set()).add(current)
    return sum(a.read * (len(regions.get(a.arg, ())) - 1) for a in args or () if len(regions.get(a.arg, ())) > 1)


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


# fp8graph's ops that read their first operand's rows through an index (``gather_index``, the last int64 1-D
# operand): each gathered row is read, top_k times a token's, from DRAM where the source outgrows L2 (Qwen3-30B-A3B's
# 134 MB of hidden states against 50-60 MB): priced as the gathered rows, not the source.
GATHERING_OPS = ("quantize_group_columns_placed", "quantize_rows_placed", "quantize_weighted_rows_placed",
                 "quantize_weighted_rows_rowwise")


def _gathered_read(extern) -> int | None:
    """Bytes a :data:`GATHERING_OPS` launch reads of its source's rows, or None where it gathers none."""
    (source, dtype), *rest = extern.inputs
    index = [shape for shape, d in rest if d == "int64" and len(shape) == 1]
    if not index or len(source) != 2:
        return None
    return index[-1][0] * source[1] * DTYPE_BYTES.get(dtype, 4)


def _extern_row(graph: str, extern) -> Row:
    kernel = extern.kernel
    op = extern_op(kernel)
    elements = getattr(extern, "input_elements", None) or [None] * len(extern.inputs)
    operand_bytes = [(_numel(s) if n is None else min(n, _numel(s))) * DTYPE_BYTES.get(d, 4)
                     for (s, d), n in zip(extern.inputs, elements)]
    gathered = _gathered_read(extern) if op in GATHERING_OPS else None
    regathered = 0
    if gathered is not None:  # the gathered rows in place of the source's
        regathered = max(gathered - operand_bytes[0], 0)
        operand_bytes[0] = gathered
    read = sum(operand_bytes)
    written = sum(_numel(s) * DTYPE_BYTES.get(d, 4) for s, d in [*extern.outputs, *getattr(extern, "mutated", ())])
    shapes = [s for s, _ in extern.inputs]
    dtypes = [d for _, d in extern.inputs]
    row = Row(graph, "extern", kernel, " ".join("x".join(map(str, s)) + f":{d}" for s, d in extern.inputs),
              read=read, written=written, regathered=regathered,
              largest_numel=max((_numel(s) for s, _ in [*extern.inputs, *extern.outputs]), default=0))
    if op in MEASURED_EXTERN_STEP_US:
        row.serial_steps = record_delayed_steps(extern)
    if op in LAYOUT_OPTIONAL_OPS:  # told to lay nothing out (frozen experts), it returns rows and an empty layout
        (rows, _), (layout, _) = extern.outputs[:2]
        row.lays_out_nothing = _numel(rows) > 0 and len(layout) == 2 and layout[-1] == 0
    if op in _GROUPED_GEMMS:
        _grouped_gemm(row, op, shapes, dtypes)
    elif op in _GEMMS:
        matrices = [s for s in shapes if len(s) >= 2]
        a, b = (matrices[-2], matrices[-1]) if op in ("addmm", "baddbmm") else (matrices[0], matrices[1])
        batch = a[0] if len(a) == 3 else 1
        m, k, n = a[-2], a[-1], b[-1]
        row.kind, row.flops = "gemm", 2.0 * batch * m * n * k
        if "scaled" in op or any(d.startswith("float8") for d in dtypes):
            # The scales follow the two matrices: one element each (tensorwise), one per row of a (rowwise),
            # else per block.
            scale_a = _numel(shapes[2]) if len(shapes) > 2 else 1
            row.gemm = "fp8 tensorwise" if scale_a == 1 else "fp8 rowwise" if scale_a == m else "fp8 blockwise"
        else:
            row.gemm = "bf16"
        row.detail = f"{row.gemm} {f'{batch}x' if batch > 1 else ''}{m}x{k}x{n}"
    elif any(word in op for word in ("attention", "sdpa", "flash", "cudnn")):
        (b, h, sq, d), sk = shapes[0], shapes[1][-2]
        causal = bool(getattr(extern, "is_causal", None)) and sq == sk
        row.kind = "attention"
        row.flops = (4.0 * b * h * sq * sk * d * (2.5 if "backward" in op else 1.0)
                     * (causal_fraction(sq) if causal else 1.0))
        row.detail = f"B{b} H{h} S{sq}x{sk} D{d}" + (" causal" if causal else "")
    return row


def causal_fraction(sequence: int) -> float:
    """The share of a square attention's FLOPs a causal call computes: the triangle on and below the diagonal. A
    call with ``is_causal`` skips the tiles above it; one given the causal mask as a tensor (HuggingFace's, under
    Dynamo before pytorch#176499: the GPU machine's torch 2.11) computes every tile and masks them."""
    return (sequence + 1) / (2 * sequence)


def grouped_gemm_flops(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[float, str]:
    """FLOPs of ``torch._grouped_mm(a, b, offs)`` (or ``_scaled_grouped_mm``) summed over its groups, and its form.

    rows      a (S, K), b (E, K, N) -> (S, N): each row of a times its group's matrix: 2 S K N, whatever the
              routing (rows past offs[-1] are in no group and cost nothing on the GPU; counted here)
    weights   a (N, S), b (S, K) -> (E, N, K): each group reduces its own tokens, so the groups' products
              add up to 2 N S K (fp8graph pads each group to a multiple of 16 tokens: its S is the padded
              bound, rows + 16 E, of which the kernel computes the padded groups, rows + 7.5 E on average)
    batched   a (E, M, K), b (E, K, N) -> (E, M, N): 2 E M K N
    columns   a (E, M, K), b (K, N) -> (M, N) in E column groups: 2 M K N
    """
    if len(a) == 2 and len(b) == 3:
        return 2.0 * a[0] * a[1] * b[2], "rows"
    if len(a) == 2 and len(b) == 2:
        return 2.0 * a[0] * a[1] * b[1], "weights"
    if len(a) == 3 and len(b) == 3:
        return 2.0 * a[0] * a[1] * a[2] * b[2], "batched"
    if len(a) == 3 and len(b) == 2:
        return 2.0 * a[1] * a[2] * b[1], "columns"
    raise ValueError(f"a grouped GEMM of shapes {a} and {b}: no such form")


def _grouped_gemm(row: Row, op: str, shapes: list, dtypes: list) -> None:
    """A grouped GEMM costed as a GEMM by its FLOPs (``grouped_gemm_flops``) at the grouped rates for its tokens
    a group (``Machine.grouped_*_flops``, below the dense rates). The scaled one takes row-wise scales on SM90
    (a per-tensor scale is passed expanded to rows): "fp8 rowwise grouped"."""
    a, b = shapes[0], shapes[1]
    row.kind = "gemm"
    row.flops, form = grouped_gemm_flops(a, b)
    fp8 = "scaled" in op or any(d.startswith("float8") for d in dtypes[:2])
    row.gemm = "fp8 rowwise grouped" if fp8 else "bf16 grouped"
    offsets = [s for s, d in zip(shapes[2:], dtypes[2:]) if d == "int32" and len(s) == 1]
    groups = offsets[-1][0] if offsets else (a[0] if len(a) == 3 else None)
    row.detail = (f"{row.gemm} ({form}) {'x'.join(map(str, a))} . {'x'.join(map(str, b))}"
                  + (f", {groups} groups" if groups else ""))
    if form in ("rows", "weights"):  # the sorted tokens: a's rows, or its columns in the weights form
        row.group_rows = (a[0] if form == "rows" else a[1]) / groups if groups else 0.0
    else:  # a batch of E matrices of M rows
        row.group_rows = float(a[-2])


def rows_of(capture) -> list[Row]:
    """One row per launch site of every captured graph, in launch order, counted per step
    (``capture`` checked that every kernel and extern call was found in its graph's wrapper)."""
    rows = []
    for graph in capture.graphs:
        label = f"{graph.index}:{graph.kind}"
        externs = {e.name: e for e in graph.externs}
        for what, name in graph.order:
            if what == "triton":
                record = graph.kernels[name]
                short = name.split("_")[1] if name.startswith("triton_") else "?"
                row = Row(label, "triton", name, _KIND.get(short, short),
                          read=sum(a.read for a in record.args or ()),
                          written=sum(a.written for a in record.args or ()),
                          reread=reread_bytes(record.source, record.args),
                          duplicate_written=duplicate_store_bytes(record.source, record.args),
                          scattered=scattered_bytes(record.source, {a.arg: DTYPE_BYTES.get(a.dtype, 4)
                                                                    for a in record.args or ()}),
                          largest_numel=max((a.numel for a in record.args or ()), default=0))
            elif what == "extern":
                row = _extern_row(label, externs[name])
            else:
                row = Row(label, "memset", name)
            row.count = max(graph.runs, 1)
            rows.append(row)
    return rows


# --- the parent's side: rows and summaries back from JSON --------------------------------------------------

def rows_from_json(case: dict) -> list[Row]:
    fields = {f.name for f in dataclasses.fields(Row)}
    return [Row(**{k: v for k, v in row.items() if k in fields}) for row in case["rows"]]


def summarize(results: list[dict], machine: Machine) -> None:
    """Add each case's ``summary`` (at ``machine``'s rates) to the child processes' results."""
    for result in results:
        for case in result.get("cases", []):
            case["summary"] = summary(rows_from_json(case), machine)


def markdown(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |",
            *("| " + " | ".join(row) + " |" for row in rows)]
