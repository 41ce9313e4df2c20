"""``python -m bench.costmodel.child SPEC RESULT``: one contestant of one workload, in a process of its own.

Reads the JSON spec, runs :func:`bench.costmodel.workloads.run` and writes its JSON result; an exception
becomes ``{"error": ...}`` so that one contestant's failure is a row of the table, never a lost run. A list
of specs runs them one after another, Dynamo reset between them, and writes the list of their results.
With ``FP8GRAPH_COSTMODEL_SOURCES`` set, each result also names every source file the process imported, with
its hash (``bench.costmodel.captures``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from .captures import SOURCES_WANTED, imported_sources


def main(spec_file: str, result_file: str) -> None:
    root = os.environ.get("FP8GRAPH_COSTMODEL_ROOT")  # calibration: fp8graph at the commit the H100 ran
    if root:
        sys.path.insert(0, root)
    started = time.time()
    with open(spec_file) as f:
        specs = json.load(f)
    # A list of specs runs one after another in this process (bench.model.run_children), each result its own.
    results = [_run(spec) for spec in specs] if isinstance(specs, list) else _run(specs)
    if os.environ.get(SOURCES_WANTED):  # the calibration keeps each capture under what it was made from
        sources = imported_sources(since=started)  # None (nothing kept) if a source changed while it ran
        for result in results if isinstance(results, list) else [results]:
            result["sources"] = sources
    with open(result_file, "w") as f:
        json.dump(results, f)


def _run(spec: dict) -> dict:
    try:
        import torch

        from .workloads import run

        torch._dynamo.reset()  # each spec compiles from scratch, as in a process of its own
        return run(spec)
    except Exception as error:  # noqa: BLE001 - one contestant's failure is a row of the table
        trace = traceback.format_exc().strip().splitlines()
        return {"contestant": spec.get("contestant", spec["workload"]),
                "error": f"{type(error).__name__}: {str(error)[:1500]}\n" + "\n".join(trace[-8:])}


if __name__ == "__main__":
    main(*sys.argv[1:3])
