"""``python -m bench.costmodel.child SPEC RESULT``: one contestant of one workload, in a process of its own.

Reads the JSON spec, runs :func:`bench.costmodel.workloads.run` and writes its JSON result; an exception
becomes ``{"error": ...}`` so that one contestant's failure is a row of the table, never a lost run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(spec_file: str, result_file: str) -> None:
    root = os.environ.get("FP8GRAPH_COSTMODEL_ROOT")  # calibration: fp8graph at the commit the H100 ran
    if root:
        sys.path.insert(0, root)
    with open(spec_file) as f:
        spec = json.load(f)
    try:
        from .workloads import run

        result = run(spec)
    except Exception as error:  # noqa: BLE001 - one contestant's failure is a row of the table
        trace = traceback.format_exc().strip().splitlines()
        result = {"contestant": spec.get("contestant", spec["workload"]),
                  "error": f"{type(error).__name__}: {str(error)[:1500]}\n" + "\n".join(trace[-8:])}
    with open(result_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
