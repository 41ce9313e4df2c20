"""On an FP8 GPU: the export served by transformers' FP8 kernels, not dequantized.

    tiny Qwen3-MoE (hidden 128), trained one step by fp8graph (Inductor, _scaled_mm) -> save_fp8
      -> transformers.from_pretrained on the GPU: FineGrainedFP8's FP8Linear / FP8Experts, its own kernels
      -> logits against fp8graph's FP8 inference of the trained model: both cast activations to FP8, with
         different kernels and activation tiles, so within FP8's error, not bit for bit

Run by ``scripts/gpu-run export``; skipped without a CUDA GPU with FP8.
"""

import pytest
import torch
import transformers

import fp8graph
from fp8graph.models.zoo import build_zoo_model, zoo_inputs
from fp8graph.recipes.scaling import PRESETS
from helpers import sqnr_db

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32, num_key_value_heads=4)


@pytest.mark.parametrize("recipe", ["block", "current"])
def test_transformers_fp8_kernels_serve_the_export_as_fp8graph_infers(recipe, tmp_path):
    model = build_zoo_model("qwen3_moe", torch.bfloat16, **SHAPE).cuda()
    policy = fp8graph.Policy(default=PRESETS[recipe], rules=[("lm_head", None)])
    compiled = fp8graph.compile(model, policy=policy)
    inputs = {k: v.cuda() for k, v in zoo_inputs("qwen3_moe", batch=2, sequence=64).items()}
    compiled(**inputs).loss.backward()
    model.eval()
    with torch.no_grad():
        logits_fp8 = compiled(**inputs).logits.float()
    fp8graph.save_fp8(compiled, str(tmp_path))
    served = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map="cuda").eval()
    assert any(type(m).__name__ == "FP8Linear" for m in served.modules())  # its FP8 layers, not dequantized
    with torch.no_grad():
        logits_served = served(**inputs).logits.float()
    assert sqnr_db(logits_fp8, logits_served) > 20.0
