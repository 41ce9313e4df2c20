"""Model zoo: small HuggingFace models (and a toy MLP) built from config.

Real model code from the ``transformers`` package with seeded random weights;
nothing is downloaded. Each family is one file with named configs: ``tiny``
for tests, larger ones for the demo and benchmarks.

    >>> from fp8graph.models import build
    >>> model = build("llama", "tiny")
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["FAMILIES", "build", "configs"]

FAMILIES = ("llama", "gpt2", "bert", "qwen2", "mlp", "moe")


def _family(name: str):
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {FAMILIES}")
    return importlib.import_module(f"{__name__}.{name}")


def configs(family: str) -> tuple[str, ...]:
    """Names of the configs of ``family``."""
    return tuple(_family(family).CONFIGS)


def build(family: str, config: str = "tiny", seed: int = 0, device=None, dtype: torch.dtype | None = None,
          **overrides) -> torch.nn.Module:
    """A freshly initialized model of ``family`` with the named ``config``.

    Args:
        device, dtype: where and in which dtype the parameters are created (a
            32-layer Llama-3-8B is built straight on the GPU in BF16, never in
            fp32 on the host first). Without ``device``, torch's default device:
            inside ``with torch.device("meta"):`` a model without memory.
        overrides: config fields to change, e.g. ``num_hidden_layers=8``.
    """
    module = _family(family)
    if config not in module.CONFIGS:
        raise ValueError(f"{family} has no config {config!r}; known: {tuple(module.CONFIGS)}")
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with torch.device(device if device is not None else torch.get_default_device()):
            return module.build({**module.CONFIGS[config], **overrides})
    finally:
        torch.set_default_dtype(default_dtype)
