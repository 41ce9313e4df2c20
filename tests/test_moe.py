"""Mixture-of-experts families train in FP8 with every expert GEMM rewritten: 50 AdamW steps of fp8graph's
row-wise recipe (the native SM90 form of the expert GEMMs) against eager BF16, from tiny configs, on real English
bytes (a new batch each step, the same batches for both).

The loss of every step within 3% of eager's; the routers kept in high precision. The default per-tensor policy
on the same families is the zoo's (``tests/test_zoo.py``: one step, logits' SQNR, every expert GEMM rewritten).
"""

import pytest
import torch

from fp8graph import Float8RowwiseScaling
from fp8graph.models.zoo import build_zoo_model, expert_paths, train_against_eager

LOSS_MARGIN = 0.03


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "olmoe", "gpt_oss"])
def test_moe_family_trains_in_fp8_with_every_expert_gemm_rewritten(family):
    fp8_losses, eager_losses, decisions = train_against_eager(family, Float8RowwiseScaling(), steps=50)
    experts = [d for d in decisions if d.site.is_experts]
    assert {d.site.path for d in experts} == set(expert_paths(build_zoo_model(family, torch.bfloat16)))
    assert experts and all(d.rewritten for d in experts), [d.reason for d in experts]
    routers = [d for d in decisions if d.site.gate is not None]
    assert routers and not any(d.rewritten for d in routers)
    deltas = [abs(a - b) / b for a, b in zip(fp8_losses, eager_losses)]
    assert max(deltas) <= LOSS_MARGIN, (max(deltas), fp8_losses[-1], eager_losses[-1])
    assert sum(fp8_losses[-5:]) < 0.8 * sum(fp8_losses[:5]), "it learns"
