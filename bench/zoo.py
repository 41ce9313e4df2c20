"""The model zoo against plain torch.compile: keep-all bit-exactness, FP8 SQNR and loss, linear coverage, per family.

The checks of ``tests/test_zoo.py`` (``fp8graph.models.zoo.check_family``), on a larger form of every
family by default: 2 layers (each of encoder and decoder for T5 and BART) and 2x32 tokens; ``--smoke`` runs
the tests' form (the tiny configs' 1 or 2 layers, 2x8 tokens). All on CPU with aot_eager.

A row's status is ``pass`` when keep-all is bit-exact with torch.compile, the FP8 logits and gradients are
finite, every called linear is named by a decision and no check raised; otherwise it lists what failed. The
FP8 SQNR (logits against eager in the same dtype) and the relative loss difference after one SGD step are
reported as measured: the test holds them to its per-family floors at the tiny form.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import torch

from .cli import positive
from .timing import environment, markdown_table, report, title, write_partial

DTYPES = ("bfloat16", "float32")
LAYERS, SEQUENCE, BATCH = 2, 32, 2
SMOKE_SEQUENCE = 8


def _row(result) -> dict:
    """One family in one dtype, as the JSON stores it."""
    failures = result.failures(sqnr_floor_db=float("-inf"), loss_margin=float("inf"))
    return {**dataclasses.asdict(result),
            "keep_all_bit_exact": None if result.keep_all_mismatches is None else not result.keep_all_mismatches,
            "status": "pass" if not failures else "; ".join(failures)}


def run(args: argparse.Namespace) -> dict:
    from fp8graph.models.zoo import FAMILIES, UNAVAILABLE, check_family

    families = args.families or list(FAMILIES)
    unknown = [family for family in families if family not in FAMILIES]
    if unknown:
        raise SystemExit(f"python -m bench zoo: unknown families {unknown}; known: {', '.join(FAMILIES)}"
                         + "".join(f"\n{f}: {UNAVAILABLE[f]}" for f in unknown if f in UNAVAILABLE))
    layers, sequence = (None, SMOKE_SEQUENCE) if args.smoke else (args.layers, args.sequence)
    result = {"workload": "zoo", "smoke": args.smoke, "layers": layers, "batch": BATCH, "sequence": sequence,
              "environment": environment(torch.device("cpu")), "unavailable": UNAVAILABLE, "rows": []}
    for family in families:
        for dtype in args.dtypes:
            checked = check_family(family, getattr(torch, dtype), batch=BATCH, sequence=sequence, layers=layers)
            result["rows"].append(_row(checked))
            print(f"{family} {dtype}: {result['rows'][-1]['status']} ({checked.seconds:.1f} s)", flush=True)
            write_partial(result, args.out, "zoo")
    return report(result, args.out, "zoo", summary)


def _number(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def summary(result: dict) -> str:
    rows = [[r["family"], r["dtype"], f"{_number(r['sites_rewritten'], 'd')} / {_number(r['sites_kept'], 'd')}",
             {True: "yes", False: "no", None: "-"}[r["keep_all_bit_exact"]], _number(r["fp8_sqnr_db"], ".1f"),
             _number(r["loss_delta"], ".2%"), f"{r['seconds']:.1f}", r["status"]] for r in result["rows"]]
    columns = ["family", "dtype", "rewritten / kept", "keep-all bit-exact", "FP8 SQNR dB", "loss delta", "s",
               "status"]
    form = "the tests' tiny form" if result["layers"] is None else f"{result['layers']} layers"
    lines = [title(f"model zoo against torch.compile (aot_eager), {form}, tokens {result['batch']}x"
                   f"{result['sequence']}", result), "", *markdown_table(columns, rows)]
    if result.get("unavailable"):
        lines += ["", "Not run (no CPU run from a config):",
                  *[f"- {family}: {reason}" for family, reason in result["unavailable"].items()]]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Families are checked in run(): importing transformers here would slow every other bench command.
    parser.add_argument("--families", nargs="+", metavar="FAMILY",
                        help="default: every family of fp8graph.models.zoo.FAMILIES")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--layers", type=positive(int), default=LAYERS,
                        help="layers of each model (each of encoder and decoder for seq2seq)")
    parser.add_argument("--sequence", type=positive(int), default=SEQUENCE, help="tokens per sequence")
    parser.add_argument("--smoke", action="store_true",
                        help=f"the tests' form: the tiny configs' layers, sequence {SMOKE_SEQUENCE}")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"),
                        help="folder of the JSON result (zoo-<date>.json)")
