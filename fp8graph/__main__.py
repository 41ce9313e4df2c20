"""``python -m fp8graph demo [--steps N] ...``: the command-line entry point."""

import argparse
import sys

from . import demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8graph")
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser("demo", help=demo.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
