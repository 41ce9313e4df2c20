"""Child processes for the tests, forked from a server that has already imported torch, transformers and fp8graph
(spawned where torch sees a CUDA device: :func:`context`).

A fresh ``python`` spends 8-10 s of CPU importing torch, Dynamo, Inductor, transformers and fp8graph before it
does anything (measured on the 2-core CI machine, 2026-11-26), and the suite starts dozens: gloo ranks, the
docs pages, the command-line smoke runs. ``multiprocessing``'s forkserver imports ``PRELOAD`` once per pytest
worker; each child is then a fork of that server: a process of its own, with nothing compiled, nothing cached
in memory and no state of the test that started it, as a fresh interpreter would be, less the imports.

What differs from ``subprocess.run([sys.executable, ...])``, and why the tests may ignore it: the preloaded
modules read their environment variables when the server imported them, so ``run_python`` refuses an ``env``
that changes one of those (``IMPORT_TIME_VARIABLES``) rather than silently running without it; a command that
needs one runs as a real subprocess.
"""

from __future__ import annotations

import atexit
import functools
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile

from bench import forked as bench_forked

# What every child imports anyway; each costs seconds (torch._dynamo alone about 3 s): what the benchmarks'
# children preload, torch.distributed for the gloo ranks, and Inductor's CPU probe (inductor_cpu_isa); last, the
# collector tuned for the children as for the workers, every import before it frozen (garbage_collection).
PRELOAD = [*bench_forked.PRELOAD, "torch.distributed", "inductor_cpu_isa", "garbage_collection"]
# Read once, when the server imports torch, triton or Inductor's config: a child cannot change them.
IMPORT_TIME_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                         "DNNL_MAX_CPU_ISA", "TRITON_INTERPRET", "TORCHINDUCTOR_VEC_ISA_OK", "TORCH_LOGS",
                         "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "PYTHONHASHSEED")

_context = None


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, whose server starts, and imports ``PRELOAD``, on the first child; where torch sees
    a CUDA device, the spawn context: importing transformers (torchao through it) asks CUDA for its device count,
    and a child forked after that cannot initialise CUDA ("Cannot re-initialize CUDA in forked subprocess": the
    docs pages' GPU blocks failed so on an H200, 2026-11-27), as ``bench.forked`` found for the benchmarks."""
    global _context
    if _context is None:
        import torch

        if torch.cuda.is_available():
            _context = multiprocessing.get_context("spawn")
        else:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
            _start_server()
    return _context


def _start_server() -> None:
    """Start the forkserver with the tests' folder on its interpreter's path, through ``PYTHONPATH`` while it
    starts: Python 3.11's server does not take the parent's ``sys.path`` (3.12's does), and skips a preloaded
    module it cannot import without a word, so the tests' own modules of ``PRELOAD`` were never loaded there. A
    server another module started first keeps its own preloads."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *filter(None, [before])])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def apply_environment(env: dict[str, str]) -> None:
    """In a child: the environment a fresh process started by the parent would have had."""
    os.environ.clear()
    os.environ.update(env)


@functools.cache
def _interpreter_path() -> tuple[str, ...]:
    """``sys.path`` of a fresh interpreter, less its first entry (the script's folder or the working
    directory): a child must not import what only the tests' path holds (the tests folders pytest adds)."""
    listed = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                            check=True, capture_output=True, text=True)
    return tuple(json.loads(listed.stdout))


def _run_argv(argv: list[str], env: dict[str, str], cwd: str, stdout_path: str, stderr_path: str,
              interpreter_path: tuple[str, ...]) -> None:
    apply_environment(env)
    os.chdir(cwd)
    sys.path[:] = list(interpreter_path)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        with open(path, "wb") as target:
            os.dup2(target.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as PYTHONUNBUFFERED asks
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    code = 0
    try:
        if argv[0] in ("-m", "-c"):  # what the interpreter puts first: the working directory
            sys.path.insert(0, cwd)
            sys.argv = [argv[1] if argv[0] == "-m" else "-c", *argv[2:]]
        else:  # a script: its folder
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            sys.argv = list(argv)
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as an interpreter would, with its traceback and code 1
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what an interpreter runs at exit; multiprocessing's children skip it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_python(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
               timeout: float | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`` in a forked child:
    ``argv`` is ``["-m", module, ...]``, ``["-c", code, ...]`` or ``[script, ...]``."""
    env = dict(os.environ if env is None else env)
    changed = [name for name in IMPORT_TIME_VARIABLES if env.get(name) != os.environ.get(name)]
    if changed:
        raise ValueError(f"{changed} are read when the server imports torch; run this child as a real subprocess")
    with tempfile.TemporaryDirectory(prefix="forked-") as scratch:
        stdout_path, stderr_path = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        child = context().Process(target=_run_argv,
                                  args=(list(argv), env, os.fspath(cwd or os.getcwd()), stdout_path, stderr_path,
                                        _interpreter_path()))
        child.start()
        child.join(timeout)
        timed_out = child.exitcode is None
        if timed_out:
            child.kill()
            child.join()
        outputs = []
        for path in (stdout_path, stderr_path):
            with open(path, errors="replace") if os.path.exists(path) else open(os.devnull) as stream:
                outputs.append(stream.read())
    if timed_out:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=outputs[0], stderr=outputs[1])
    completed = subprocess.CompletedProcess([sys.executable, *argv], child.exitcode, *outputs)
    if check:
        completed.check_returncode()
    return completed
