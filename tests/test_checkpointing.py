"""Sites inside torch.utils.checkpoint regions (HF gradient checkpointing) are found and rewritten."""

import torch

import fp8graph
from fp8graph import DelayedScaling
from fp8graph.models import build

TOKENS = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))


def _grads(checkpointing: bool):
    model = build("llama", "tiny")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = fp8graph.compile(model, compiler="aot_eager")
    compiled(TOKENS, labels=TOKENS).loss.backward()
    decisions = compiled.fp8graph_backend.decisions
    return {n: p.grad for n, p in model.named_parameters()}, decisions


def test_checkpointed_layers_run_in_fp8_with_the_same_gradients():
    plain, _ = _grads(checkpointing=False)
    checkpointed, decisions = _grads(checkpointing=True)
    inside = [d for d in decisions if d.site.in_subgraph]
    assert len(inside) == 14 and all(d.rewritten for d in inside)  # every decoder projection
    # Current scaling keeps no state: recomputing the forward gives the same casts.
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7)


def test_delayed_scaling_inside_checkpoint_regions_is_kept_with_its_reason():
    model = build("llama", "tiny")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    compiled(TOKENS, labels=TOKENS).loss.backward()
    inside = [d for d in compiled.fp8graph_backend.decisions if d.site.in_subgraph]
    assert len(inside) == 14
    assert all(not d.rewritten and "torch.utils.checkpoint" in d.reason for d in inside)
