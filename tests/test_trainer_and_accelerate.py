"""HuggingFace's ways to train: accelerate's Accelerator here; Trainer in docs/training-and-checkpoints.md (run by
tests/test_docs.py)."""

import inspect

import torch

import fp8graph
from fp8graph.models import build


def test_the_compiled_model_shows_the_signature_the_trainer_reads():
    """Trainer keeps the dataset columns ``inspect.signature(model.forward)`` names; ``(*args, **kwargs)``
    would drop them all."""
    for options in ({}, {"cache_weights": True}):  # with and without forward wrappers
        compiled = fp8graph.compile(build("llama", "tiny"), compiler="aot_eager", **options)
        parameters = inspect.signature(compiled.forward).parameters
        assert {"input_ids", "attention_mask", "labels"} <= set(parameters), options


def test_accelerate_prepares_and_trains_the_compiled_model_in_fp8():
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = build("llama", "tiny")
    compiled = fp8graph.compile(model, compiler="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=True)
    prepared, optimizer = accelerator.prepare(compiled, optimizer)
    weight_before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    for _ in range(2):
        ids = torch.randint(0, 250, (4, 16))
        loss = prepared(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, weight_before)
    assert sum(decision.rewritten for decision in compiled.fp8graph_backend.decisions) == 14
