"""FP8 checkpoints: what fp8graph trained, written in the formats serving engines load, read by their loaders.

    tiny DeepSeek-V3, Qwen3-MoE and Llama (hidden 128: whole 128x128 blocks), one training step under a policy
      -> fp8graph.save_fp8 -> transformers.from_pretrained (its FP8 / compressed-tensors loaders, dequantizing)
      -> every FP8 weight equal to fp8graph's bytes x scales bit for bit; every other weight as trained;
         the loaded model's logits against fp8graph's FP8 inference within FP8's error
      -> fp8graph.load_fp8 -> compile, no step -> save_fp8 again: the same bytes and scales

Every case compiles with aot_eager. Refusals are checked on trained weights built by hand, without compiling.
"""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

import fp8graph
from fp8graph.export import FORMATS, UnsupportedExport
from fp8graph.export.formats import choose_format
from fp8graph.export.trained import TrainedWeight, trained_weights
from fp8graph.models.zoo import build_zoo_model, zoo_inputs
from fp8graph.recipes.scaling import PRESETS, Granularity
from helpers import sqnr_db

# Hidden 128, expert width 128, 4 heads of 32 (query, key and value 128 wide): whole 128x128 blocks.
SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32, num_key_value_heads=4)
# DeepSeek-V3's latent attention at ranks 128: its kv_a_proj (N = 128 + 32) is not whole blocks and stays.
DEEPSEEK_SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, q_lora_rank=128,
                      kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
SHAPES = {"qwen3_moe": SHAPE, "llama": SHAPE, "deepseek_v3": DEEPSEEK_SHAPE}
ATTENTION = "*.self_attn.*"

# case id: (family, policy rules before the lm_head rule, default recipe, format asked, format expected)
CASES = {
    # DeepSeek-V3's own format. Experts never run block scaling (their 128x128 blocks would cross groups of
    # tokens): kept and listed, as the latent attention's kv_a_proj.
    "deepseek_v3-block": ("deepseek_v3", [], PRESETS["block"], None, "fp8"),
    # Per-tensor scales: compressed-tensors unless "fp8" is asked for (engines name per-tensor "fp8" apart).
    "qwen3_moe-current": ("qwen3_moe", [], PRESETS["current"], None, "compressed-tensors"),
    "qwen3_moe-mxfp8": ("qwen3_moe", [], PRESETS["mxfp8"], None, "fp8"),
    # Static activation scales: the input's stored scale, under transformers' per-tensor "fp8" names.
    "llama-delayed": ("llama", [], PRESETS["delayed"], "fp8", "fp8"),
    "qwen3_moe-rowwise": ("qwen3_moe", [], PRESETS["rowwise"], None, "compressed-tensors"),
    # Two groups in one checkpoint: static per-tensor attention, dynamic per-tensor experts.
    "qwen3_moe-delayed+current": ("qwen3_moe", [(ATTENTION, PRESETS["delayed"])], PRESETS["current"],
                                  "compressed-tensors", "compressed-tensors"),
}


def _train_and_export(case: str, directory: str):
    family, rules, default, asked, _ = CASES[case]
    model = build_zoo_model(family, torch.bfloat16, **SHAPES[family])
    policy = fp8graph.Policy(default=default, rules=[*rules, ("lm_head", None)])
    compiled = fp8graph.compile(model, policy=policy, compiler="aot_eager")
    inputs = zoo_inputs(family)
    compiled(**inputs).loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():  # one SGD step, so the weights exported are trained ones
            if parameter.grad is not None:
                parameter -= 0.05 * parameter.grad
                parameter.grad = None
    model.eval()
    with torch.no_grad():
        logits_fp8 = compiled(**inputs).logits.float()
    summary = fp8graph.save_fp8(compiled, directory, format=asked)
    return compiled, summary, logits_fp8, inputs


def _real(weight: TrainedWeight) -> torch.Tensor:
    """fp8graph's bytes times its scales, in fp32, over the weight's shape."""
    scale = weight.weight_scale_inv
    if weight.granularity is Granularity.TENSOR:  # one per tensor, or one per expert
        return weight.weight_fp8.float() * (scale.reshape(-1, 1, 1) if weight.experts else scale)
    return weight.weight_fp8.float() * _factors(scale, weight.weight_fp8.shape)


def _load_with_transformers(directory: str, checkpoint_format: str):
    # transformers dequantizes "fp8" by itself without a GPU; compressed-tensors is asked to.
    extra = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)} \
        if checkpoint_format == "compressed-tensors" else {}
    # Loaded in fp32 (every FP8 value times its scale is exact there); transformers leaves the modules it does not
    # convert in the checkpoint's dtype, and they are trained BF16 values, exact in fp32 too.
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **extra).float()


@pytest.mark.parametrize("case", list(CASES))
def test_the_export_loads_in_transformers_as_trained_and_loads_back_for_fine_tuning(case, tmp_path):
    compiled, summary, logits_fp8, inputs = _train_and_export(case, str(tmp_path / "export"))
    expected_format = CASES[case][4]
    assert summary.format == expected_format
    weights, kept = trained_weights(compiled)
    config = json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"]
    not_converted = config.get("modules_to_not_convert", config.get("ignore"))
    assert "lm_head" in not_converted and not any(w.module_path in not_converted for w in weights)
    if case == "deepseek_v3-block":  # what is not whole blocks, and the experts, kept and listed
        assert all(key in kept for key in ("model.layers.1.mlp.experts.gate_up_proj",
                                           "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"))
        assert {"model.layers.1.mlp.experts", "model.layers.1.self_attn.kv_a_proj_with_mqa"} <= set(not_converted)

    loaded = _load_with_transformers(str(tmp_path / "export"), expected_format)
    state = loaded.state_dict()
    model = compiled._orig_mod
    mismatched = [w.key for w in weights if not torch.equal(state[w.key], _real(w))]
    assert mismatched == []
    fp8_keys = {w.key for w in weights}
    trained_hp = {k: v for k, v in model.state_dict().items() if k in state and k not in fp8_keys}
    assert trained_hp and all(torch.equal(state[k], v.float()) for k, v in trained_hp.items())

    # The loaded model computes in fp32 with the FP8 weights; fp8graph's inference also casts activations.
    loaded.eval()
    with torch.no_grad():
        logits_loaded = loaded(**inputs).logits.float()
    assert sqnr_db(logits_loaded, logits_fp8) > 20.0

    # Fine-tuning starts from the checkpoint: no step taken, the same checkpoint again.
    master, policy = fp8graph.load_fp8(str(tmp_path / "export"))
    again = fp8graph.compile(master, policy=policy, compiler="aot_eager")
    with torch.no_grad():
        again(**inputs)
    fp8graph.save_fp8(again, str(tmp_path / "again"), format=expected_format)
    _assert_same_fp8(tmp_path / "export", tmp_path / "again", weights)


def _factors(scale: torch.Tensor, shape) -> torch.Tensor:
    """A checkpoint's dequantization factors (fp32, or E8M0 bytes) over a weight of ``shape``."""
    if scale.dtype == torch.uint8:
        scale = (scale.float() - 127).exp2()
    if scale.numel() == 1:
        return scale.reshape(()).expand(shape)
    return scale.repeat_interleave(shape[-2] // scale.shape[-2], -2).repeat_interleave(shape[-1] // scale.shape[-1], -1)


def _block_max(magnitude: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest of each scale's block, over every element of the block."""
    if scale.numel() == 1:
        return magnitude.amax().expand(magnitude.shape)
    rows, cols = magnitude.shape[-2] // scale.shape[-2], magnitude.shape[-1] // scale.shape[-1]
    blocks = magnitude.reshape(*magnitude.shape[:-2], scale.shape[-2], rows, scale.shape[-1], cols)
    return blocks.amax(dim=(-3, -1)).repeat_interleave(rows, -2).repeat_interleave(cols, -1)


def _exact_scales(scale: torch.Tensor) -> bool:
    """Scales not rounded to powers of two (current scaling's default): no block moves."""
    return scale.dtype != torch.uint8 and bool(((scale.float().view(torch.int32) & 0x7FFFFF) != 0).any())


def _assert_same_fp8(first, second, weights) -> None:
    """Every FP8 tensor and scale of ``second`` as in ``first``, but where a block's largest value rounded to
    half the format's range (224 of 448): re-cast from the same real values, that block takes the next scale up
    and holds each value with one more exponent step (bytes x2, factor /2): the same real values everywhere."""
    before, after = (load_file(os.path.join(d, "model.safetensors")) for d in (first, second))
    assert set(before) == set(after)
    fp8_keys = [k for k in before if before[k].dtype == torch.float8_e4m3fn]
    assert fp8_keys
    for weight_key in fp8_keys:
        (scale_key,) = [weight_key + suffix for suffix in ("_scale_inv", "_scale") if weight_key + suffix in before]
        q_before, q_after = before[weight_key].float(), after[weight_key].float()
        f_before = _factors(before[scale_key], q_before.shape)
        f_after = _factors(after[scale_key], q_after.shape)
        assert torch.equal(q_before * f_before, q_after * f_after), weight_key  # the same real values
        moved = f_before != f_after
        assert torch.equal(f_before[moved], 2 * f_after[moved]), weight_key
        assert torch.equal(q_after[moved], 2 * q_before[moved]), weight_key
        # Of scales from the amax, exactly the blocks whose largest value is at most 224 move (with power-of-two
        # scales it is then 224); with exact scales, or the stored scales of delayed scaling, none does.
        module = weight_key.removesuffix(".weight")
        static = any(f"{module}.{name}" in before for name in ("activation_scale", "input_scale"))
        if static or _exact_scales(before[scale_key]):
            assert not moved.any(), weight_key
        else:
            assert torch.equal(moved, _block_max(q_before.abs(), before[scale_key]) <= 224), weight_key


# --- refusals: nothing written, the weights named ---------------------------------------------------------

def _weight(key: str, recipe, experts: bool = False, static: bool = False, dtype=torch.float8_e4m3fn):
    shape = (2, 128, 128) if experts else (128, 128)
    return TrainedWeight(key, key.rsplit(".", 1)[0], recipe, torch.zeros(shape, dtype=dtype), torch.ones(()),
                         torch.ones(()) if static else None)


def test_an_export_over_an_earlier_checkpoint_replaces_its_weight_files(tmp_path):
    """transformers loads a folder's model.safetensors before an index: an earlier export's must not stay."""
    compiled, first, _, _ = _train_and_export("llama-delayed", str(tmp_path))
    assert first.files == ["model.safetensors", "config.json"]
    model = compiled._orig_mod
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2)  # a weight kept in high precision: written as it is
    resharded = fp8graph.save_fp8(compiled, str(tmp_path), max_shard_size="100KB")
    assert len(resharded.files) > 3 and "model.safetensors" not in resharded.files
    assert sorted(os.listdir(tmp_path)) == sorted(resharded.files)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.float())
    fp8graph.save_fp8(compiled, str(tmp_path))  # and back to one file: the shards and their index go
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_a_format_refuses_what_it_cannot_hold_naming_the_weights():
    rowwise = _weight("a.q.weight", PRESETS["rowwise"])
    with pytest.raises(UnsupportedExport, match=r"row-wise scales .*compressed-tensors.*a\.q\.weight"):
        FORMATS["fp8"].check([rowwise])
    for recipe in ("block", "mxfp8"):  # block scales: one name in every engine
        assert choose_format([_weight("a.q.weight", PRESETS[recipe])], None).name == "fp8"
    assert choose_format([_weight("a.k.weight", PRESETS["current"])], None).name == "compressed-tensors"
    mixed = [_weight("a.q.weight", PRESETS["block"]), _weight("a.k.weight", PRESETS["current"])]
    with pytest.raises(UnsupportedExport, match="one block size and one activation scheme"):
        FORMATS["fp8"].check(mixed)
    # compressed-tensors holds a group per recipe, but transformers reads every module with its first group's
    # scheme: a checkpoint of 128x128 block scales beside another strategy's did not load back.
    for other in ("current", "rowwise"):
        with pytest.raises(UnsupportedExport, match=r"cannot read 128x128 block scales beside another.*a\.q\.weight"):
            FORMATS["compressed-tensors"].check([mixed[0], _weight("a.k.weight", PRESETS[other])])
    with pytest.raises(UnsupportedExport, match="no FP8 checkpoint format holds"):
        choose_format(mixed, None)
    per_tensor_and_rows = [_weight("a.q.weight", PRESETS["rowwise"]), _weight("a.k.weight", PRESETS["current"])]
    assert choose_format(per_tensor_and_rows, None).name == "compressed-tensors"
    with pytest.raises(UnsupportedExport, match=r"MXFP8 .*format='fp8'"):
        FORMATS["compressed-tensors"].check([_weight("a.q.weight", PRESETS["mxfp8"])])
    for name in FORMATS:
        with pytest.raises(UnsupportedExport, match=r"float8_e5m2 weights.*a\.q\.weight"):
            FORMATS[name].check([_weight("a.q.weight", PRESETS["current"], dtype=torch.float8_e5m2)])
        with pytest.raises(UnsupportedExport, match=r"delayed scaling of expert weights.*m\.experts\.down_proj"):
            FORMATS[name].check([_weight("m.experts.down_proj", PRESETS["delayed"], experts=True, static=True)])
    with pytest.raises(UnsupportedExport, match="no FP8 checkpoint format holds"):
        choose_format([rowwise, _weight("a.k.weight", PRESETS["mxfp8"])], None)
    with pytest.raises(ValueError, match="unknown FP8 checkpoint format 'gguf'"):
        choose_format([rowwise], "gguf")


def test_export_refuses_a_model_not_yet_called_and_a_weight_no_loader_converts(tmp_path):
    model = build_zoo_model("gpt2", torch.bfloat16)  # GPT-2's Conv1D: FP8 in training, no FP8 loader swaps it
    compiled = fp8graph.compile(model, compiler="aot_eager")
    with pytest.raises(ValueError, match="has not been called since it was compiled"):
        fp8graph.save_fp8(compiled, str(tmp_path))
    compiled(**zoo_inputs("gpt2")).loss.backward()
    with pytest.raises(ValueError, match=r"not held by an nn\.Linear .*transformer\.h\.0\.attn\.c_attn\.weight"):
        fp8graph.save_fp8(compiled, str(tmp_path))
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="fp8graph export needs the model fp8graph.compile returned"):
        fp8graph.save_fp8(model, str(tmp_path))
    by_string = torch.compile(model, backend="fp8", options={"compiler": "aot_eager"})
    with pytest.raises(TypeError, match=r"torch\.compile\(\.\.\., backend='fp8'\) keeps no such record\): got "
                                        r"OptimizedModule"):
        fp8graph.save_fp8(by_string, str(tmp_path))


def test_a_tied_head_in_fp8_is_refused_naming_every_module_holding_it(tmp_path):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    compiled = fp8graph.compile(model, compiler="aot_eager")  # lm_head's site in FP8
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled(tokens, labels=tokens).loss.backward()
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight \(tied: held by lm_head, model\.embed_tokens\)"
                                         r".*each module holding it"):
        fp8graph.save_fp8(compiled, str(tmp_path))


def test_load_keeps_what_transformers_leaves_unconverted():
    """An "fp8" checkpoint's modules_to_not_convert, as transformers matches it: from the start of the path
    up to a module boundary (the module and its subtree), or as the path's tail."""
    from fp8graph.export.load import _not_converted

    gate, layer = _not_converted("mlp.gate"), _not_converted("model.layers.0")
    assert gate.fullmatch("model.layers.3.mlp.gate") and not gate.fullmatch("model.layers.3.mlp.gate_proj")
    assert layer.fullmatch("model.layers.0.mlp.up_proj") and not layer.fullmatch("model.layers.01.mlp.up_proj")


def test_the_export_command_writes_a_transformers_checkpoint_as_fp8graph_would_train_it(tmp_path, capsys):
    from fp8graph.__main__ import main

    model = build_zoo_model("llama", torch.bfloat16, **SHAPE)
    model.save_pretrained(tmp_path / "bf16")
    assert main(["export", str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--recipe", "block"]) == 0
    printed = capsys.readouterr().out
    assert "fp8graph export: 7 FP8 weights" in printed and "format 'fp8'" in printed
    assert f"from_pretrained({str(tmp_path / 'fp8')!r})" in printed
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [128, 128] and config["modules_to_not_convert"] == ["lm_head"]
    loaded = _load_with_transformers(str(tmp_path / "fp8"), "fp8")
    original = model.state_dict()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # within a block's FP8 error of the BF16 weights
        key = f"model.layers.0.self_attn.{name}.weight"
        assert sqnr_db(original[key].float(), loaded.state_dict()[key]) > 25.0, key
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "bf16"), str(tmp_path / "x"), "--recipe", "delayed"])  # scales from training


def test_the_export_command_compiles_one_region_for_every_layer(tmp_path, caplog):
    """Its call runs without a KV cache, which would tell the layers apart and compile each anew."""
    from fp8graph.__main__ import main
    from fp8graph.models import build

    build("llama", "tiny", seed=0).save_pretrained(tmp_path / "bf16")  # two layers
    with caplog.at_level("WARNING", logger="fp8graph"):
        assert main(["export", str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--recipe", "current"]) == 0
    assert "compiled again" not in caplog.text


def test_an_export_with_no_weight_in_fp8_is_refused_with_each_reason(tmp_path, capsys):
    """The tiny Llama's 64-wide weights are not whole 128x128 blocks: block scaling keeps every one, and an
    FP8 checkpoint of it would hold no FP8 weight."""
    from fp8graph.__main__ import main
    from fp8graph.models import build

    build("llama", "tiny", seed=0).save_pretrained(tmp_path / "bf16")
    assert main(["export", str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--recipe", "block"]) == 1
    error = capsys.readouterr().err
    assert "no weight of the model runs in FP8" in error and "model.layers.0.self_attn.q_proj.weight" in error
    assert "lm_head.weight" in error and not (tmp_path / "fp8").exists()
