"""Capture what Inductor generates for the fake H100: each graph's Triton kernels (source and bytes per
argument), its extern calls (cuBLAS GEMMs, cuDNN attention, custom ops) and its launch order.

    with capture.Capture() as cap:
        torch.compile(model, backend=capture.compile_only(compile_fx))(*fake_inputs)   # or fp8graph: workloads
    cap.graphs      # one GraphRecord per graph Inductor lowered (forward, backward, ...), in order

Hooks, all undone on exit:
  * ``TritonScheduling.define_kernel``: the bytes Inductor's own ``estimate_kernel_num_bytes`` counts for
    each kernel argument, split into read and written;
  * ``GraphLowering.codegen``: the wrapper's source, the extern kernels among the scheduler's nodes, and the
    bytes its buffers hold as the schedule runs (``peak_memory.graph_memory``);
  * ``AsyncCompile.triton`` / ``wait``: each kernel's final source is kept and a stub returned, so nothing is
    compiled or launched when the graph's module loads.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from . import peak_memory


@dataclasses.dataclass
class ArgBytes:
    arg: str  # the kernel's parameter (in_ptr0, out_ptr1, in_out_ptr0)
    buffer: str  # the graph buffer passed for it
    dtype: str
    numel: int  # elements Inductor counts: the whole buffer, or the slices the kernel touches
    read: int  # bytes
    written: int


@dataclasses.dataclass
class KernelRecord:
    name: str
    source: str = ""
    args: list[ArgBytes] | None = None


@dataclasses.dataclass
class ExternRecord:
    name: str  # the buffer it writes
    kernel: str  # extern_kernels.mm, extern_kernels._scaled_mm, torch.ops.fp8graph.transpose_fp8.default, ...
    inputs: list[tuple[tuple[int, ...], str]]  # (shape, dtype) of each tensor operand
    outputs: list[tuple[tuple[int, ...], str]]
    # Elements of each input in memory: fewer than its shape's when it is an expanded view (stride 0), e.g. an
    # index broadcast over a row for scatter_reduce; None where unknown (then the shape's count).
    input_elements: list[int | None] | None = None
    mutated: list[tuple[tuple[int, ...], str]] = dataclasses.field(default_factory=list)  # operands written in place
    # SDPA's is_causal (None for ops without one): a causal call skips the tiles above the diagonal, a call with an
    # explicit mask computes every tile.
    is_causal: bool | None = None


@dataclasses.dataclass
class GraphRecord:
    index: int
    is_backward: bool
    is_inference: bool
    wrapper: str = ""
    kernels: dict[str, KernelRecord] = dataclasses.field(default_factory=dict)
    externs: list[ExternRecord] = dataclasses.field(default_factory=list)
    order: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # ("triton"|"extern"|"memset", name)
    runs: int = 0  # calls in the captured step: a regional graph runs once per layer
    memory: "peak_memory.GraphMemory | None" = None

    @property
    def kind(self) -> str:
        return "backward" if self.is_backward else ("inference" if self.is_inference else "forward")


class _StubKernel:
    """What AsyncCompile.triton returns instead of a compiled kernel."""

    def __init__(self, name):
        self.name = name

    def run(self, *args, **kwargs):
        raise RuntimeError(f"{self.name}: captured for analysis only, cannot run")


def inductor_settings() -> list[tuple[object, str, object]]:
    """No caches (a cached graph skips the hooks), no compile subprocesses, per-kernel byte counts:
    ``(config module, name, value)``, set while a :class:`Capture` is active and restored after it."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return [(inductor_config, "compile_threads", 1),
            (inductor_config, "fx_graph_cache", False),
            (inductor_config, "fx_graph_remote_cache", False),
            (inductor_config, "autotune_local_cache", False),
            (inductor_config, "autotune_remote_cache", False),
            # kernel_num_gb in each kernel's metadata; the kernel is unchanged
            (inductor_config, "benchmark_kernel", True),
            # lower the backward now, not at its first call
            (functorch_config, "force_non_lazy_backward_lowering", True),
            (functorch_config, "enable_autograd_cache", False)]


def _hint(expr) -> int:
    from torch._inductor.virtualized import V

    return int(V.graph.sizevars.optimization_hint(expr))


def _kernel_arg_bytes(kernel) -> list[ArgBytes]:
    """``SIMDKernel.estimate_kernel_num_bytes`` (torch 2.13), argument by argument, reads apart from writes
    (an argument is written in place only when the signature passes it as ``in_out_ptr``)."""
    from torch._inductor.dependencies import StarDep, WeakDep
    from torch._inductor.utils import get_dtype_size, sympy_product
    from torch._inductor.virtualized import V

    result = []
    arg_defs, call_args, _, _ = kernel.args.python_argdefs()
    accesses = _accesses_by_storage(kernel.features.buf_accesses())
    out_numel = _hint(sympy_product(kernel.numels.values()))
    for arg_def, arg in zip(arg_defs, call_args):
        if arg not in accesses:
            continue
        numel = _hint(V.graph.get_numel(arg))
        if numel > out_numel:  # a kernel that reads slices of a larger buffer: one output's worth per index
            indices, stars = set(), 0
            for dep in accesses[arg]:
                if isinstance(dep, (StarDep, WeakDep)):
                    indices.add(f"star{stars}")
                    stars += 1
                else:
                    indices.add(dep.index)
            numel = len(indices) * out_numel
        dtype = V.graph.get_dtype(arg)
        nbytes = numel * get_dtype_size(dtype)
        # Inductor counts the first len(inplace_buffers) arguments as read and written, but that count includes
        # in-place buffers it removed from the signature, so an input could be counted as written: an argument is
        # in place when the kernel's signature says so.
        inplace = arg_def.name.startswith("in_out_ptr")
        is_input = inplace or arg in kernel.args.input_buffers
        is_output = inplace or arg in kernel.args.output_buffers
        result.append(ArgBytes(arg_def.name, arg, str(dtype).replace("torch.", ""), numel,
                               nbytes if is_input else 0, nbytes if is_output else 0))
    return result


def _accesses_by_storage(accesses: dict) -> dict:
    """A kernel's buffer accesses keyed by the buffer its arguments name. A write into a buffer that an earlier
    kernel made (a scatter into an ``empty``, an in-place fill) is recorded under the mutation's own name, while
    the signature passes the buffer it mutates: where the kernel names no access of that buffer itself, the
    mutations' loads and stores go to it (following chains of mutations), else such a kernel's stores would count
    no bytes."""
    from torch._inductor.dependencies import StarDep, WeakDep
    from torch._inductor.virtualized import V

    def storage(name: str) -> str:
        seen = set()
        while name not in seen:
            seen.add(name)
            buffer = V.graph.name_to_buffer.get(name)  # graph inputs and constants mutate nothing
            mutated = list(buffer.get_mutation_names()) if buffer is not None else []
            if len(mutated) != 1:
                return name
            name = mutated[0]
        return name

    merged = {name: list(deps) for name, deps in accesses.items()}
    for name, deps in accesses.items():
        root = storage(name)
        stores = [dep for dep in deps if not isinstance(dep, (StarDep, WeakDep))]  # not orderings after a mutation
        if root != name and root not in accesses and stores:
            merged.setdefault(root, []).extend(stores)
    return merged


def _kernel_bytes(kernel) -> list[ArgBytes]:
    """The bytes of each argument of a Triton kernel; a combo kernel (``combo_kernels=True``: independent
    kernels launched as one) counts each of its sub-kernels' arguments, named ``sub<i>.<arg>``."""
    sub_kernels = getattr(kernel, "sub_kernels", None)
    if sub_kernels is None:
        return _kernel_arg_bytes(kernel)
    return [dataclasses.replace(arg, arg=f"sub{i}.{arg.arg}")
            for i, sub_kernel in enumerate(sub_kernels) for arg in _kernel_arg_bytes(sub_kernel)]


def _shape(node) -> tuple[int, ...]:
    from torch._inductor.virtualized import V

    return tuple(int(V.graph.sizevars.optimization_hint(s)) for s in node.get_size())


def _extern_record(snode) -> ExternRecord:
    from torch._inductor import ir

    node = snode.node
    kernel = getattr(node, "python_kernel_name", None) or str(getattr(node, "op_overload", "") or type(node).__name__)
    inputs, elements, mutated_operands = [], [], []
    # An operand the op writes in place (fp8graph::transpose_fp8_into_'s destination, the delayed state's buffers)
    # is counted as written, not read: the ops that mutate overwrite them, bar a few bytes of history.
    mutated = {name for output in getattr(node, "mutation_outputs", None) or () for name in output.get_mutation_names()}
    for operand in getattr(node, "inputs", ()) or ():
        for leaf in (operand if isinstance(operand, (list, tuple)) else [operand]):
            if isinstance(leaf, ir.IRNode):
                try:
                    shape_and_dtype = (_shape(leaf), str(leaf.get_dtype()).replace("torch.", ""))
                except Exception:  # noqa: BLE001 - a layout without sizes (NoneLayout)
                    continue
                if _name_of(leaf) in mutated:
                    mutated_operands.append(shape_and_dtype)
                    continue
                inputs.append(shape_and_dtype)
                elements.append(_distinct_elements(leaf, inputs[-1][0]))
    # A single-output extern is its own output; a multi-output one (a custom op, SDPA) lists MultiOutputs.
    candidates = [node] if not isinstance(getattr(node, "layout", None), ir.MultiOutputLayout) else \
        [out for out in (getattr(node, "outputs", None) or []) if isinstance(out, ir.IRNode)]
    outputs = [(_shape(out), str(out.get_dtype()).replace("torch.", "")) for out in candidates
               if not isinstance(getattr(out, "layout", None), (ir.MultiOutputLayout, ir.NoneLayout))]
    return ExternRecord(node.get_name(), kernel, inputs, outputs, elements, mutated_operands, _is_causal(node))


def _is_causal(node) -> bool | None:
    """The ``is_causal`` argument an extern call was made with (cuDNN attention, forward and backward), None
    when its op has none."""
    schema = getattr(getattr(node, "op_overload", None), "_schema", None)
    names = [argument.name for argument in schema.arguments] if schema is not None else []
    if "is_causal" not in names or not hasattr(node, "unflatten_args"):
        return None
    args, kwargs = node.unflatten_args(node.inputs, node.constant_args)
    position = names.index("is_causal")
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    return bool(args[position] if position < len(args) else schema.arguments[position].default_value)


def _name_of(node) -> str | None:
    try:
        return node.get_name()
    except Exception:  # noqa: BLE001 - a view of no buffer of its own
        return None


def _distinct_elements(node, shape: tuple[int, ...]) -> int | None:
    """Elements ``node`` addresses in memory, at most its shape's count: a dimension of stride 0 (an expanded
    view) reads the same elements again, which an operand-bytes count must not multiply."""
    try:
        strides = [_hint(s) for s in node.get_stride()]
    except Exception:  # noqa: BLE001 - no fixed layout: the shape's count
        return None
    distinct = 1
    for size, stride in zip(shape, strides):
        if stride != 0:
            distinct *= size
    return distinct


def _input_bytes(graph_lowering) -> dict[str, int]:
    """Bytes of the storage each tensor input of the graph spans, by the name the wrapper gives it."""
    from torch._inductor import ir

    result = {}
    for name, value in graph_lowering.graph_inputs.items():
        if isinstance(value, ir.IRNode):
            result[name] = peak_memory.storage_bytes(_shape(value), [_hint(s) for s in value.get_stride()],
                                                     str(value.get_dtype()).replace("torch.", ""))
    return result


def _extern_output_bytes(record: GraphRecord) -> dict[str, list[int]]:
    """Bytes of each output of each extern call, by the buffer the wrapper assigns its result to (calls that write
    into a buffer allocated before them assign none and are not looked up)."""
    return {extern.name: [peak_memory.contiguous_bytes(shape, dtype) for shape, dtype in extern.outputs]
            for extern in record.externs if extern.outputs}


class Capture:
    active: "Capture | None" = None

    def __init__(self):
        self.graphs: list[GraphRecord] = []
        self._undo = []

    def _patch(self, owner, name, replacement):
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, original))
        return original

    def __enter__(self):
        from torch._inductor import async_compile, graph, ir, scheduler
        from torch._inductor.codegen import triton as triton_codegen

        for config, name, value in inductor_settings():
            self._patch(config, name, value)
        cap = self
        Capture.active = self

        def triton(self_, kernel_name, source_code, device_str="cuda"):
            record = cap.graphs[-1].kernels.setdefault(kernel_name, KernelRecord(kernel_name))
            record.source = source_code
            return _StubKernel(kernel_name)

        self._patch(async_compile.AsyncCompile, "triton", triton)
        self._patch(async_compile.AsyncCompile, "wait", lambda self_, scope: None)
        original_define = triton_codegen.TritonScheduling.define_kernel

        def define_kernel(self_, src_code, node_schedule, kernel):
            name = original_define(self_, src_code, node_schedule, kernel)
            record = cap.graphs[-1].kernels.setdefault(name, KernelRecord(name))
            if record.args is None:
                try:
                    record.args = _kernel_bytes(kernel)
                except Exception as error:  # a kernel without bytes would be free in the model: refuse
                    raise CaptureError(f"no byte breakdown for {name}: {error!r}") from error
            return name

        self._patch(triton_codegen.TritonScheduling, "define_kernel", define_kernel)
        original_codegen = graph.GraphLowering.codegen

        def codegen(self_, *args, **kwargs):
            record = GraphRecord(len(cap.graphs), bool(getattr(self_, "is_backward", False)),
                                 bool(getattr(self_, "is_inference", False)))
            cap.graphs.append(record)
            result = original_codegen(self_, *args, **kwargs)
            record.wrapper = getattr(result[0], "value", str(result[0]))
            for snode in self_.scheduler.nodes:
                if not isinstance(snode, scheduler.ExternKernelSchedulerNode) or isinstance(snode.node, ir.MultiOutput):
                    continue
                try:
                    record.externs.append(_extern_record(snode))
                except Exception as error:  # noqa: BLE001
                    print(f"capture: extern node {snode.get_name()} not recorded: {error!r}")
            record.order = _launch_order(record)
            _check_launches(record)
            try:
                record.memory = peak_memory.graph_memory(_call_body(record.wrapper), record.is_backward,
                                                         _input_bytes(self_), _extern_output_bytes(record))
            except ValueError as error:  # a graph without its bytes would hold no memory in the model: refuse
                raise CaptureError(f"graph {record.index} ({record.kind}): its wrapper's allocations could not be "
                                   f"replayed: {error}") from error
            return result

        self._patch(graph.GraphLowering, "codegen", codegen)
        return self

    def __exit__(self, *exc):
        Capture.active = None
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        return False


_LAUNCH = re.compile(r"^\s*(\w+)\.run\(")


def _call_body(wrapper: str) -> str:
    """The wrapper's ``call`` function (the graph's launches), kernel sources left out."""
    body = re.sub(r"async_compile\.triton\('(\w+)', '''.*?''', device_str='\w+'\)", r"<kernel \1>", wrapper,
                  flags=re.S)
    start = body.find("def call(self, args)")
    if start < 0:
        start = body.find("def call(args)")
    end = body.find("\nrunner = Runner", start)
    if end < 0:
        end = body.find("\ndef get_args", start)
    return body[start:end if end > 0 else None]


def _launch_order(record: GraphRecord) -> list[tuple[str, str]]:
    """One ("triton", kernel) per ``.run(`` line and one ("extern", buffer) per extern call, in wrapper order."""
    order = []
    externs = [e.name for e in record.externs if e.outputs]
    # An op that only mutates its arguments has no output buffer to find it by: its calls are matched to
    # its records in order ("torch.ops.fp8graph.record_delayed_.default([...], ...)").
    in_place = [e for e in record.externs if not e.outputs]
    for line in _call_body(record.wrapper).splitlines():
        launch = _LAUNCH.match(line)
        if launch:
            order.append(("triton", launch.group(1)))
        elif re.search(r"\.zero_\(\)|\.fill_\(", line):
            order.append(("memset", line.strip()))
        elif in_place and re.match(rf"^\s*{re.escape(in_place[0].kernel)}\(", line):
            order.append(("extern", in_place.pop(0).name))
        else:
            for name in externs:  # "extern_kernels.mm(..., out=buf3)" or "buf5 = torch.ops...(...)"
                if re.search(rf"(out={name}\b|^\s*{name} = (?!empty_strided)(?!reinterpret_tensor)\S+\()", line):
                    order.append(("extern", name))
                    break
    return order


class CaptureError(RuntimeError):
    """What Inductor generated could not be read as it was when this capture was written (a torch change)."""


def _check_launches(record: GraphRecord) -> None:
    """Every kernel the graph defines is launched, every launch is of a defined kernel, and every extern
    call was found in the wrapper: otherwise the wrapper's text changed and the counts would be wrong."""
    launched = {name for kind, name in record.order if kind == "triton"}
    defined = set(record.kernels)
    called = {name for kind, name in record.order if kind == "extern"}
    unlaunched, undefined = defined - launched, launched - defined
    uncalled = [e.name for e in record.externs if e.name not in called]
    if unlaunched or undefined or uncalled:
        raise CaptureError(
            f"graph {record.index} ({record.kind}): kernels defined but not launched {sorted(unlaunched)[:3]}, "
            f"launched but not defined {sorted(undefined)[:3]}, extern calls not found {uncalled[:3]}: the "
            "wrapper Inductor wrote no longer reads as capture._launch_order expects")


def lower_then_run_eagerly(lower, gm, example_inputs):
    """Lower ``gm`` with ``lower`` (its Inductor graphs are captured), and return a callable that runs ``gm``
    eagerly instead, on FakeTensors: shapes only. Each call counts one run of the graphs this lowering made
    (the backward graph is assumed to run once per forward)."""
    cap = Capture.active
    first = len(cap.graphs) if cap else 0
    lower(gm, example_inputs)  # may rewrite gm in place (fp8graph does): gm.forward is then the rewritten graph
    owned = cap.graphs[first:] if cap else []

    def run(*args):
        for graph in owned:
            graph.runs += 1
        return gm.forward(*args)

    return run


def compile_only(backend):
    """A Dynamo backend that lowers each graph with ``backend`` for its kernels, then runs it eagerly."""
    return lambda gm, example_inputs: lower_then_run_eagerly(backend, gm, example_inputs)
