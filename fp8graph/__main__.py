"""The command-line entry point.

    python -m fp8graph demo [--steps N] ...
    python -m fp8graph passes                 # the backend's graph passes, in the order they run
    python -m fp8graph export MODEL_DIR OUT_DIR --recipe block   # an FP8 checkpoint serving engines load
    torchrun --nproc-per-node 2 -m fp8graph train-distributed [--recipe delayed] ...
"""

import argparse
import logging
import sys

# Before the apps import transformers, which imports torchao where it is installed (the benchmarks'
# contestant): on a CPU build of torch torchao logs that its CUDA extensions failed to load, and torch warns
# that torchao registers enums it no longer needs to. Neither concerns the commands; errors still show.
for _foreign in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_foreign).setLevel(logging.ERROR)

from fp8graph.apps import demo, export, train_distributed  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8graph")
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser("demo", help=demo.__doc__.splitlines()[0]))
    train_distributed.add_arguments(commands.add_parser(
        "train-distributed", help=train_distributed.__doc__.splitlines()[0]))
    export.add_arguments(commands.add_parser("export", help=export.__doc__.splitlines()[0]))
    commands.add_parser("passes", help="print the backend's graph passes, in the order they run")
    args = parser.parse_args(argv)
    return {"demo": demo.run, "train-distributed": train_distributed.run, "export": export.run,
            "passes": _print_passes}[args.command](args)


def _print_passes(args) -> int:
    from fp8graph.passes.pipeline import describe_passes

    print(describe_passes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
