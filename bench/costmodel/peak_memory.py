"""A modelled step's peak memory and the memory its forward saves for the backward, from the allocations of the
wrappers Inductor generated for the GPU.

Each captured graph's wrapper is what runs: :func:`graph_memory` replays its ``call`` line by line, bytes only.
``empty_strided_cuda`` allocates (the bytes its sizes and strides span), a custom op or ATen fallback that
returns new tensors allocates its outputs (``capture.ExternRecord``), ``reinterpret_tensor``, ``x[i]`` and
``a = b`` name an existing allocation (Inductor's buffer reuse among them), and an allocation is freed when no
name refers to it any more (``del``, or the end of ``call`` for all but what it returns). The inputs a graph
owns count from the start until their last ``del``: a backward's activations, which AOTAutograd clears from
the autograd context before the compiled backward runs. Parameters and the forward's inputs (``primals_*``)
and the incoming gradients (``tangents_*``) belong to the caller.

:func:`call_memory` chains the graphs one micro-batch runs, forwards in order then backwards in reverse, on top
of what lives outside them (:func:`persistent_bytes`: parameters, buffers, the step's inputs); :func:`step_memory`
composes micro-batches: from the second on, the first's gradients are held while the next backward makes its
own (autograd adds them afterwards). Not modelled: the caching allocator's rounding and fragmentation,
cuBLAS's workspace, temporaries that custom ops allocate and free inside themselves, and a gradient of an
activation between two graphs' backwards, counted as held to the step's end.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

from bench.costmodel.costs import DTYPE_BYTES

# Inputs of a backward that stay alive after it: the parameters (and any input of the forward) and the incoming
# gradients. Every other input is an activation the forward saved.
_KEPT_INPUT_PREFIXES = ("primals_", "tangents_")
_ASSIGN = re.compile(r"^(\w+) = (.+)$")
_EMPTY = re.compile(r"^empty_strided(?:_cuda)?\((\(.*?\)), (\(.*?\)), torch\.(\w+)")
_UNPACKED = re.compile(r"^\(?\s*\w+\s*(?:,\s*\w+\s*)+,?\s*\)?\s*= (?!args$)")
_ALIAS = re.compile(r"^(?:reinterpret_tensor\(|copy_if_misaligned\()?(\w+)(?:\[(\d+)\])?(?:\)|,.*\))?$")


@dataclasses.dataclass
class GraphMemory:
    """Bytes of one graph's allocations as its wrapper runs (see the module's doc)."""
    peak: int  # most bytes its allocations and owned inputs hold at once
    end: int  # what they still hold when it returns: its outputs (an owned input it returns among them)
    owned: int  # its inputs that die inside it (a backward's saved activations)
    tangents: int = 0  # its incoming gradients (a backward's ``tangents_*``)


def storage_bytes(sizes, strides, dtype: str) -> int:
    """Bytes a tensor of ``sizes`` and ``strides`` spans (an empty one none)."""
    if any(size == 0 for size in sizes):
        return 0
    return (1 + sum((size - 1) * abs(stride) for size, stride in zip(sizes, strides))) * _item_bytes(dtype)


def contiguous_bytes(sizes, dtype: str) -> int:
    """Bytes of a contiguous tensor of ``sizes``."""
    return math.prod(sizes) * _item_bytes(dtype)


def _item_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"no element size for dtype {dtype}")
    return DTYPE_BYTES[dtype]


def graph_memory(call_body: str, is_backward: bool, input_bytes: dict[str, int],
                 extern_outputs: dict[str, list[int]]) -> GraphMemory:
    """Replay the wrapper's ``call_body`` (``capture._call_body``): ``input_bytes`` are the graph's inputs'
    storages, ``extern_outputs`` the bytes of each output of each extern call that returns new tensors, by the
    name the wrapper assigns it. Raises ``ValueError`` on an assignment to a buffer it cannot read."""
    owned = {name: nbytes for name, nbytes in input_bytes.items()
             if is_backward and not name.startswith(_KEPT_INPUT_PREFIXES)}
    sizes: dict[int, int] = {}  # allocation -> bytes, while it lives
    names: dict[str, list[int]] = {}  # name -> the allocations it refers to (a tuple: one per element)
    serial = itertools.count()
    for name, nbytes in owned.items():
        names[name] = [next(serial)]
        sizes[names[name][0]] = nbytes
    live = peak = sum(owned.values())

    def allocate(name: str, each: list[int]) -> None:
        nonlocal live, peak
        refs = []
        for nbytes in each:
            refs.append(next(serial))
            sizes[refs[-1]] = nbytes
            live += nbytes
        rebind(name, refs)
        peak = max(peak, live)

    def rebind(name: str, refs: list[int]) -> None:
        before = names.pop(name, [])
        if refs:
            names[name] = refs
        release(before)

    def release(refs: list[int]) -> None:
        nonlocal live
        held = {ref for other in names.values() for ref in other}
        for ref in set(refs) - held:
            live -= sizes.pop(ref, 0)

    returned = None
    statements = (part.split("  #")[0].strip() for line in call_body.splitlines() for part in line.split(";"))
    for statement in statements:
        if statement.startswith("del "):
            for name in statement[4:].split(","):
                rebind(name.strip(), [])
        elif statement.startswith("return "):  # call's own: what follows it is the wrapper's other methods
            returned = re.findall(r"\b\w+\b", statement[len("return "):])
            break
        elif match := _ASSIGN.match(statement):
            _assign(match.group(1), match.group(2), names, extern_outputs, allocate, rebind)
        elif _UNPACKED.match(statement):  # a partition's outputs (CUDA graphs): allocated out of sight
            raise ValueError(f"{statement[:120]}: buffers unpacked from a call, allocated where the replay cannot "
                             "see")
    if returned is None:
        raise ValueError("call returns nothing it allocated: its return statement was not found")
    end = sum(sizes.get(ref, 0) for ref in {ref for name in returned for ref in names.get(name, [])})
    tangents = sum(nbytes for name, nbytes in input_bytes.items() if is_backward and name.startswith("tangents_"))
    return GraphMemory(peak=peak, end=end, owned=sum(owned.values()), tangents=tangents)


def _assign(target, value, names, extern_outputs, allocate, rebind) -> None:
    if empty := _EMPTY.match(value):
        sizes, strides = (_ints(text) for text in empty.groups()[:2])
        allocate(target, [storage_bytes(sizes, strides, empty.group(3))])
    elif target in extern_outputs:
        allocate(target, extern_outputs[target])
    elif alias := _ALIAS.match(value):  # of an allocation here, or of the caller's memory (a parameter's view)
        refs = names.get(alias.group(1), [])
        index = alias.group(2)
        rebind(target, list(refs) if index is None else refs[int(index):int(index) + 1])
    elif target.startswith("buf"):
        raise ValueError(f"{target} = {value[:120]}: not an allocation, an alias or a recorded extern call")


def _ints(text: str) -> tuple[int, ...]:
    values = [part.strip() for part in text.strip("()").split(",") if part.strip()]
    if not all(re.fullmatch(r"\d+", value) for value in values):
        raise ValueError(f"sizes {text} are not all integers (a dynamic shape)")
    return tuple(int(value) for value in values)


def persistent_bytes(module, *tensors) -> int:
    """Bytes of the distinct storages of ``module``'s parameters and buffers (fp8graph's state and kept weight
    copies are buffers) and of ``tensors``: what lives through the whole step."""
    storages = {}
    for tensor in [*module.parameters(), *module.buffers(), *tensors]:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage._cdata)] = storage.nbytes()
    return sum(storages.values())


def call_memory(graphs: list[tuple[str, int, GraphMemory]]) -> dict:
    """One micro-batch's forwards and backwards, ``(kind, runs, memory)`` in capture order (a graph's
    backward is captured after its forward): ``peak`` above what lived before the call, ``grads`` (what its
    backwards leave: the gradients) and ``saved`` (the activations its backwards receive), in bytes. The first
    backward to run takes its gradients from outside the call, counted while it runs (so
    :func:`persistent_bytes` leaves a ``grad_output`` out); each later one takes the gradient of an activation
    that an earlier backward returned, freed once it has run."""
    live = peak = saved = 0
    forwards = [(runs, m) for kind, runs, m in graphs if kind != "backward"]
    backwards = [(runs, m) for kind, runs, m in graphs if kind == "backward"]
    for runs, m in forwards:
        for _ in range(runs):
            peak = max(peak, live + m.peak)
            live += m.end
    after_forwards = live
    first = True
    for runs, m in reversed(backwards):
        for _ in range(runs):
            # The first backward's gradients come from outside (the user's, or zeros AOTAutograd makes for an
            # output the loss does not use) and live while it runs; a later one's are an earlier one's output.
            peak = max(peak, live + (m.tangents if first else 0) - m.owned + m.peak)
            live += m.end - m.owned - (0 if first else m.tangents)
            saved += m.owned
            first = False
    return {"peak": peak, "grads": live - (after_forwards - saved), "saved": saved}


def step_memory(persistent: int, calls: dict[str, dict], micro_batches: int) -> dict:
    """A step of ``micro_batches`` micro-batches, from :func:`call_memory` of each call bench's step runs
    (``first``; ``reuse`` where later micro-batches read the first's kept weight casts; ``per call`` where a step
    of one casts per call): ``peak_bytes`` and ``saved_bytes`` (the most one micro-batch saves)."""
    if micro_batches == 1:
        one = calls.get("per call", calls["first"])
        return {"peak_bytes": persistent + one["peak"], "saved_bytes": one["saved"]}
    first, later = calls["first"], calls.get("reuse", calls["first"])
    peak = max(first["peak"], first["grads"] + later["peak"])
    return {"peak_bytes": persistent + peak, "saved_bytes": max(first["saved"], later["saved"])}
