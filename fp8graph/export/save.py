"""Write a trained model's FP8 weights as a HuggingFace checkpoint a serving engine loads.

    summary = fp8graph.save_fp8(compiled, "out/fp8_checkpoint")        # format chosen by the recipes
    model = transformers.AutoModelForCausalLM.from_pretrained("out/fp8_checkpoint")

The checkpoint is what ``save_pretrained`` would write (safetensors shards with an index, config.json, the
checkpoint layout of the model's family: transformers' own reversal of its load-time conversions, so MoE experts
are written per expert where the family's checkpoints are), with each FP8 weight replaced by the bytes and scales
its sites trained with (``fp8graph.export.trained``) and ``quantization_config`` describing them
(``fp8graph.export.formats``). Everything else stays as the model holds it, in high precision, and the modules the
loader would convert but fp8graph kept in high precision are listed as not converted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import torch

from fp8graph.export.formats import CheckpointFormat, UnsupportedExport, choose_format
from fp8graph.export.trained import TrainedWeight, trained_weights
from fp8graph.recipes.scaling import Granularity

__all__ = ["ExportSummary", "save_fp8"]

_FP8GRAPH_BUFFER = "fp8graph_"  # delayed-scaling state and statistics: fp8graph's, not the model's


@dataclasses.dataclass
class ExportSummary:
    """What :func:`save_fp8` wrote."""

    directory: str
    format: str
    fp8: dict[str, str]  # weight key -> recipe
    kept: dict[str, str]  # weight key -> why it stays in high precision
    files: list[str]

    def __str__(self) -> str:
        lines = [f"fp8graph export: {len(self.fp8)} FP8 weights, {len(self.kept)} kept in high precision, "
                 f"format {self.format!r}, {len(self.files)} files in {self.directory}"]
        by_recipe: dict[str, int] = {}
        for recipe in self.fp8.values():
            by_recipe[recipe] = by_recipe.get(recipe, 0) + 1
        lines += [f"  {count} x {recipe}" for recipe, count in by_recipe.items()]
        lines += [f"  kept {key}: {reason}" for key, reason in list(self.kept.items())[:8]]
        if len(self.kept) > 8:
            lines.append(f"  ... and {len(self.kept) - 8} more kept")
        return "\n".join(lines)


def _converted_by_loaders(path: str, module: torch.nn.Module) -> bool:
    """Whether transformers' FP8 loaders swap ``module`` for an FP8 one: a plain ``nn.Linear``, or a family's
    experts module (``<...>.experts``)."""
    return type(module) is torch.nn.Linear or path.endswith(".experts")


def _owners(key: str, modules: dict[str, torch.nn.Module]) -> list[str]:
    """The paths of every module holding the weight ``key`` names (more than one where it is tied)."""
    path, name = key.rsplit(".", 1)
    weight = getattr(modules[path], name)
    return sorted(p for p, m in modules.items() if any(w is weight for w in m.parameters(recurse=False)))


def _check_loaders_convert(weights: list[TrainedWeight], modules: dict[str, torch.nn.Module]) -> None:
    refused = [w.key for w in weights if not _converted_by_loaders(w.module_path, modules[w.module_path])]
    if refused:
        described = []
        for key in refused[:6]:
            owners = _owners(key, modules)
            described.append(key if len(owners) == 1 else f"{key} (tied: held by {', '.join(owners)})")
        raise ValueError(
            f"these FP8 weights are not held by an nn.Linear or an experts module, which are what FP8 loaders "
            f"convert, so no checkpoint format can carry them: {', '.join(described)} (modules "
            f"{sorted({type(modules[k.rsplit('.', 1)[0]]).__name__ for k in refused})}); keep the modules whose "
            "sites read them (a tied weight's: each module holding it) in high precision with a policy rule to "
            "export")


def _scale_grid(weight: TrainedWeight) -> torch.Tensor:
    """The weight's scales repeated down its rows, (..., N, columns of the grid): a reversal that splits or
    stacks the weight's rows (gate and up, one expert from another) splits its scales the same way."""
    rows = weight.weight_fp8.shape[-2]
    scale = weight.weight_scale_inv
    if weight.granularity is Granularity.TENSOR:
        return scale.reshape(*scale.shape, 1, 1).expand(*scale.shape, rows, 1)
    return scale.repeat_interleave(rows // scale.shape[-2], dim=-2)


def _rows_per_scale(weight: TrainedWeight, rows: int) -> int:
    return {Granularity.TENSOR: rows, Granularity.BLOCK: 128}.get(weight.granularity, 1)


def _reduce_grid(weight: TrainedWeight, key: str, grid: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor's scales from its part of :func:`_scale_grid`: one row per scale again."""
    rows = grid.shape[-2]
    step = _rows_per_scale(weight, rows)
    if rows % step:
        raise ValueError(f"{key}: the checkpoint layout cuts {weight.key} at a row that is not a multiple of its "
                         f"{step}-row scale blocks, so its scales cannot be split with it")
    reduced = grid[..., ::step, :]
    if not torch.equal(reduced.repeat_interleave(step, dim=-2), grid):
        raise ValueError(f"{key}: the checkpoint layout merges weights with different scales into one tensor "
                         f"({weight.key}), which its format gives one scale per block")
    return reduced


@contextlib.contextmanager
def _family_conversions(model):
    """transformers reverses the conversions a model was loaded with; a model loaded from an FP8 checkpoint
    carries its loader's (a reversal would quantize again, its own way), so the family's are used instead."""
    loaded = model.__dict__.pop("_weight_conversions", None)
    try:
        yield
    finally:
        if loaded is not None:
            model.__dict__["_weight_conversions"] = loaded


def _reverted(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's names) in the family's checkpoint layout (transformers' reversal, as
    ``save_pretrained`` does)."""
    from transformers.core_model_loading import revert_weight_conversion

    with _family_conversions(model):
        return revert_weight_conversion(model, state)


def _checkpoint_tensors(model, weights: list[TrainedWeight], checkpoint_format: CheckpointFormat
                        ) -> dict[str, torch.Tensor]:
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    fp8_keys = {w.key for w in weights}
    high_precision = {k: v for k, v in model.state_dict().items()
                      if k not in fp8_keys and not k.rsplit(".", 1)[-1].startswith(_FP8GRAPH_BUFFER)}
    for weight in weights:  # static input scales live beside the weight, on its module
        if weight.input_scale_inv is not None:
            name = f"{weight.module_path}.{checkpoint_format.input_scale_name}"
            high_precision[name] = checkpoint_format.scale_tensor(weight, weight.input_scale_inv.float())
    tensors = dict(_reverted(model, remove_tied_weights_from_state_dict(high_precision, model)))
    for weight in weights:
        # Each FP8 weight reverted on its own, its bytes as uint8 (the reversal's ops need no FP8 kernels).
        pieces = _reverted(model, {weight.key: weight.weight_fp8.view(torch.uint8)})
        grids = _reverted(model, {weight.key: _scale_grid(weight)})
        if set(pieces) != set(grids):
            raise ValueError(f"{weight.key}: its checkpoint layout names its weight and scales differently")
        for key, piece in pieces.items():
            if key in tensors:
                raise ValueError(f"{weight.key}: its checkpoint tensor {key} is also written from another weight")
            tensors[key] = piece.view(weight.weight_fp8.dtype)
            scale = _reduce_grid(weight, key, grids[key])
            tensors[key + checkpoint_format.scale_suffix] = checkpoint_format.scale_tensor(weight, scale)
    return tensors


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing memory with another (safetensors refuses shared storage)."""
    seen, out = set(), {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out


def _remove_earlier_weights(directory: str, written: set[str]) -> None:
    """Remove the weight files of a checkpoint written there before that this one does not overwrite (as
    ``save_pretrained`` does): transformers would load an earlier ``model.safetensors`` before a new index, and
    a stale index would name shards that no longer hold its weights."""
    for name in os.listdir(directory):
        weights_file = name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json"))
        if weights_file and name not in written:
            os.remove(os.path.join(directory, name))


def _write_shards(tensors: dict[str, torch.Tensor], directory: str, max_shard_size) -> list[str]:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    _remove_earlier_weights(directory, set(split.filename_to_tensors))
    for filename, keys in split.filename_to_tensors.items():
        save_file({key: tensors[key] for key in keys}, os.path.join(directory, filename), metadata={"format": "pt"})
    files = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        files.append("model.safetensors.index.json")
    return files


def _nothing_in_fp8(kept: dict[str, str]) -> str:
    """Why a model with no weight in FP8 has no FP8 checkpoint: its weights grouped by the reason each stays."""
    by_reason: dict[str, list[str]] = {}
    for key, reason in kept.items():
        by_reason.setdefault(reason, []).append(key)
    lines = [f"  {reason}: {', '.join(keys[:4])}{f' and {len(keys) - 4} more' if len(keys) > 4 else ''}"
             for reason, keys in by_reason.items()]
    return "no weight of the model runs in FP8, so there is no FP8 checkpoint to write:\n" + "\n".join(lines)


def save_fp8(compiled, directory: str, format: str | None = None, max_shard_size: int | str = "5GB") -> ExportSummary:
    """Write the FP8 weights ``compiled`` trains with, in a checkpoint format serving engines load.

    Args:
        compiled: what ``fp8graph.compile`` returned for a transformers model, called at least once.
        directory: created if missing; its config.json and weight files are replaced (an earlier checkpoint's
            ``model*.safetensors`` and index there are removed).
        format: ``"fp8"`` (HuggingFace / DeepSeek-V3 fine-grained FP8) or ``"compressed-tensors"``; ``None``
            picks the first that holds every weight as trained (``fp8graph.export.formats``).
        max_shard_size: the largest safetensors file, as ``save_pretrained`` takes it.

    Returns:
        An :class:`ExportSummary`; ``print()`` it.

    Raises:
        UnsupportedExport: a weight the format cannot hold (named, with the reason), or no weight in FP8 (each
            kept one's reason); nothing is written.

    Example:
        >>> fp8graph.save_fp8(compiled, "out/fp8_checkpoint")
    """
    weights, kept = trained_weights(compiled)
    if not weights:
        raise UnsupportedExport(_nothing_in_fp8(kept))
    model = getattr(compiled, "_orig_mod", compiled)
    if not hasattr(model, "config") or not hasattr(model.config, "to_dict"):
        raise TypeError(f"save_fp8 writes a transformers checkpoint: {type(model).__name__} has no config")
    checkpoint_format = choose_format(weights, format)
    modules = dict(model.named_modules())
    _check_loaders_convert(weights, modules)
    fp8_modules = {w.module_path for w in weights}
    not_converted = sorted(path for path, module in modules.items()
                           if _converted_by_loaders(path, module) and path not in fp8_modules)
    tensors = _unshared(_checkpoint_tensors(model, weights, checkpoint_format))
    os.makedirs(directory, exist_ok=True)
    files = _write_shards(tensors, directory, max_shard_size)
    config = model.config.to_dict()
    config["quantization_config"] = checkpoint_format.quantization_config(weights, not_converted)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return ExportSummary(directory, checkpoint_format.name, {w.key: str(w.recipe) for w in weights}, kept,
                         files + ["config.json"])
