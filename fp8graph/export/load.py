"""Load an FP8 checkpoint to fine-tune it: high-precision master weights and the policy that reproduces it.

    model, policy = fp8graph.load_fp8("deepseek-fp8-checkpoint")
    compiled = fp8graph.compile(model, policy=policy)          # trains with the checkpoint's recipes
    ...
    fp8graph.save_fp8(compiled, "fine-tuned", format=...)       # and writes the same format again

transformers loads the checkpoint dequantized (its FP8 loaders' ``dequantize=True``: each weight is the
checkpoint's FP8 bytes times its scales, exact in float32), and the checkpoint's ``quantization_config`` gives
each module the recipe that casts the same blocks the same way:

    checkpoint                                   recipe
    "fp8", weight_block_size [128, 128]          Float8BlockScaling
    "fp8", [1, 32] with "ue8m0" scales           MXFP8BlockScaling
    "fp8", per tensor, dynamic / static          Float8CurrentScaling / DelayedScaling (its stored scales
                                                 set from the checkpoint's weight and activation scales)
    compressed-tensors "tensor" dynamic/static   Float8CurrentScaling / DelayedScaling
    compressed-tensors "channel", "block"        Float8RowwiseScaling, Float8BlockScaling

Power-of-two scales are kept as such when every weight scale of the checkpoint is a power of two; then a
weight re-cast before any step gives back the checkpoint's bytes (the tests say where not, and why).
"""

from __future__ import annotations

import json
import os

import torch

from fp8graph.recipes.policy import Policy
from fp8graph.recipes.scaling import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                      Float8RowwiseScaling, MXFP8BlockScaling)

__all__ = ["load_fp8"]


def _quantization_config(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    quantization = config.get("quantization_config")
    if not quantization or quantization.get("quant_method") not in ("fp8", "compressed-tensors"):
        raise ValueError(f"{directory}: config.json has no FP8 quantization_config (quant_method 'fp8' or "
                         f"'compressed-tensors'); got {quantization and quantization.get('quant_method')!r}")
    return quantization


def _stored(directory: str, suffixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose names end with one of ``suffixes``, from every safetensors file."""
    from safetensors import safe_open

    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys() if key.endswith(suffixes)})
    return tensors


def _all_powers_of_two(directory: str, suffix: str) -> bool:
    """Whether every weight scale (tensors named ``*<suffix>``) of the checkpoint is a power of two."""
    for scale in _stored(directory, (suffix,)).values():
        if scale.dtype.itemsize == 1:
            continue  # E8M0 bytes: powers of two by construction
        if bool(((scale.float().view(torch.int32) & 0x7FFFFF) != 0).any()):
            return False
    return True


def _fp8_recipe(quantization: dict, power_2: bool):
    block = quantization.get("weight_block_size")
    if block is None:
        if quantization.get("activation_scheme", "dynamic") == "static":
            return DelayedScaling()
        return Float8CurrentScaling(power_2_scales=power_2)
    if list(block) == [128, 128]:
        return Float8BlockScaling(power_2_scales=power_2)
    if list(block) == [1, 32] and quantization.get("scale_fmt") == "ue8m0":
        return MXFP8BlockScaling()
    raise ValueError(f"weight_block_size {block} (scale_fmt {quantization.get('scale_fmt', 'float')!r}) is no "
                     "recipe fp8graph trains with: [128, 128] (block scaling) or [1, 32] with 'ue8m0' (MXFP8)")


def _compressed_tensors_recipe(group: dict, power_2: bool):
    weights, activations = group.get("weights") or {}, group.get("input_activations") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"a compressed-tensors group of {weights.get('type')} {weights.get('num_bits')}-bit weights "
                         "is not FP8")
    strategy = weights.get("strategy")
    if strategy == "tensor":
        return DelayedScaling() if activations.get("dynamic") is False else Float8CurrentScaling(power_2_scales=power_2)
    if strategy == "channel":
        return Float8RowwiseScaling(power_2_scales=power_2)
    if strategy == "block" and list(weights.get("block_structure") or ()) == [128, 128]:
        return Float8BlockScaling(power_2_scales=power_2)
    raise ValueError(f"compressed-tensors weights of strategy {strategy!r} "
                     f"(block_structure {weights.get('block_structure')}) are no recipe fp8graph trains with")


def _rule(target: str):
    """A policy pattern for a compressed-tensors target or ignore entry: a ``re:`` regex (compressed-tensors
    matches it from the start of the path), the class name ``Linear``, or a module path (a glob of itself:
    paths hold no glob characters)."""
    import re

    if target.startswith("re:"):
        return re.compile(f"(?:{target[3:]}).*")
    if target == "Linear":
        return torch.nn.Linear
    return target


def _not_converted(name: str):
    """The paths transformers leaves unconverted for a ``modules_to_not_convert`` entry: the entry as a regex
    from the start of the path up to a module boundary (the module and its subtree), or the path's tail."""
    import re

    return re.compile(rf"(?:{name})(?:\..*)?|.*{re.escape(name)}")


def _policy(quantization: dict, directory: str) -> Policy:
    if quantization["quant_method"] == "fp8":
        recipe = _fp8_recipe(quantization, _all_powers_of_two(directory, "_scale_inv"))
        keep = [(_not_converted(name), None) for name in quantization.get("modules_to_not_convert") or ()]
        return Policy(default=recipe, rules=keep)
    power_2 = _all_powers_of_two(directory, "weight_scale")
    keep = [(_rule(m), None) for m in quantization.get("ignore") or ()]
    rules = [(_rule(target), _compressed_tensors_recipe(group, power_2))
             for group in quantization.get("config_groups", {}).values() for target in group.get("targets", ())]
    return Policy(default=None, rules=keep + rules)


def _dequantizing(quantization: dict):
    import transformers

    if quantization["quant_method"] == "fp8":
        return transformers.FineGrainedFP8Config(**{**quantization, "dequantize": True})
    return transformers.CompressedTensorsConfig(**{**quantization, "dequantize": True})


def _set_delayed_scales(model: torch.nn.Module, policy: Policy, quantization: dict, directory: str) -> None:
    """Register delayed-scaling state (``fp8graph.compile`` then keeps it) and set each stored scale from the
    checkpoint: the input's from its static activation scale, the weight's from its weight scale (scales here
    multiply into FP8 range, checkpoints' dequantize, so each is the other's reciprocal)."""
    from fp8graph.buffers.delayed_state import SCALE_PREFIX, register_delayed_state

    register_delayed_state(model, policy)
    fine_grained = quantization["quant_method"] == "fp8"
    weight_suffix, input_name = ("weight_scale_inv", "activation_scale") if fine_grained else ("weight_scale",
                                                                                               "input_scale")
    stored = _stored(directory, (weight_suffix, input_name))
    for path, module in model.named_modules():
        scale = getattr(module, SCALE_PREFIX + "weight", None)
        if scale is None:
            continue
        keys = (f"{path}.{input_name}", f"{path}.{weight_suffix}")
        missing = [key for key in keys if key not in stored]
        if missing:
            raise ValueError(f"{path}: trained with delayed scaling from a static checkpoint, which has no "
                             f"{' or '.join(missing)}")
        with torch.no_grad():
            scale.copy_(torch.stack([stored[key].float().reshape(()).reciprocal() for key in keys]))


def load_fp8(directory: str, dtype: torch.dtype = torch.float32, model_class=None, **from_pretrained_kwargs):
    """Load an FP8 checkpoint (``"fp8"`` or compressed-tensors) with high-precision master weights.

    Args:
        directory: a checkpoint directory with config.json and safetensors files.
        dtype: the master weights' dtype. float32 holds every FP8 value times its scale exactly; bfloat16 holds
            it exactly only for power-of-two scales.
        model_class: the transformers class to load with (``AutoModelForCausalLM`` by default).
        from_pretrained_kwargs: passed on to ``from_pretrained``.

    Returns:
        ``(model, policy)``: the model in training mode and the :class:`fp8graph.Policy` that trains each module
        with the recipe the checkpoint stores it in (and keeps what it keeps in high precision).

    Example:
        >>> model, policy = fp8graph.load_fp8("checkpoint")
        >>> compiled = fp8graph.compile(model, policy=policy)
    """
    import transformers

    quantization = _quantization_config(directory)
    policy = _policy(quantization, directory)
    model_class = model_class or transformers.AutoModelForCausalLM
    model = model_class.from_pretrained(directory, dtype=dtype, quantization_config=_dequantizing(quantization),
                                        **from_pretrained_kwargs)
    # With a quantizer, transformers leaves the modules it does not convert in the checkpoint's dtype.
    model.to(dtype).train()
    if policy.needs_state:
        _set_delayed_scales(model, policy, quantization, directory)
    return model, policy
