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


class _Bytes(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        ids = torch.randint(0, 250, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def _trainer(compiled, output_dir, **arguments):
    from transformers import Trainer, TrainingArguments

    arguments = TrainingArguments(output_dir=output_dir, max_steps=2, per_device_train_batch_size=4, report_to=[],
                                  use_cpu=True, **arguments)
    return Trainer(model=compiled, args=arguments, train_dataset=_Bytes())


def test_trainer_checkpoints_resume_and_load_with_from_pretrained_given_the_key_mapping(tmp_path):
    """The Trainer saves ``model.state_dict()`` of the model it trains through ``save_pretrained``: the compiled
    model's keys, under ``_orig_mod.`` as ``torch.compile``'s are. Resuming loads them back;
    ``from_pretrained`` loads them with ``key_mapping`` (docs/training-and-checkpoints.md)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = build("llama", "tiny")
    _trainer(fp8graph.compile(model, compiler="aot_eager"), str(tmp_path), save_strategy="steps",
             save_steps=2).train()
    trained = {name: value.clone() for name, value in model.state_dict().items()}
    checkpoint = tmp_path / "checkpoint-2"

    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, key_mapping={r"^_orig_mod\.": ""})
    assert loaded.state_dict().keys() == trained.keys()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), name

    torch.manual_seed(1)
    fresh = build("llama", "tiny")
    assert not torch.equal(fresh.model.layers[0].mlp.up_proj.weight, trained["model.layers.0.mlp.up_proj.weight"])
    _trainer(fp8graph.compile(fresh, compiler="aot_eager"), str(tmp_path / "resumed"),
             save_strategy="no").train(resume_from_checkpoint=str(checkpoint))  # step 2 of 2: loads, trains none
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, trained[name]), name
