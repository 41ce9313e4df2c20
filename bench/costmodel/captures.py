"""Modelled steps' captures, kept under everything they were made from.

A child's capture (``bench.costmodel.child``: a workload compiled for the fake H100, its kernels read) is a
function of its spec, the Python sources it imported from this repository or from an extracted commit
(``bench model calibrate`` models fp8graph at the commit the H100 ran, ``calibration.MEASURED_COMMIT``), the
C++ shim that fakes the H100, and the installed torch, triton, transformers and torchao: Inductor's kernels
are generated for sm_90 whatever machine runs them, and nothing in a capture was timed. Capturing is minutes
of tracing and code generation, almost all of the time of the calibration and of the tests that pin the
generated step (tests/bench: the calibration, the step structure, the MoE block); the arithmetic and the
checks on what a capture holds always run.

:class:`CapturedResults` keeps each result in ``captures.json`` under a hash of its spec, with the hash of
every source file the child had imported (:func:`imported_sources`, recorded by the child) and the versions.
A result is served only when every one of those files hashes as it did and the versions are the installed
ones; anything else is a miss, captured as before. ``python -m bench model calibrate`` writes what it
captured; the tests read through :func:`kept`, which writes only when ``FP8GRAPH_KEEP_CAPTURES=1``
(``scripts/keep-captures``: after a change to fp8graph or the benchmarks, before committing).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable

CAPTURES_PATH = Path(__file__).with_name("captures.json")
KEEP = "FP8GRAPH_KEEP_CAPTURES"  # "1": the tests' misses are written to CAPTURES_PATH (kept)
REPOSITORY = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).with_name("fake_cuda_guard.cpp")
MEASURED_ROOT = "FP8GRAPH_COSTMODEL_ROOT"  # the extracted commit's folder (calibration.measured_fp8graph)
SOURCES_WANTED = "FP8GRAPH_COSTMODEL_SOURCES"  # set in a child's environment: its results name their sources
_DISTRIBUTIONS = ("torch", "triton", "transformers", "torchao")

Runner = Callable[[list[dict], "dict | None"], list[dict]]


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _roots(env: dict | None) -> dict[str, Path]:
    """Where each label's files lie: ``repo`` this checkout, ``measured`` the extracted commit (if any)."""
    roots = {"repo": REPOSITORY}
    measured = (env or {}).get(MEASURED_ROOT)
    if measured:
        roots["measured"] = Path(measured).resolve()
    return roots


def imported_sources(env: dict | None = None, since: float | None = None) -> dict[str, str] | None:
    """``{"repo:bench/costmodel/capture.py": sha256, "measured:fp8graph/api.py": ..., "repo:...cpp": ...}``:
    every module this process imported from the repository or the extracted commit, and the shim. Called in
    the child after its specs ran: the modules of earlier specs in the same process count too (a superset).
    ``None`` if one of them was written after ``since`` (the child's start): what is on disk may not be what
    ran."""
    roots = _roots(env if env is not None else dict(os.environ))
    installed = Path(sys.prefix).resolve()  # a virtual environment inside the repository: versions cover it
    sources = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        if path.is_relative_to(installed) or not path.is_file():  # (torch.ops' namespaces name no real file)
            continue
        for label, root in sorted(roots.items(), key=lambda item: -len(str(item[1]))):  # the extracted root
            if path.is_relative_to(root):                                               # may lie in the repo's
                sources[f"{label}:{path.relative_to(root).as_posix()}"] = path
                break
    sources[f"repo:{SHIM.relative_to(REPOSITORY).as_posix()}"] = SHIM
    if since is not None and any(path.stat().st_mtime > since for path in sources.values()):
        return None
    return {source: _sha256(path) for source, path in sources.items()}


def installed_versions() -> dict[str, str | None]:
    """Python and the distributions whose code generates or shapes the kernels."""
    versions = {"python": platform.python_version()}
    for name in _DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _holds(entry: dict, roots: dict[str, Path], unknown_ok: bool = False) -> bool:
    """Whether ``entry`` was made from the installed versions and from the files under ``roots`` as they are;
    a source under a root not given fails, or is not checked with ``unknown_ok``."""
    if entry["versions"] != installed_versions():
        return False
    for source, digest in entry["sources"].items():
        label, relative = source.split(":", 1)
        if label not in roots:
            if unknown_ok:
                continue
            return False
        if _sha256(roots[label] / relative) != digest:
            return False
    return True


def spec_key(spec: dict, env: dict | None) -> str:
    """The spec, and whether fp8graph comes from the extracted commit (its files are hashed by content, so the
    folder it was extracted to does not matter)."""
    measured = bool((env or {}).get(MEASURED_ROOT))
    return hashlib.sha256(json.dumps({"spec": spec, "measured": measured}, sort_keys=True).encode()).hexdigest()


class CapturedResults:
    """The kept captures (``{key: {"sources", "versions", "result"}}``) and those captured in this process."""

    def __init__(self, path: Path = CAPTURES_PATH):
        self.path = Path(path)
        self.kept: dict[str, dict] = json.loads(self.path.read_text())["captures"] if self.path.exists() else {}
        self.new: dict[str, dict] = {}

    def lookup(self, spec: dict, env: dict | None) -> dict | None:
        """The kept result of ``spec``, if everything it was made from is as it was; else ``None``."""
        entry = self.kept.get(spec_key(spec, env))
        return entry["result"] if entry is not None and _holds(entry, _roots(env)) else None

    def add(self, spec: dict, env: dict | None, result: dict) -> None:
        """Keep a child's result (its ``sources`` taken out of it); an error or a result without sources is
        never kept."""
        sources = result.pop("sources", None)
        if "error" in result or not sources:
            return
        self.new[spec_key(spec, env)] = {"sources": sources, "versions": installed_versions(), "result": result}

    def write(self) -> int:
        """Merge the new captures into the file (a line each); returns how many were written. Two processes
        may write at once (the tests' workers): the file is read again under a lock on its folder and
        replaced whole, so neither's captures are lost."""
        if not self.new:
            return 0

        def merged(on_disk: str | None) -> str:
            kept = json.loads(on_disk)["captures"] if on_disk else {}
            # What this checkout's sources or versions no longer make goes (an extracted commit's are fixed).
            repository = {"repo": REPOSITORY}
            self.kept = {key: entry for key, entry in kept.items() if _holds(entry, repository, unknown_ok=True)}
            self.kept.update(self.new)
            lines = [f"{json.dumps(key)}: {json.dumps(entry, sort_keys=True)}"
                     for key, entry in sorted(self.kept.items())]
            return '{"captures": {\n' + ",\n".join(lines) + "\n}}\n"

        rewrite_locked(self.path, merged)
        written, self.new = len(self.new), {}
        return written


def rewrite_locked(path: Path, rewritten: Callable[[str | None], str]) -> None:
    """Replace ``path`` with ``rewritten(its text, or None)`` under a lock on its folder: two processes writing
    at once (the tests' workers) each read what the other wrote, and no reader sees half a file."""
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        text = rewritten(path.read_text() if path.exists() else None)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(text)
        partial.replace(path)
    finally:
        os.close(folder)  # releases the lock


def cached(run: Runner, captures: CapturedResults) -> Runner:
    """``run`` serving what ``captures`` holds and running the rest (whose results it adds to ``captures``)."""
    def run_cached(specs: list[dict], env: dict | None = None) -> list[dict]:
        results = [captures.lookup(spec, env) for spec in specs]
        missed = [index for index, result in enumerate(results) if result is None]
        wanted = {**(env or {}), SOURCES_WANTED: "1"}
        for index, result in zip(missed, run([specs[index] for index in missed], wanted) if missed else []):
            captures.add(specs[index], env, result)
            results[index] = result
        return [json.loads(json.dumps(result)) for result in results]  # callers annotate the results in place
    return run_cached


def kept(run: Runner, path: Path = CAPTURES_PATH) -> Runner:
    """``run`` serving the captures kept in ``path``; what it had to capture is added to the file only when
    ``FP8GRAPH_KEEP_CAPTURES=1`` (a test run never rewrites a tracked file unasked)."""
    captures = CapturedResults(path)
    serve = cached(run, captures)

    def run_kept(specs: list[dict], env: dict | None = None) -> list[dict]:
        results = serve(specs, env)
        if os.environ.get(KEEP) == "1":
            captures.write()
        return results
    return run_kept
