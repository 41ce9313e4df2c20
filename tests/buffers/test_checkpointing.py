"""Sites inside torch.utils.checkpoint regions (HF gradient checkpointing) are found and rewritten."""

import functools
import math

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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


def _delayed_training(checkpointing: bool, steps: int, compiler: str = "aot_eager"):
    """``steps`` SGD steps with delayed scaling; returns losses, the FP8 state and the decisions."""
    model = build("llama", "tiny")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler=compiler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 250, (2, 16), generator=generator)
        loss = compiled(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items() if "fp8graph_" in k}
    return losses, state, compiled.fp8graph_backend.decisions


def test_delayed_scaling_inside_checkpoint_regions_records_each_amax_once():
    """Recomputing a checkpointed forward in backward must neither record its
    amaxes a second time nor cast with scales the first forward did not use:
    histories, scales and losses equal those of the same model without checkpointing."""
    plain_losses, plain_state, _ = _delayed_training(checkpointing=False, steps=3)
    losses, state, decisions = _delayed_training(checkpointing=True, steps=3)
    inside = [d for d in decisions if d.site.in_subgraph]
    assert len(inside) == 14 and all(d.rewritten and d.recipe.name.startswith("delayed") for d in inside)
    assert losses == plain_losses
    assert state.keys() == plain_state.keys() and len(state) == 56
    for name, value in plain_state.items():
        assert torch.equal(state[name], value), name
    # Three steps into a length-4 history: three amaxes per role, one slot still empty.
    for name, rows in (("amax_history", 2), ("grad_output_amax_history", 1)):
        history = state[f"model.layers.1.mlp.down_proj.fp8graph_{name}_weight"]
        assert (history > 0).sum(dim=1).tolist() == [3] * rows


def test_under_the_eager_compiler_delayed_sites_in_checkpoint_regions_are_kept_with_the_reason():
    """Without AOTAutograd the state snapshots cannot hold: autograd saves the state the region's casts read, the
    forward's update writes it in place, and the backward's replay failed its version check ("modified by an
    inplace operation"). Those sites stay in high precision, saying why, and training runs; explain of a model
    compiled with aot_eager decides as that compiler does."""
    losses, _, decisions = _delayed_training(checkpointing=True, steps=2, compiler="eager")
    inside = [d for d in decisions if d.site.in_subgraph]
    assert len(inside) == 14 and not any(d.rewritten for d in inside)
    assert all("checkpoint region under compiler='eager'" in d.reason for d in inside)
    assert all(math.isfinite(loss) for loss in losses)
    model = build("llama", "tiny")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    # explain traces with fp8graph's eager compiler, deciding as the compiled model's aot_eager does
    assert not any("compiler='eager'" in (record.reason or "") for record in fp8graph.explain(compiled, TOKENS))


@pytest.mark.inductor
def test_delayed_scaling_in_a_checkpoint_region_matches_plain_under_inductor():
    """The same check through Inductor's partitioner, on a small MLP whose gradients are exact."""
    results = []
    for config in ("tiny", "tiny-checkpointed"):
        torch.manual_seed(0)
        model = build("mlp", config)
        compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(2)
        outputs = []
        for _ in range(4):
            output = compiled(torch.randn(32, 64, generator=generator))
            output.sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            outputs.append(output.detach())
        results.append((outputs, {k: v.clone() for k, v in model.state_dict().items() if "fp8graph_" in k}))
    (plain_outputs, plain_state), (outputs, state) = results
    assert all(torch.equal(a, b) for a, b in zip(outputs, plain_outputs))
    assert state.keys() == plain_state.keys() and len(state) == 8
    for name, value in plain_state.items():
        assert torch.equal(state[name], value), name
    assert (state["up.fp8graph_amax_history_weight"] > 0).sum(dim=1).tolist() == [4, 4]
    assert (state["up.fp8graph_grad_output_amax_history_weight"] > 0).sum(dim=1).tolist() == [4]


def test_stats_reach_sites_inside_checkpoint_regions():
    model = build("llama", "tiny")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = fp8graph.compile(model, compiler="aot_eager", stats=True)
    compiled(TOKENS, labels=TOKENS).loss.backward()
    rows = compiled.fp8graph_stats.record(step=0)
    recorded = {(row.path, row.role): row for row in rows}
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        for role in ("input", "weight", "grad_output"):
            assert recorded[path, role].amax > 0 and recorded[path, role].sqnr_db > 20, (path, role)


class _SelectivelyCheckpointed(torch.nn.Module):
    """A region with the user's own selective-checkpoint policy (saves every matmul)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        def save_matmuls(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        return torch.utils.checkpoint.checkpoint(self.proj, x, use_reentrant=False, context_fn=context_fn)


def test_delayed_scaling_in_a_region_with_its_own_context_fn_is_kept_with_its_reason():
    model = _SelectivelyCheckpointed()
    compiled = fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager")
    compiled(torch.randn(16, 64)).sum().backward()
    (decision,) = compiled.fp8graph_backend.decisions
    assert not decision.rewritten and "its own context_fn" in decision.reason
    strict = fp8graph.Policy(rules=[("proj", DelayedScaling(amax_history_len=4))], strict=True)
    with pytest.raises(Exception, match="proj .*its own context_fn"):  # Dynamo wraps it
        fp8graph.compile(_SelectivelyCheckpointed(), policy=strict, compiler="aot_eager")(torch.randn(16, 64))
