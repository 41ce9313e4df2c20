"""The FP8 checkpoint formats serving engines load, and which trained weights each can hold.

    format               recipes it holds                       tensors of an FP8 module <m>
    "fp8"                block (128x128), current, delayed,     <m>.weight (E4M3), <m>.weight_scale_inv (fp32;
                         mxfp8 (1x32, "ue8m0" scales)           E8M0 bytes for MXFP8), <m>.activation_scale (static)
    "compressed-tensors" current and delayed ("tensor"),        <m>.weight (E4M3), <m>.weight_scale (fp32),
                         rowwise ("channel"), block ("block")   <m>.input_scale (static)

Both store dequantization factors (``real = fp8 x scale``): "fp8" names them ``weight_scale_inv`` (DeepSeek-V3's
name, which transformers' ``FineGrainedFP8`` reads for every block size, per-tensor included; vLLM and SGLang read
it for blocks only, and per-tensor scales as ``weight_scale``), compressed-tensors ``weight_scale``; a loader that
reads one name finds nothing under the other, so the name is the format's, never chosen per weight. "fp8" holds one block size and one activation scheme for the whole model; compressed-tensors
holds a group per recipe. Activations: dynamic per tensor (current), static per tensor (delayed: the input's
stored scale), dynamic per token (rowwise), dynamic per 1x128 group (block), as the recipe casts them.
"""

from __future__ import annotations

import dataclasses

import torch

from fp8graph.export.trained import TrainedWeight
from fp8graph.recipes.scaling import Granularity

__all__ = ["FORMATS", "CheckpointFormat", "CompressedTensors", "FineGrainedFP8", "choose_format", "UnsupportedExport"]


class UnsupportedExport(ValueError):
    """A trained weight the asked format cannot hold; the message names the weights and why."""


def _refuse(format_name: str, refusals: dict[str, list[str]]) -> None:
    if refusals:
        lines = [f"{reason}: {', '.join(keys[:6])}{f' and {len(keys) - 6} more' if len(keys) > 6 else ''}"
                 for reason, keys in refusals.items()]
        raise UnsupportedExport(f"format {format_name!r} cannot hold these FP8 weights as they were trained:\n  "
                                + "\n  ".join(lines))


def _static(weight: TrainedWeight) -> bool:
    return weight.input_scale_inv is not None


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """A checkpoint format: what it holds, how it names a weight's tensors, how config.json describes it."""

    name: str = ""
    scale_suffix: str = ""  # appended to a weight's key for its scale
    input_scale_name: str = ""  # a static input scale's attribute on the module

    def refusals(self, weights: list[TrainedWeight]) -> dict[str, list[str]]:
        """``{reason: [weight keys]}`` of the weights this format cannot hold (empty: it holds them all)."""
        refusals: dict[str, list[str]] = {}
        for weight in weights:
            reason = self.refusal(weight)
            if reason is None and weight.weight_fp8.dtype != torch.float8_e4m3fn:
                reason = (f"{weight.weight_fp8.dtype} weights (format {self.name!r} is E4M3): train with "
                          "Format.HYBRID or E4M3")
            if reason is None and weight.experts and _static(weight):
                reason = ("delayed scaling of expert weights: their static input scales have no per-expert layout "
                          "transformers loads; train the experts with current scaling to export them")
            if reason:
                refusals.setdefault(reason, []).append(weight.key)
        return refusals

    def refusal(self, weight: TrainedWeight) -> str | None:
        """Why this format cannot hold ``weight``'s granularity, or None."""
        return None

    def check(self, weights: list[TrainedWeight]) -> None:
        _refuse(self.name, self.refusals(weights))

    def scale_tensor(self, weight: TrainedWeight, scale_inv: torch.Tensor) -> torch.Tensor:
        """How the format stores one checkpoint tensor's scale, given its grid (rows of the weight x the
        granularity's columns, already reduced to the granularity's rows)."""
        return scale_inv.contiguous()

    def quantization_config(self, weights: list[TrainedWeight], not_converted: list[str]) -> dict:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FineGrainedFP8(CheckpointFormat):
    """HuggingFace / DeepSeek-V3 ``"quant_method": "fp8"``, as transformers' ``FineGrainedFP8Config`` reads it."""

    name: str = "fp8"
    scale_suffix: str = "_scale_inv"
    input_scale_name: str = "activation_scale"

    def refusal(self, weight):
        if weight.granularity is Granularity.ROW:
            return ("row-wise scales (one per output channel) are not a block size of format 'fp8': "
                    "export with format='compressed-tensors' (strategy 'channel')")
        return None

    def refusals(self, weights):
        refusals = super().refusals(weights)
        kinds = {(w.granularity, _static(w)) for w in weights if w.granularity is not Granularity.ROW}
        if len(kinds) > 1:  # one weight_block_size and one activation_scheme per checkpoint
            names = {(g, s): sorted({str(w.recipe) for w in weights if (w.granularity, _static(w)) == (g, s)})
                     for g, s in kinds}
            refusals[f"format 'fp8' holds one block size and one activation scheme per model, and these weights "
                     f"were trained with {len(kinds)} ({'; '.join(', '.join(v) for v in names.values())}): "
                     "export with format='compressed-tensors', or train one recipe"] = [w.key for w in weights]
        return refusals

    def scale_tensor(self, weight, scale_inv):
        if weight.granularity is Granularity.TENSOR:
            return scale_inv.reshape(()).contiguous()  # FP8Linear's per-tensor weight_scale_inv is 0-dim
        return scale_inv.contiguous()

    def quantization_config(self, weights, not_converted):
        granularity = weights[0].granularity if weights else Granularity.BLOCK
        block_size = {Granularity.BLOCK: [128, 128], Granularity.MX: [1, 32]}.get(granularity)
        config = {"quant_method": "fp8", "fmt": "e4m3",
                  "activation_scheme": "static" if weights and _static(weights[0]) else "dynamic",
                  "weight_block_size": block_size, "modules_to_not_convert": not_converted}
        if granularity is Granularity.MX:
            config["scale_fmt"] = "ue8m0"
        return config


_CT_STRATEGY = {Granularity.TENSOR: "tensor", Granularity.ROW: "channel", Granularity.BLOCK: "block"}


@dataclasses.dataclass(frozen=True)
class CompressedTensors(CheckpointFormat):
    """``"quant_method": "compressed-tensors"``, ``"format": "float-quantized"``, as llm-compressor writes it and
    the ``compressed-tensors`` package (which transformers and vLLM load it with) reads it."""

    name: str = "compressed-tensors"
    scale_suffix: str = "_scale"
    input_scale_name: str = "input_scale"

    def refusal(self, weight):
        if weight.granularity is Granularity.MX:
            return "MXFP8 (E8M0 scales per 32) is not a float-quantized strategy: export with format='fp8'"
        return None

    def refusals(self, weights):
        refusals = super().refusals(weights)
        strategies = {w.granularity for w in weights if w.granularity in _CT_STRATEGY}
        if Granularity.BLOCK in strategies and len(strategies) > 1:
            # transformers' CompressedTensorsDequantize reads every dense module with one scheme, its first group's:
            # per-tensor and per-channel scales broadcast alike, 128x128 block scales beside them cannot be read.
            names = sorted({str(w.recipe) for w in weights})
            refusals["transformers dequantizes a compressed-tensors checkpoint's modules with one scheme, which cannot "
                     f"read 128x128 block scales beside another strategy's, and these weights were trained with "
                     f"{', '.join(names)}: train the block-scaled and the other weights with one recipe"] = \
                [w.key for w in weights]
        return refusals

    def scale_tensor(self, weight, scale_inv):
        if weight.granularity is Granularity.TENSOR:
            return scale_inv.reshape(1).contiguous()  # compressed-tensors' "tensor" scale has shape (1,)
        return scale_inv.contiguous()

    @staticmethod
    def _scheme(weight: TrainedWeight) -> dict:
        weights_args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": _CT_STRATEGY[weight.granularity]}
        if weight.granularity is Granularity.BLOCK:
            weights_args["block_structure"] = [128, 128]
        activations = {Granularity.TENSOR: {"strategy": "tensor", "dynamic": not _static(weight)},
                       Granularity.ROW: {"strategy": "token", "dynamic": True},
                       Granularity.BLOCK: {"strategy": "group", "group_size": 128, "dynamic": True}}
        return {"weights": weights_args, "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                               **activations[weight.granularity]}}

    def quantization_config(self, weights, not_converted):
        groups: dict[str, dict] = {}
        for weight in weights:
            scheme = self._scheme(weight)
            key = repr(scheme)
            group = groups.setdefault(key, {"targets": [], **scheme})
            if weight.module_path not in group["targets"]:  # exact module names (an experts' module has two)
                group["targets"].append(weight.module_path)
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {f"group_{i}": group for i, group in enumerate(groups.values())},
                "ignore": not_converted}


FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (FineGrainedFP8(), CompressedTensors())}


def _preferred(weights: list[TrainedWeight]) -> list[CheckpointFormat]:
    """The formats in the order ``format=None`` tries them. Block and MXFP8 scales have one name in every
    engine ("fp8"'s ``weight_scale_inv``, DeepSeek-V3's). Per-tensor "fp8" does not: transformers reads
    ``weight_scale_inv`` and ``activation_scale``, vLLM and SGLang ``weight_scale`` and ``input_scale``, so no
    per-tensor "fp8" checkpoint loads in both; compressed-tensors reads the same in all three."""
    blocks = all(w.granularity in (Granularity.BLOCK, Granularity.MX) for w in weights)
    order = ("fp8", "compressed-tensors") if blocks else ("compressed-tensors", "fp8")
    return [FORMATS[name] for name in order]


def choose_format(weights: list[TrainedWeight], name: str | None) -> CheckpointFormat:
    """The format ``name`` (checked to hold every weight), or with ``None`` the first that does: "fp8" for block
    and MXFP8 scales, compressed-tensors for the rest (:func:`_preferred` says why)."""
    if name is not None:
        if name not in FORMATS:
            raise ValueError(f"unknown FP8 checkpoint format {name!r}; known: {', '.join(FORMATS)}")
        FORMATS[name].check(weights)
        return FORMATS[name]
    refusals = {}
    for checkpoint_format in _preferred(weights):
        refusals[checkpoint_format.name] = checkpoint_format.refusals(weights)
        if not refusals[checkpoint_format.name]:
            return checkpoint_format
    raise UnsupportedExport("no FP8 checkpoint format holds these weights as they were trained:\n" + "\n".join(
        f"  {name}: {reason}: {', '.join(keys[:6])}" for name, by_reason in refusals.items()
        for reason, keys in by_reason.items()))
