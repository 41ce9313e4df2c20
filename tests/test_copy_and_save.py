"""Copying, saving and nesting a compiled model, as a plain torch.compile model allows.

A copy (deepcopy, pickle, torch.save) of ``fp8graph.compile(model)`` is the same compile of the copied model:
it computes what the original computes, owns its buffers, and trains on without touching the original.
"""

import copy
import io
import pickle

import pytest
import torch

import fp8graph
from fp8graph import DelayedScaling, Policy
from fp8graph.compiled_module import CompiledFP8Module

OPTIONS = {
    "current": {},  # the weights' FP8 copies kept between calls (cache_weights="auto")
    "uncached": {"cache_weights": False},
    "delayed": {"policy": Policy(default=DelayedScaling(amax_history_len=4))},
    "stats": {"stats": True},
}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _saved_and_loaded(compiled):
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda obj: pickle.loads(pickle.dumps(obj)), "torch.save": _saved_and_loaded}
# Plain pickle of a float8 tensor fails in torch itself (its storage pickling needs a typed storage;
# torch.save writes the dtype): a model holding FP8 weight copies is saved with torch.save or deep-copied.
HOLDS_FP8_COPIES = {"current", "delayed", "stats"}
CASES = [(options, how) for options in OPTIONS for how in COPIES
         if not (options in HOLDS_FP8_COPIES and how == "pickle")]


@pytest.mark.parametrize("options,how", CASES)
def test_a_copied_or_saved_compiled_model_computes_the_same_and_trains_on_its_own(options, how):
    compiled = fp8graph.compile(_mlp(), compiler="aot_eager", **OPTIONS[options])
    x = torch.randn(16, 32)
    compiled(x).sum().backward()
    original_state = {name: value.clone() for name, value in compiled._orig_mod.state_dict().items()}
    twin = COPIES[how](compiled)
    assert isinstance(twin, CompiledFP8Module) and twin._orig_mod is not compiled._orig_mod
    with torch.no_grad():
        torch.testing.assert_close(twin(x), compiled(x), rtol=0, atol=0)
    twin(x * 10).sum().backward()  # trains the twin's parameters and state only
    assert all(param.grad is not None for param in twin.parameters())
    for name, value in compiled._orig_mod.state_dict().items():
        assert torch.equal(value, original_state[name]), name
    assert len(fp8graph.explain(twin, x)) == 2  # the copy is an fp8graph compile: explain reads its decisions


def test_a_copy_fills_its_weight_copies_before_reading_them():
    compiled = fp8graph.compile(_mlp(), compiler="aot_eager", cache_weights=True)
    x = torch.randn(16, 32)
    with torch.no_grad():
        compiled(x)  # fills
        expected = compiled(x)  # reuses
    twin = copy.deepcopy(compiled)
    with torch.no_grad():
        for module in twin._orig_mod.modules():  # what the twin would read if it trusted the copied cache
            if hasattr(module, "fp8graph_cached_weight_weight"):
                module.fp8graph_cached_weight_weight.zero_()
        torch.testing.assert_close(twin(x), expected, rtol=0, atol=0)


def test_compiling_a_compiled_model_again_is_refused_with_what_to_do():
    model = _mlp()
    for compiled in (torch.compile(model), fp8graph.compile(model)):
        with pytest.raises(ValueError, match=r"already compiled by (torch|fp8graph)\.compile.*model\._orig_mod"):
            fp8graph.compile(compiled)


def test_torch_compile_of_a_compiled_model_is_refused_at_its_first_call():
    outer = torch.compile(fp8graph.compile(_mlp(), compiler="aot_eager"), backend="eager")
    with pytest.raises(ValueError, match=r"would compile the model again without fp8graph.*call fp8graph\.compile's"):
        outer(torch.randn(16, 32))


def test_a_compiled_model_inside_a_torch_compiled_parent_runs_in_fp8():
    model = _mlp()
    compiled = fp8graph.compile(model, compiler="aot_eager")
    parent = torch.compile(torch.nn.Sequential(compiled, torch.nn.ReLU()), backend="eager")
    x = torch.randn(16, 32)
    output = parent(x)
    torch.testing.assert_close(output, torch.relu(compiled(x)), rtol=0, atol=0)
    assert not torch.allclose(output, torch.relu(model(x)), rtol=0, atol=1e-3)  # not the high-precision model
    decisions = vars(compiled)["fp8graph_backend"].decisions  # one graph, casting per call, called twice
    assert len(decisions) == 2 and {d.site.path for d in decisions if d.rewritten} == {"0", "2"}


@pytest.mark.parametrize("flag", ["stats", "freeze_weights", "cache_weights", "fp8_all_gather"])
def test_flags_must_be_booleans(flag):
    allowed = "True, False or 'auto'" if flag == "cache_weights" else "True or False"
    with pytest.raises(TypeError, match=rf"{flag} must be {allowed}, got 'false'"):
        fp8graph.compile(_mlp(), **{flag: "false"})


def test_the_state_dict_is_torch_compiles_and_loads_from_either_form():
    """``state_dict()`` keys the model's tensors under ``_orig_mod.``, as ``torch.compile``'s wrapper does (what
    ``torch.distributed.checkpoint`` requires of a compiled module); ``load_state_dict`` takes those keys and the
    model's own."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _mlp()
    compiled = fp8graph.compile(model, compiler="aot_eager", policy=OPTIONS["delayed"]["policy"])
    compiled(torch.randn(16, 32)).sum().backward()
    own = model.state_dict()  # delayed scaling's amax histories and scales included
    assert any("fp8graph_amax_history" in key for key in own)
    assert list(compiled.state_dict()) == [f"_orig_mod.{key}" for key in own]
    assert get_model_state_dict(compiled).keys() == own.keys()
    twin = fp8graph.compile(_mlp(), compiler="aot_eager", policy=OPTIONS["delayed"]["policy"])
    with torch.no_grad():
        twin(torch.randn(16, 32))
    for saved in (compiled.state_dict(), own):
        for value in twin._orig_mod.state_dict().values():  # detached views of the twin's tensors
            value.zero_()
        result = twin.load_state_dict(saved)
        assert not result.missing_keys and not result.unexpected_keys
        for key, value in twin._orig_mod.state_dict().items():
            assert torch.equal(value, own[key]), key
    with pytest.raises(RuntimeError, match="Missing key"):
        twin.load_state_dict({})  # strict, as the model's own


def test_a_module_holding_the_compiled_model_saves_and_loads_it():
    """A parent's state_dict has the compiled model's tensors under its name and ``_orig_mod.``; the parent's
    load_state_dict takes those keys, and the model's own under the parent's name."""
    parent, twin = torch.nn.Module(), torch.nn.Module()
    parent.child = fp8graph.compile(_mlp(), compiler="aot_eager")
    twin.child = fp8graph.compile(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                      torch.nn.Linear(64, 32)), compiler="aot_eager")
    state = parent.state_dict()
    assert sorted(state) == [f"child._orig_mod.{key}" for key in ("0.bias", "0.weight", "2.bias", "2.weight")]
    for saved in (state, {key.replace("_orig_mod.", ""): value for key, value in state.items()}):
        for value in twin.state_dict().values():
            value.zero_()
        result = twin.load_state_dict(saved)
        assert not result.missing_keys and not result.unexpected_keys
        for key, value in twin.state_dict().items():
            assert torch.equal(value, state[key]), key
