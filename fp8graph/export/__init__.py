"""Export: the FP8 weights a model trained with, written in the checkpoint formats serving engines load.

    trained.py   each weight's recipe, FP8 bytes and scales, as its sites cast it
    formats.py   "fp8" (HuggingFace / DeepSeek-V3) and "compressed-tensors": what each holds, how it names it
    save.py      save_fp8: the family's checkpoint layout, safetensors shards, config.json
    load.py      load_fp8: an FP8 checkpoint as high-precision master weights and the policy that reproduces it
"""

from fp8graph.export.formats import FORMATS, UnsupportedExport
from fp8graph.export.load import load_fp8
from fp8graph.export.save import ExportSummary, save_fp8

__all__ = ["FORMATS", "ExportSummary", "UnsupportedExport", "load_fp8", "save_fp8"]
