"""``python -m bench {linear,quantize,decoder,compile} [--smoke]``."""

import argparse
import sys

from . import compile_time, decoder, linear, quantize

WORKLOADS = {"linear": linear, "quantize": quantize, "decoder": decoder, "compile": compile_time}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    commands = parser.add_subparsers(dest="workload", required=True)
    for name, module in WORKLOADS.items():
        module.add_arguments(commands.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    WORKLOADS[args.workload].run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
