"""Scattered stores of a generated Triton kernel: stores whose neighbouring threads write addresses more than
one element apart, and the DRAM traffic they add to the bytes Inductor counts.

A GPU moves memory in 32-byte sectors. Neighbouring threads that write neighbouring elements fill sectors
together (coalesced); in a pointwise kernel whose threads write a row apart, the other bytes of each sector
belong to other programs, and what the H200 measured fits a sector read and a sector written per element:
a cast kernel storing its FP8 bytes a row apart (an index_copy along columns, 0.54 G elements) ran 8.7 ms
(bench/results/moe-2026-11-27T050226Z.json) where its bytes at copy bandwidth take 0.3 ms, and 64 bytes an
element at 4 TB/s is 9 ms. A reduction's program loops over the whole reduced range, so the other bytes of a
sector it writes are its own, written while the sector is in L2: the H100 ran such a transposed store inside
a delayed cast's amax (fp8graph at 1fda4ce, bench/results/linear-2026-11-23T081002Z.json) at the model's time
without any such charge. Loads a row apart are not charged either: no measurement of one is kept, and a
sector read by one program stays in L2 for the next ones while they are near in time.

The address of each ``tl.store(ptr + (index), ...)`` of a pointwise kernel is evaluated, as Python, at
neighbouring values of each index that varies across a block's threads (``xindex``, ``yindex``; Triton lays a
2-D tile out along whichever is contiguous, so one unit stride is enough). Indirect values (``tmp`` variables:
an index loaded from memory) are held fixed between neighbours, which is what a row scatter is (each row
contiguous); an address that does not evaluate is counted as coalesced. Charged only where each element
takes a sector of its own (its neighbour at least 32 bytes away): stores a few elements apart (interleaved
halves, a stack) fill their sectors between them. Not analysed, so not charged: kernels of dynamic shapes
(their sizes are symbols) and combo kernels (several sub-kernels, each with its own indices, in one launch).
"""

from __future__ import annotations

import re
import statistics

SECTOR_BYTES = 32

_STORE = re.compile(r"tl\.store\((\w+) \+ \((.*?)\), ")
_DEFINITION = re.compile(r"^\s+(\w+) = (.+)$")
_NUMEL = re.compile(r"^\s+(\w+)numel = (\d+)$", re.M)
_THREAD_INDEX = {"x": "xindex", "y": "yindex"}
_SAMPLES = (1_000_003, 2_000_029, 3_000_017)  # away from 0, where a modulo makes every stride look like 1


class _Value(int):
    """An integer that ignores Triton's shape methods (``tl.full(...).broadcast_to(XBLOCK, 1)``)."""

    def broadcast_to(self, *shape):
        return self


class _TritonLanguage:
    int32 = int64 = int1 = None

    @staticmethod
    def full(shape, value, dtype=None):
        return _Value(value)

    @staticmethod
    def broadcast_to(value, shape):
        return value


def _definitions(body: str) -> dict[str, str]:
    """``name -> expression`` of the kernel's index variables (``x0 = (xindex % 2048)``, ``r0_1 = r0_index``)."""
    definitions = {}
    for line in body.splitlines():
        match = _DEFINITION.match(line)
        if match and re.fullmatch(r"[xyr]\w*\d+|[xyr]\w*index", match.group(1)) and "tl." not in match.group(2):
            definitions[match.group(1)] = match.group(2)
    return definitions


def _address(expression: str, definitions: dict[str, str], indices: dict[str, int]) -> int | None:
    namespace = {"tl": _TritonLanguage, "XBLOCK": 1, "YBLOCK": 1, "R0_BLOCK": 1, **indices}
    for name, definition in definitions.items():  # in order: each uses the thread indices or earlier names
        try:
            namespace[name] = eval(definition, {}, namespace)  # noqa: S307 - Inductor's generated index arithmetic
        except Exception:  # noqa: BLE001 - a definition that is not index arithmetic
            continue
    try:
        return int(eval(expression, {}, _Indirect(namespace)))  # noqa: S307
    except Exception:  # noqa: BLE001
        return None


class _Indirect(dict):
    """Names not defined (``tmp4``: a value the kernel loaded) are held at one value."""

    def __missing__(self, key):
        if key.startswith("tmp"):
            return _Value(7)
        raise KeyError(key)


def _stride(expression: str, definitions: dict[str, str], index: str, others: tuple[str, ...]) -> int | None:
    strides = []
    for sample in _SAMPLES:
        fixed = {other: 5 for other in others}
        here = _address(expression, definitions, {**fixed, index: sample})
        there = _address(expression, definitions, {**fixed, index: sample + 1})
        if here is None or there is None:
            return None
        strides.append(abs(there - here))
    return int(statistics.median(strides))


def scattered_stores(source: str, itemsize: dict[str, int] | None = None) -> list[tuple[str, int]]:
    """``(pointer, element stride)`` of each store of the pointwise kernel in ``source`` that no thread index
    reaches with a unit (or zero) stride, each element a sector of its own at ``itemsize`` bytes; none for a
    reduction or a combo kernel (see the module's doc)."""
    body = source.split("@triton.jit", 1)[-1].split("\ndef get_args", 1)[0]
    sizes = [prefix for prefix, _ in _NUMEL.findall(body)]
    if re.search(r"\br0_index\b|\br0_numel\b", body) or len(sizes) != len(set(sizes)):
        return []  # a reduction; or a combo kernel, whose sub-kernels each define their own sizes
    threads = tuple(index for prefix, index in _THREAD_INDEX.items() if re.search(rf"\b{index}\b", body))
    if not threads:
        return []
    definitions = _definitions(body)
    scattered = []
    for line in body.splitlines():
        for pointer, expression in _STORE.findall(line.strip()):
            if not any(name in expression for name in definitions):
                continue  # a scalar or an address the kernel's indices do not reach: the same for every thread
            strides = [_stride(expression, definitions, index, tuple(i for i in threads if i != index))
                       for index in threads]
            size = (itemsize or {}).get(pointer, 1)
            if any(stride is None or stride * size < SECTOR_BYTES for stride in strides):
                continue
            scattered.append((pointer, min(strides)))
    return scattered


def elements_per_launch(source: str) -> int:
    """Elements a launch iterates over: the product of the kernel's ``xnumel``, ``ynumel`` and ``r0_numel``."""
    total = 1
    for _, value in _NUMEL.findall(source.split("\ndef get_args", 1)[0]):
        total *= int(value)
    return total


def scattered_bytes(source: str, itemsize: dict[str, int]) -> int:
    """DRAM bytes a launch moves beyond Inductor's count for its scattered stores: per element, a sector read
    and written, less the element's own bytes (already counted). ``itemsize``: each pointer argument's element
    size in bytes."""
    elements = elements_per_launch(source)
    extra = 0
    for pointer, _ in scattered_stores(source, itemsize):
        extra += elements * (2 * SECTOR_BYTES - itemsize.get(pointer, 4))
    return extra
