"""The buffers fp8graph adds to a user's model: added all or none, anchored by hooks that copy and save with it."""

import copy
import io

import pytest
import torch

import fp8graph
from fp8graph import DelayedScaling
from fp8graph.buffers.anchors import AnchorHook, NewBuffer, register_new_buffers


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _fp8graph_buffers(model):
    return sorted(name for name, _ in model.named_buffers() if "fp8graph" in name)


def test_new_buffers_are_registered_all_or_none():
    first, second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    second.register_buffer("taken", torch.zeros(1))
    new = [NewBuffer(first, "first", "taken", torch.ones(1), persistent=True),
           NewBuffer(second, "second", "taken", torch.ones(1), persistent=True)]
    with pytest.raises(ValueError, match=r"second\.taken already exists: compile once"):
        register_new_buffers(new, if_taken="compile once")
    assert not hasattr(first, "taken")
    with pytest.raises(ValueError, match=r"first\.twice already exists"):
        register_new_buffers([NewBuffer(first, "first", "twice", torch.ones(1), True)] * 2, if_taken="")
    assert not hasattr(first, "twice")


@pytest.mark.parametrize("options,taken", [
    ({"policy": DelayedScaling()}, "fp8graph_grad_output_scale_weight"),
    ({"cache_weights": True}, "fp8graph_cached_weight_scale_weight"),
    ({"stats": True}, "fp8graph_stats"),
])
def test_a_refused_compile_leaves_the_model_as_it_was(options, taken):
    """The last module's last buffer name is taken: nothing is added to the modules before it."""
    model = _mlp()
    model[2].register_buffer(taken, torch.zeros(1))
    buffers_before = _fp8graph_buffers(model)
    hooks_before = [dict(module._forward_hooks) for module in model.modules()]
    with pytest.raises(ValueError, match=rf"2\.{taken} already exists"):
        fp8graph.compile(model, compiler="aot_eager", **options)
    assert _fp8graph_buffers(model) == buffers_before
    assert [dict(module._forward_hooks) for module in model.modules()] == hooks_before


@pytest.mark.parametrize("options", [{"policy": DelayedScaling(amax_history_len=4)}, {"cache_weights": True},
                                     {"stats": True}], ids=["delayed", "cache_weights", "stats"])
def test_the_user_model_saves_and_deep_copies_after_compiling(options):
    model = _mlp()
    compiled = fp8graph.compile(model, compiler="aot_eager", **options)
    compiled(torch.randn(16, 32)).sum().backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for restored in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert _fp8graph_buffers(restored) == _fp8graph_buffers(model)
        restored_hooks = [hook for module in restored.modules() for hook in module._forward_hooks.values()]
        assert restored_hooks and all(isinstance(hook, AnchorHook) for hook in restored_hooks)
        # Each copied hook reads the copy's buffers, never the original's.
        originals = {id(buffer) for buffer in model.buffers()}
        for hook in restored_hooks:
            for owner, names in hook.sources:
                if owner is not None:
                    assert all(id(getattr(owner, name)) not in originals for name in names)
        x = torch.randn(4, 32)
        torch.testing.assert_close(restored(x), model(x), rtol=0, atol=0)


def test_a_deep_copy_trains_its_own_delayed_state():
    model = _mlp()
    policy = DelayedScaling(amax_history_len=4)
    fp8graph.compile(model, policy=policy, compiler="aot_eager")(torch.randn(16, 32)).sum().backward()
    history_before = model[0].fp8graph_amax_history_weight.clone()
    twin = copy.deepcopy(model)
    fp8graph.compile(twin, policy=policy, compiler="aot_eager")(torch.randn(16, 32) * 10).sum().backward()
    assert torch.equal(model[0].fp8graph_amax_history_weight, history_before)
    assert not torch.equal(twin[0].fp8graph_amax_history_weight, history_before)
    assert twin[0].fp8graph_amax_history_weight[0, 0] > 5  # the copy's own input amax, recorded in its own buffer
