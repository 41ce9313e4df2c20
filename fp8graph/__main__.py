"""The command-line entry point.

    python -m fp8graph demo [--steps N] ...
    torchrun --nproc-per-node 2 -m fp8graph train-distributed [--recipe delayed] ...
"""

import argparse
import sys

from fp8graph.apps import demo, train_distributed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8graph")
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser("demo", help=demo.__doc__.splitlines()[0]))
    train_distributed.add_arguments(commands.add_parser(
        "train-distributed", help=train_distributed.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return {"demo": demo.run, "train-distributed": train_distributed.run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
