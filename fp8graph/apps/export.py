"""Write a transformers checkpoint's FP8 weights as fp8graph would train them, in a format serving engines load.

    python -m fp8graph export MODEL_DIR OUT_DIR --recipe block [--format fp8] [--keep "lm_head" ...]

Loads MODEL_DIR, compiles it with the recipe (``--keep`` patterns and the policy's usual exceptions kept in
high precision), runs one forward on a few tokens so that every site is decided, and calls
``fp8graph.save_fp8``. A model being trained exports itself instead: ``fp8graph.save_fp8(compiled, ...)`` after
training writes the FP8 weights it trained with, delayed scaling's stored scales included (which a fresh
compile does not have: ``--recipe delayed`` is refused here).
"""

from __future__ import annotations

import argparse
import sys

import torch

import fp8graph
from fp8graph.export.formats import FORMATS, UnsupportedExport
from fp8graph.recipes.scaling import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a transformers checkpoint directory (high precision)")
    parser.add_argument("out", help="where to write the FP8 checkpoint")
    parser.add_argument("--recipe", default="current", choices=[name for name in PRESETS if name != "delayed"],
                        help="the recipe of every eligible weight (default: current)")
    parser.add_argument("--format", choices=list(FORMATS), default=None,
                        help="checkpoint format (default: 'fp8' for block and MXFP8, compressed-tensors for the others)")
    parser.add_argument("--keep", action="append", default=None, metavar="PATTERN",
                        help="module paths (globs) kept in high precision, besides lm_head (see --fp8-lm-head)")
    parser.add_argument("--fp8-lm-head", action="store_true", help="give lm_head the recipe too")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="dtype the model is loaded in, and its high-precision weights written in")


def run(args: argparse.Namespace) -> int:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    keep = [*(args.keep or ()), *(() if args.fp8_lm_head else ("lm_head",))]
    policy = fp8graph.Policy(default=PRESETS[args.recipe], rules=[(pattern, None) for pattern in keep])
    compiled = fp8graph.compile(model.eval(), policy=policy, compiler="aot_eager")
    with torch.no_grad():  # the sites are decided when traced
        compiled(torch.zeros(1, 16, dtype=torch.long), use_cache=False)  # a KV cache would compile each layer anew
    try:
        summary = fp8graph.save_fp8(compiled, args.out, format=args.format)
    except UnsupportedExport as refused:
        print(f"fp8graph export: {refused}", file=sys.stderr)
        return 1
    print(summary)
    print(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({args.out!r})")
    return 0
