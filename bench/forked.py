"""The benchmarks' child processes: forks of a server that has imported torch, transformers and fp8graph, or,
where torch sees a CUDA device, spawned interpreters.

Each contestant of ``bench decoder`` and ``bench moe``, and each compile-time measurement, runs in a process
of its own: its own CUDA context and peak memory, nothing compiled or cached in memory by another. A fresh
interpreter would first spend 8-11 s of CPU importing torch, Dynamo, Inductor, transformers and fp8graph;
``multiprocessing``'s forkserver imports them once (:data:`PRELOAD`) and forks
each child from it, a process that has compiled and allocated nothing. Environment variables read at
import (``OMP_NUM_THREADS``, ``TORCH_LOGS``, ...) are the parent's, as they would be for a fresh child.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import runpy
import sys
import tempfile
import traceback

PRELOAD = ["torch", "torch._dynamo", "torch._inductor.compile_fx", "transformers",
           "transformers.models.llama.modeling_llama", "fp8graph", "fp8graph.models"]


def context() -> multiprocessing.context.BaseContext:
    """The children's start method: forks of the preloaded server on a machine without CUDA, spawned
    interpreters on one with it (see the module's doc)."""
    import torch

    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)
    return forkserver


def _bench_main(argv: list[str], output_path: str) -> None:
    """In the child: ``python -m bench ARGV`` with stdout and stderr into ``output_path``; exits with its code."""
    with open(output_path, "wb") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    code = 0
    sys.argv = ["python -m bench", *argv]
    try:
        # By the module's name, as `python -m bench` runs it: the command table imports the workloads, which
        # import this module, so an import of it from here would close a cycle.
        runpy.run_module("bench", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as an interpreter would: its traceback and code 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_bench(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """``python -m bench ARGV`` in a forked child: its exit code (``None`` if it outlived ``timeout``, and was
    killed) and its output."""
    with tempfile.TemporaryDirectory(prefix="bench-child-") as scratch:
        output_path = os.path.join(scratch, "output")
        child = context().Process(target=_bench_main, args=(list(argv), output_path))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            code = None
        else:
            code = child.exitcode
        with open(output_path, errors="replace") if os.path.exists(output_path) else open(os.devnull) as output:
            return code, output.read()


def row_in_child(contestant: str, argv: list[str], timeout: float) -> dict:
    """``python -m bench ARGV --row-file FILE`` in a forked child (a ``--one`` run of one contestant): the row
    it wrote, or, where it crashed, exited without one or outlived ``timeout``, an error row with the end of
    its output, so that the other contestants go on."""
    with tempfile.TemporaryDirectory(prefix="bench-row-") as scratch:
        row_file = pathlib.Path(scratch) / "row.json"
        code, output = run_bench([*argv, "--row-file", str(row_file)], timeout)
        if code is None:
            return {"contestant": contestant, "error": f"timed out after {timeout} s; last output: {output[-2000:]}"}
        if code != 0 or not row_file.exists():
            return {"contestant": contestant, "error": f"exited with code {code}: {output[-2000:]}"}
        return json.loads(row_file.read_text())
