"""The child process's side: one contestant of one workload, compiled for the fake H100 and captured.

Each contestant runs in a process of its own (``bench.costmodel.child``): torchao patches Inductor's
codegen when it converts a model, fp8graph registers custom ops and Dynamo keeps state, none of which may
leak into the next contestant. Contestants are ``bench decoder``'s (``bench.decoder.KNOWN``), compiled the
way it compiles them, with every Inductor graph captured instead of compiled to a GPU binary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import capture, costs, fake_h100, peak_memory


def _fp8graph_contestant(base: str) -> bool:
    return base.split()[0] not in ("bf16", "torchao")


@contextlib.contextmanager
def compiled(base: str, model, compile_model=None):
    """``model`` compiled as contestant ``base`` (``bench.decoder``'s way, or ``compile_model(model, base,
    compiler)``'s), each Inductor graph lowered under the capture and run eagerly on FakeTensors. Call the
    result inside the ``with``: compiling happens at the first call. fp8graph's contestants compile each
    rewritten graph through one FP8Backend method (``_compile_graph``; ``_lower`` in the commits the
    calibration runs), regional ones too."""
    from torch._inductor.compile_fx import compile_fx

    from fp8graph.backend import FP8Backend

    if compile_model is None:
        from bench.decoder import _compile as compile_model
    if not _fp8graph_contestant(base):
        yield compile_model(model, base, capture.compile_only(compile_fx))
        return
    method = "_compile_graph" if hasattr(FP8Backend, "_compile_graph") else "_lower"
    compile_graph = getattr(FP8Backend, method)
    setattr(FP8Backend, method, lambda self, gm, inputs: capture.lower_then_run_eagerly(
        lambda g, e: compile_graph(self, g, e), gm, inputs))
    try:
        yield compile_model(model, base, "inductor")
    finally:
        setattr(FP8Backend, method, compile_graph)


def _fp8_note(compiled_model, model) -> str:
    """What was put in FP8: torchao's swapped modules, or fp8graph's decisions."""
    swapped = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if swapped:
        return f"torchao: {swapped} nn.Linear swapped for Float8Linear"
    backend = getattr(compiled_model, "fp8graph_backend", None)
    if backend is None:
        return ""
    decisions = backend.decisions
    kept = sorted({f"{d.site.path or '<root>'}: {d.reason}" for d in decisions if not d.rewritten})
    return f"fp8graph: {sum(d.rewritten for d in decisions)} of {len(decisions)} sites in FP8" + \
        (f"; kept: {'; '.join(kept[:4])}" if kept else "")


def _case(label: str, cap: capture.Capture, note: str = "", extra_rows=()) -> dict:
    rows = costs.rows_of(cap) + list(extra_rows)
    return {"case": label, "note": note, "rows": [dataclasses.asdict(r) for r in rows],
            "graphs": [{"index": g.index, "kind": g.kind, "runs": g.runs,
                        "triton_kernels": len(g.kernels), "externs": len(g.externs),
                        "memory": dataclasses.asdict(g.memory) if g.memory else None} for g in cap.graphs],
            "_capture": cap}


def _sgd_rows(model) -> list[costs.Row]:
    """bench decoder's optimizer step, eager: ``p.add_(p.grad, alpha=-lr)`` per parameter that trains (read 2,
    write 1)."""
    sizes: dict[int, int] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        sizes[nbytes] = sizes.get(nbytes, 0) + 1
    return [costs.Row("optimizer", "optimizer", "param.add_(param.grad) (eager SGD)", f"{n / 1e6:.1f} MB parameter",
                      count=count, read=2 * n, written=n) for n, count in sorted(sizes.items(), reverse=True)]


def _check_attention(case: dict, model) -> None:
    """A Llama step must show cuDNN attention: without it SDPA decomposed into Triton kernels (the fake
    device's SDPA patch stopped applying) and every number of the step would be wrong."""
    if not any(row["kind"] == "attention" for row in case["rows"]):
        raise capture.CaptureError("no cuDNN attention call in the captured step: SDPA decomposed, so the fake "
                                   "H100's SDPA patch (fake_h100._use_cudnn_attention) no longer applies")


def decoder(spec: dict) -> list[dict]:
    """bench decoder's training step: the model zoo's Llama, batch x sequence tokens,
    ``loss = model(tokens, labels=tokens).loss; loss.backward()`` then an eager SGD step."""
    import torch._inductor.config as inductor_config

    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.decoder import _compile, _swap_in_torchao, parse_contestant
    from fp8graph.models import llama as zoo  # the zoo's configs (calibration: as the measured commit had them)

    base, settings = parse_contestant(spec["contestant"])
    config = {**zoo._COMMON, **zoo.CONFIGS[spec["config"]], **spec.get("overrides", {})}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):  # no memory: the parameters become FakeTensors on "cuda" below
            model = LlamaForCausalLM(LlamaConfig(**config))
    finally:
        torch.set_default_dtype(default_dtype)
    if base.startswith("torchao"):
        _swap_in_torchao(model, base)
    mode = FakeTensorMode()
    model = fake_h100.to_fake_cuda(model, mode).train()
    with mode:
        tokens = torch.zeros(spec["batch"], spec["sequence"], dtype=torch.long, device="cuda")
    compile_model = functools.partial(_compile, policy_gpu=spec.get("policy_gpu"))  # an auto contestant's --gpu
    with capture.Capture() as cap, inductor_config.patch(settings), mode, _one_sequence_a_row(), \
            _masks_materialized_under_dynamo(), compiled(base, model, compile_model) as compiled_model:
        micro_batches = _MicroBatches(cap, compiled_model, lambda: compiled_model(tokens, labels=tokens).loss, None)
        note = micro_batches.run(spec, lambda: _fp8_note(compiled_model, model))
    config = model.config
    label = f"{config.num_hidden_layers} layers, vocab {config.vocab_size}, {spec['batch']}x{spec['sequence']}"
    case = _case(label, cap, note, _sgd_rows(model))
    micro_batches.split(case, grouped=False)
    case["memory"] = micro_batches.memory(peak_memory.persistent_bytes(model, tokens))
    _check_attention(case, model)
    return [case]


@contextlib.contextmanager
def _one_sequence_a_row():
    """HuggingFace's masks, outside a traced graph, as bench decoder's real tokens make them.

    Code that runs eagerly around compiled graphs (fp8graph's regions run the decoder's trunk eagerly) sees
    FakeTensors here, and HuggingFace treats a FakeTensor as a trace: it keeps the position ids' packed-sequence
    mask it cannot read, so SDPA gets an explicit causal mask and the keys and values with their heads repeated.
    On the GPU, real position ids (0..S-1 on every row: bench passes no ``position_ids``) show one sequence a row,
    HuggingFace returns no mask, and SDPA runs causal on the unrepeated keys and values. Under Dynamo's trace
    HuggingFace's own answer is kept (``_masks_materialized_under_dynamo`` makes it the GPU's)."""
    from transformers import masking_utils
    from transformers.utils.import_utils import is_fake_tensor

    original = masking_utils.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids):
        if is_fake_tensor(position_ids) and not torch.compiler.is_compiling():
            return None
        return original(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


# The torch of the GPU machine whose steps the model reproduces (its software, beside the fake H100's hardware):
# what HuggingFace decides under its Dynamo differs from this CPU's torch 2.13.0 (_masks_materialized_under_dynamo).
GPU_TORCH = (2, 11)
_DYNAMO_READS_IS_EXPORTING = (2, 13)  # pytorch#176499: in this CPU's torch 2.13.0 (transformers#48975 says 2.14)


@contextlib.contextmanager
def _masks_materialized_under_dynamo():
    """HuggingFace's causal mask under Dynamo's trace as the GPU machine's torch (2.11) makes it: a tensor.

    HuggingFace leaves the mask out (SDPA runs with ``is_causal`` on the unrepeated keys and values) only where
    ``torch.compiler.is_exporting()`` is False. Dynamo answered True to it under a plain ``torch.compile`` until
    pytorch#176499 (merged 2026-03-10; transformers#48975 says the same of every torch before 2.14), so on the
    GPU machine a whole-model ``torch.compile`` hands SDPA the causal mask as a tensor and the keys and values
    with their heads repeated, and cuDNN computes every tile. This CPU's torch 2.13.0 reads the flag as it is, and
    its trace would leave the mask out. Code that runs eagerly (the trunk around fp8graph's regions) leaves it
    out on the GPU too (``_one_sequence_a_row``)."""
    from transformers import masking_utils

    if GPU_TORCH >= _DYNAMO_READS_IS_EXPORTING:
        yield
        return
    original = masking_utils.is_torchdynamo_exporting
    masking_utils.is_torchdynamo_exporting = torch.compiler.is_compiling
    try:
        yield
    finally:
        masking_utils.is_torchdynamo_exporting = original


def moe(spec: dict) -> list[dict]:
    """bench moe's training step: models/moe.py's block (``spec["config"]``, with ``spec["overrides"]``), BF16,
    ``out = block(x); out.backward(grad_output)`` on x (batch, sequence, hidden), then an eager SGD step.
    The routing (top-k, sort, histc, cumsum) runs on FakeTensors: shapes do not depend on it, and neither do
    the grouped GEMMs' FLOPs (every row of x is in one group). ``spec["shapes"]`` (the sweep: dicts of
    label, config, overrides, batch and sequence) gives a case each, Dynamo reset between them."""
    shapes = spec.get("shapes") or [{"label": None, "config": spec["config"], "overrides": spec.get("overrides", {}),
                                     "batch": spec["batch"], "sequence": spec["sequence"]}]
    cases = []
    for shape in shapes:
        torch._dynamo.reset()
        cases.append(_moe_case(spec, shape))
    return cases


def _moe_case(spec: dict, shape: dict) -> dict:
    import torch._inductor.config as inductor_config

    from bench.moe import compile_block, fp8_note, freeze_experts, parse_contestant, swap_in_torchao
    from fp8graph.models import moe as zoo

    contestant = spec["contestant"]
    base, settings = parse_contestant(contestant)
    config = {**zoo.CONFIGS[shape["config"]], **shape["overrides"]}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):  # no memory: the parameters become FakeTensors on "cuda" below
            block = zoo.build(config)
    finally:
        torch.set_default_dtype(default_dtype)
    mode = FakeTensorMode()
    block = fake_h100.to_fake_cuda(block, mode).train()
    if base.startswith("torchao"):  # after the move: to_fake_cuda would drop torchao's tensor subclass
        with mode:
            swap_in_torchao(block)
    if spec.get("frozen_experts"):
        freeze_experts(block)
    with mode:
        x = torch.empty(shape["batch"], shape["sequence"], config["hidden"], dtype=torch.bfloat16, device="cuda",
                        requires_grad=True)
        grad_output = torch.empty(x.shape, dtype=torch.bfloat16, device="cuda")
    with capture.Capture() as cap, inductor_config.patch(settings), mode, \
            compiled(base, block, functools.partial(compile_block, policy_gpu=spec.get("policy_gpu"))) \
            as compiled_block:
        micro_batches = _MicroBatches(cap, compiled_block, lambda: compiled_block(x), grad_output)
        note = micro_batches.run(spec, lambda: fp8_note(compiled_block, block))
    label = shape["label"] or (f"{config['experts']} experts, top {config['top_k']}, hidden {config['hidden']}, "
                               f"expert width {config['expert_width']}, {shape['batch']}x{shape['sequence']}")
    case = _case(label, cap, note, _sgd_rows(block))
    frozen_experts = bool(spec.get("frozen_experts"))
    micro_batches.split(case, frozen_experts=frozen_experts)
    case["memory"] = micro_batches.memory(peak_memory.persistent_bytes(block, x))
    _check_grouped_gemms(case, base, frozen_experts)
    return case


def _accumulating(spec: dict) -> bool:
    """Whether the spec models steps of several micro-batches (``bench.model.accumulate``)."""
    return spec.get("grad_accumulation", [1]) != [1]


@dataclasses.dataclass
class _MicroBatches:
    """The micro-batches of a captured step, as bench's steps run them (``bench.timing.accumulated_step``).

    A step of one micro-batch casts the weights per call. A step of several declares them unchanged
    (``fp8graph.weights_unchanged``), as users write gradient accumulation: the first micro-batch casts the
    weights and keeps the casts (a "fill"), the others read them (a "reuse"). Where the spec models both, the
    capture runs a fill, a reuse and, after the declaration, a call per call: each compiles graphs of its own
    (Dynamo guards on the cache's mode), and :meth:`split` gives each its rows."""

    cap: capture.Capture
    compiled_model: object
    loss: object
    grad_output: object
    runs: list = dataclasses.field(default_factory=list)  # the graphs' runs after each call, in order
    kinds: list = dataclasses.field(default_factory=list)  # what each call was: "first", "reuse", "per call"

    def _call(self, kind: str) -> None:
        self.loss().backward(self.grad_output)
        self.runs.append(_runs(self.cap))
        self.kinds.append(kind)

    def run(self, spec: dict, note) -> str:
        """Run the step's micro-batches under the capture; returns ``note()`` of the first one's graphs."""
        weight_cache = getattr(getattr(self.compiled_model, "fp8graph_backend", None), "weight_cache", None)
        accumulating = _accumulating(spec) and bool(weight_cache)  # a cache without weights keeps nothing
        declared = contextlib.nullcontext()
        if accumulating:
            import fp8graph

            declared = fp8graph.weights_unchanged(self.compiled_model)
        with declared:
            self._call("first")
            text = note()  # a reusing micro-batch adds graphs of its own
            if accumulating:  # the next micro-batch of the step reads the weights' casts the first one kept
                self._call("reuse")
                if not weight_cache.reuse:
                    raise capture.CaptureError(f"{spec['contestant']}: the second micro-batch did not reuse the "
                                               "weights' casts")
        if accumulating and 1 in spec["grad_accumulation"]:  # a step of one micro-batch: outside a declaration
            self._call("per call")
        return text

    def split(self, case: dict, grouped: bool = True, frozen_experts: bool = False) -> None:
        """``rows`` become the first micro-batch's, ``reuse_rows`` a reusing one's and ``per_call_rows`` a
        one-micro-batch step's, where the step ran them: the graphs each call compiled, and the runs each added
        to graphs they share (a regional model's graphs without FP8 weights). A step of n micro-batches is
        ``rows`` once and ``reuse_rows`` n - 1 times, a step of one ``per_call_rows`` where there are
        (``bench.model.accumulate``). ``grouped``: each checked for the MoE step's grouped GEMMs
        (:func:`_check_grouped_gemms`, ``frozen_experts``: without grad_weight's)."""
        if len(self.runs) == 1:
            return
        phases = {kind: [] for kind in self.kinds}
        before = [{}] + self.runs[:-1]
        for row in case["rows"]:
            if row["graph"] not in self.runs[-1]:  # the optimizer's, once a step: the first's, and a per-call step's
                for kind, rows in phases.items():
                    if kind != "reuse":
                        rows.append(row)
                continue
            total = self.runs[-1][row["graph"]]  # a row's count is its graph's runs (bench.costmodel.costs.rows_of)
            for kind, start, end in zip(self.kinds, before, self.runs):
                ran = end.get(row["graph"], 0) - start.get(row["graph"], 0)
                if ran:
                    phases[kind].append({**row, "count": row["count"] * ran // total})
        for kind, start, end in zip(self.kinds[1:], before[1:], self.runs[1:]):
            if not set(end) - set(start):
                raise capture.CaptureError(f"the {kind} micro-batch compiled no graph of its own")
        case["rows"], case["reuse_rows"] = phases["first"], phases["reuse"]
        if "per call" in phases:
            case["per_call_rows"] = phases["per call"]
        if grouped:
            _check_grouped_gemms({"rows": case["reuse_rows"]}, "the reusing micro-batch", frozen_experts)
            if "per call" in phases:
                _check_grouped_gemms({"rows": case["per_call_rows"]}, "the per-call micro-batch", frozen_experts)

    def memory(self, persistent: int) -> dict:
        """What lives through the step (``persistent``, bytes) and :func:`peak_memory.call_memory` of each call
        the step ran (``first``, ``reuse``, ``per call``): the graphs it ran, as many times as it ran them."""
        calls = {}
        for kind, start, end in zip(self.kinds, [{}] + self.runs[:-1], self.runs):
            graphs = [(graph.kind, end.get(label, 0) - start.get(label, 0), graph.memory)
                      for graph in self.cap.graphs for label in [f"{graph.index}:{graph.kind}"]]
            calls[kind] = peak_memory.call_memory([graph for graph in graphs if graph[1] > 0])
        return {"persistent": persistent, "calls": calls}


def _runs(cap: capture.Capture) -> dict[str, int]:
    """How many times each graph of the capture ran so far, by its rows' label."""
    return {f"{graph.index}:{graph.kind}": graph.runs for graph in cap.graphs}


def _check_grouped_gemms(case: dict, base: str, frozen_experts: bool = False) -> None:
    """A MoE step's expert GEMMs must be costed as GEMMs: two grouped GEMMs forward and four backward (grad
    input and grad weight of each expert site; with the experts' weights frozen, grad input alone). Fewer means
    a grouped GEMM went unrecognised (costed by its bytes) or was decomposed into Triton kernels, and every
    number of the step would be wrong."""
    grouped = [row for row in case["rows"] if row["kind"] == "gemm" and "grouped" in row["name"]]
    templates = sorted({row["name"] for row in case["rows"] if row["kind"] == "triton"
                        and row["name"].startswith("triton_tem") and "grouped" in row["name"]})
    if templates:
        raise capture.CaptureError(f"{base}: Inductor generated Triton templates for grouped GEMMs {templates[:3]}, "
                                   "which the cost model would cost by their bytes, not their FLOPs")
    expected = 4 if frozen_experts else 6
    if len(grouped) < expected:
        raise capture.CaptureError(
            f"{base}: {len(grouped)} grouped GEMMs costed as GEMMs in the MoE step, expected {expected} (forward, "
            f"grad input{'' if frozen_experts else ' and grad weight'} of both expert sites); extern calls seen: "
            f"{sorted({row['name'] for row in case['rows'] if row['kind'] in ('gemm', 'extern')})}")


def linear(spec: dict) -> list[dict]:
    """bench linear's step per shape: Sequential(nn.Linear(K, N, bias=False)) in BF16, ``out = layer(x);
    out.backward(grad_output)`` on M x K tokens. One Dynamo reset per shape, one process per contestant."""
    import torch._inductor.config as inductor_config

    from bench.decoder import _swap_in_torchao, parse_contestant

    base, settings = parse_contestant(spec["contestant"])
    cases = []
    for m, k, n in spec["shapes"]:
        torch._dynamo.reset()
        model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=spec.get("bias", False), device="meta",
                                                    dtype=torch.bfloat16))
        if base.startswith("torchao"):
            _swap_in_torchao(model, base)
        mode = FakeTensorMode()
        model = fake_h100.to_fake_cuda(model, mode)
        with mode:
            x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            grad_output = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        with capture.Capture() as cap, inductor_config.patch(settings), mode, \
                compiled(base, model) as compiled_model:
            compiled_model(x).backward(grad_output)
        cases.append(_case(f"{m}x{k}x{n}", cap, _fp8_note(compiled_model, model)))
    return cases


def _cast(x, scale):
    return (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def _amax_global(x):
    return x.abs().amax().float()


def _amax_rows(x):
    return x.abs().amax(-1).amax().float()


def _rmsnorm(x, w):
    return x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w


# bench/results/2026-11-23-h100/quantize-structure-probe.txt, the functions as that probe compiled them, each
# called as f(x, s, w): x (rows, columns) BF16, s a scalar scale, w (columns,) fp32. "global": the amax as one
# reduction; "rowpartial": per row, then over the rows; "+T": also the transposed FP8 copy. The first four
# are the casts themselves (the default).
QUANTIZE_VARIANTS = {
    "current global": lambda x, s, w: _cast(x, 448 / _amax_global(x)),
    "current rowpartial": lambda x, s, w: _cast(x, 448 / _amax_rows(x)),
    "delayed global": lambda x, s, w: (_cast(x, s), _amax_global(x)),
    "delayed rowpartial": lambda x, s, w: (_cast(x, s), _amax_rows(x)),
    "delayed rowpartial +T": lambda x, s, w: (_cast(x, s), _cast(x.t(), s).contiguous(), _amax_rows(x)),
    "current rowpartial +T": lambda x, s, w: (lambda sc: (_cast(x, sc), _cast(x.t(), sc).contiguous()))(
        448 / _amax_rows(x)),
    "current global +T": lambda x, s, w: (lambda sc: (_cast(x, sc), _cast(x.t(), sc).contiguous()))(
        448 / _amax_global(x)),
    "bf16 rmsnorm": lambda x, s, w: _rmsnorm(x, w).to(x.dtype),
    "rmsnorm+delayed rowpartial": lambda x, s, w: (lambda y: (_cast(y, s), y.abs().amax(-1).amax()))(_rmsnorm(x, w)),
    "rmsnorm+current rowpartial": lambda x, s, w: (lambda y: _cast(y, 448 / y.abs().amax(-1).amax()))(
        _rmsnorm(x, w)),
    "rmsnorm+current global": lambda x, s, w: (lambda y: _cast(y, 448 / y.abs().amax()))(_rmsnorm(x, w)),
}


def quantize(spec: dict) -> list[dict]:
    """Each variant compiled alone by plain torch.compile (Inductor), after a Dynamo reset."""
    from torch._inductor.compile_fx import compile_fx

    cases = []
    for rows, columns in spec["shapes"]:
        for name in QUANTIZE_VARIANTS if spec["variants"] == "all" else list(QUANTIZE_VARIANTS)[:4]:
            torch._dynamo.reset()
            mode = FakeTensorMode()
            with mode:
                x = torch.empty(rows, columns, dtype=torch.bfloat16, device="cuda")
                s = torch.empty((), dtype=torch.float32, device="cuda")
                w = torch.empty(columns, dtype=torch.float32, device="cuda")
            with capture.Capture() as cap, mode:
                torch.compile(QUANTIZE_VARIANTS[name], backend=capture.compile_only(compile_fx))(x, s, w)
            cases.append(_case(f"{rows}x{columns} {name}", cap))
    return cases


def _write_sources(directory: str, contestant: str, case: dict) -> None:
    """Each graph's wrapper and each Triton kernel's source, for reading what Inductor generated."""
    folder = os.path.join(directory, "_".join(f"{contestant} {case['case']}".replace(",", "").split()))
    os.makedirs(folder, exist_ok=True)
    for graph in case["_capture"].graphs:
        with open(os.path.join(folder, f"graph{graph.index}_{graph.kind}_wrapper.py"), "w") as f:
            f.write(graph.wrapper)
        for name, record in graph.kernels.items():
            with open(os.path.join(folder, f"graph{graph.index}_{name[:120]}.py"), "w") as f:
                f.write(record.source)


# Each kernel's compiled configs, found in or added to the facts of earlier compiles (bench.costmodel.cubins).
_FACTS = None


def _attach_cubins(case: dict) -> None:
    """Every autotuning config of every Triton kernel compiled for sm_90: registers, spills, access widths."""
    global _FACTS
    from . import cubins

    _FACTS = _FACTS or cubins.CubinFacts()
    by_name = {}
    for graph in case["_capture"].graphs:
        for name, record in graph.kernels.items():
            by_name[(f"{graph.index}:{graph.kind}", name)] = _FACTS.configs(name, record.source)
    for row in [*case["rows"], *case.get("reuse_rows", ()), *case.get("per_call_rows", ())]:
        if (row["graph"], row["name"]) in by_name:
            row["cubin"] = by_name[(row["graph"], row["name"])]


def versions() -> dict:
    import triton

    result = {"torch": torch.__version__, "triton": triton.__version__}
    for name in ("transformers", "torchao", "fp8graph"):
        module = sys.modules.get(name)
        if module is not None:
            result[name] = getattr(module, "__version__", "?")
    return result


WORKLOADS = {"decoder": decoder, "linear": linear, "quantize": quantize, "moe": moe}


def run(spec: dict) -> dict:
    """The child's whole job: ``spec`` in, a JSON-able result out."""
    started = time.time()
    fake_h100.install()
    root = os.environ.get("FP8GRAPH_COSTMODEL_ROOT")  # calibration's fp8graph of an earlier commit
    if root:
        import fp8graph

        if not os.path.realpath(fp8graph.__file__).startswith(os.path.realpath(root)):
            raise RuntimeError("fp8graph was not imported from the extracted commit")
    cases = WORKLOADS[spec["workload"]](spec)
    for case in cases:
        if spec.get("source"):
            _write_sources(spec["source"], spec.get("contestant", "inductor"), case)
        if spec.get("cubin"):
            _attach_cubins(case)
        del case["_capture"]
    result = {"contestant": spec.get("contestant", "inductor"), "cases": cases, "versions": versions(),
              "capture_s": time.time() - started}
    if spec.get("cubin"):  # what this process compiled that the facts file did not hold (the caller may add it)
        result["cubin_facts_new"] = dict(_FACTS.new) if _FACTS else {}
    return result
