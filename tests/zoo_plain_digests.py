"""Plain ``torch.compile``'s outputs in the zoo's keep-all check, kept by digest (``tests/test_zoo.py``).

The keep-all check (``fp8graph.models.zoo``) holds fp8graph keeping every site bit for bit equal to plain
``torch.compile``. Plain torch.compile's outputs are a function of the family's tiny config and inputs
(models/zoo.py), torch, transformers and the CPU kernels ATen picks (its instruction set, vendor and AMX,
the thread count): nothing of fp8graph. So their digest (``outputs_digest``) is kept in
``zoo_plain_digests.json`` under a hash of all of those; while it holds, the test compiles fp8graph's side only
and compares digests, and any other digest compiles plain torch.compile again and names what differs. Written
only with ``FP8GRAPH_KEEP_CAPTURES=1`` (``scripts/keep-captures tests/test_zoo.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform

import torch

from bench.costmodel.captures import KEEP, rewrite_locked
from fp8graph.models import zoo

PATH = pathlib.Path(__file__).with_name("zoo_plain_digests.json")


@functools.cache
def _cpu_vendor() -> str:
    """The CPU's vendor (``GenuineIntel``, ``AuthenticAMD``), else what ``platform`` says of the processor."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux, or not readable
        lines = []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")),
                platform.processor() or platform.machine())


def _environment() -> dict:
    # The CPU as far as it decides which ATen kernels run: the instruction set torch reports, the vendor (MKL's
    # and oneDNN's fp32 GEMMs round otherwise on an Intel CPU than on an AMD one at the same ATen capability,
    # AVX512) and AMX (oneDNN's BF16 GEMMs use its tiles). A key that tells too little apart costs time only:
    # a digest that does not match compiles plain torch.compile again.
    return {"torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
            "zoo": hashlib.sha256(pathlib.Path(zoo.__file__).read_bytes()).hexdigest(),
            "cpu": torch.backends.cpu.get_cpu_capability(), "vendor": _cpu_vendor(),
            "amx": getattr(torch.cpu, "_is_amx_tile_supported", lambda: None)(), "threads": torch.get_num_threads()}


def _key(family: str, dtype: torch.dtype, batch: int, sequence: int) -> str:
    case = {"family": family, "dtype": str(dtype), "batch": batch, "sequence": sequence, **_environment()}
    return hashlib.sha256(json.dumps(case, sort_keys=True).encode()).hexdigest()


def kept_digest(family: str, dtype: torch.dtype, batch: int = 2, sequence: int = 8) -> str | None:
    """The digest plain torch.compile's outputs had in this environment, if one is kept."""
    return (json.loads(PATH.read_text()) if PATH.exists() else {}).get(_key(family, dtype, batch, sequence))


def keep(family: str, dtype: torch.dtype, digest: str | None, batch: int = 2, sequence: int = 8) -> None:
    """Add ``digest`` (plain torch.compile's, when it ran) to the file, only with FP8GRAPH_KEEP_CAPTURES=1 (the
    two test workers may write at once: ``rewrite_locked``)."""
    if digest is None or os.environ.get(KEEP) != "1":
        return
    key = _key(family, dtype, batch, sequence)
    rewrite_locked(PATH, lambda text: json.dumps({**json.loads(text or "{}"), key: digest}, indent=0,
                                                 sort_keys=True) + "\n")
