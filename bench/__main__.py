"""``python -m bench {linear,quantize,decoder,moe,compile} [--smoke]``;
``python -m bench model {decoder,moe,linear,quantize,calibrate,compare}``;
``python -m bench zoo [--families ...]``; ``python -m bench fsdp-comms``; ``python -m bench show FILE...``."""

import argparse
import json
import pathlib
import sys

from . import compile_time, decoder, fsdp_comms, linear, model, moe, quantize, zoo
from .targets import judge
from .timing import with_verdicts

WORKLOADS = {"linear": linear, "quantize": quantize, "decoder": decoder, "moe": moe, "compile": compile_time,
             "model": model, "zoo": zoo, "fsdp-comms": fsdp_comms}
BY_RESULT_NAME = {"linear_fwd_bwd": linear, "quantize": quantize, "decoder_stack": decoder, "compile_time": compile_time,
                  "model_decoder": model, "model_linear": model, "model_quantize": model, "zoo": zoo,
                  "moe_block": moe, "moe_decode": moe, "model_moe": model}


def _stored_result(path: pathlib.Path) -> dict:
    """The result stored at ``path``, or an exit naming the file and what is wrong with it."""
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SystemExit(f"python -m bench show: {path} is not a readable JSON result: {error}")
    workload = result.get("workload") if isinstance(result, dict) else None
    if workload not in BY_RESULT_NAME or not isinstance(result.get("rows"), list):
        raise SystemExit(f"python -m bench show: {path} is not a bench result (it needs a 'workload' among "
                         f"{sorted(BY_RESULT_NAME)} and a list of 'rows')")
    return result


def show(paths: list[pathlib.Path]) -> None:
    """Print the summary of stored results, judged against today's targets."""
    for path in paths:
        result = _stored_result(path)
        result["targets"] = judge(result)
        print(f"{path}:\n{with_verdicts(BY_RESULT_NAME[result['workload']].summary(result), result)}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    commands = parser.add_subparsers(dest="workload", required=True)
    for name, module in WORKLOADS.items():
        module.add_arguments(commands.add_parser(name, help=module.__doc__.splitlines()[0]))
    show_parser = commands.add_parser("show", help="summaries and target verdicts of stored results")
    show_parser.add_argument("paths", nargs="+", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.workload == "show":
        show(args.paths)
    else:
        WORKLOADS[args.workload].run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
