"""The module :func:`fp8graph.compile` returns: ``torch.compile``'s wrapper, made to copy, nest and save as the
user's model does."""

from __future__ import annotations

import functools
import inspect

import torch

_WRAPPER_PREFIX = "_orig_mod."


def make_compiled_fp8_module(compiled, user_model, compile_again: functools.partial) -> None:
    """Turn ``torch.compile``'s module into a :class:`CompiledFP8Module`: it copies by compiling again
    (``compile_again(module)``: ``fp8graph.compile`` with the options it was compiled with), runs in FP8 inside an
    enclosing ``torch.compile``, and shows the user's forward's signature."""
    object.__setattr__(compiled, "forward", _called_as_a_compiled_unit(compiled.forward, user_model))
    object.__setattr__(compiled, "_fp8graph_compile_again", compile_again)
    object.__setattr__(compiled, "__class__", CompiledFP8Module)
    # torch.compile of a compiled module compiles the innermost callable this names (the user's
    # forward, which would run in high precision): name one that refuses, saying what to do.
    object.__setattr__(compiled, "_torchdynamo_orig_callable", _refuse_compiling_again)
    # Its load_state_dict, or a parent's reaching it, takes the model's own keys too: they go where the wrapper's are.
    compiled._register_load_state_dict_pre_hook(_keys_under_the_wrapper)


def _keys_under_the_wrapper(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                            error_msgs) -> None:
    """``load_state_dict`` reaches the model through the wrapper's ``_orig_mod``: keys saved from the model itself
    (``prefix + key``) are moved under ``prefix + "_orig_mod."``, where it looks."""
    for key in [key for key in state_dict if key.startswith(prefix)
                and not key.startswith(prefix + _WRAPPER_PREFIX)]:
        state_dict[prefix + _WRAPPER_PREFIX + key.removeprefix(prefix)] = state_dict.pop(key)


def _refuse_compiling_again(*args, **kwargs):
    raise ValueError(
        "torch.compile(fp8graph.compile(model)) would compile the model again without fp8graph and run it in high "
        "precision: call fp8graph.compile's model directly (it is compiled), and give fp8graph.compile the "
        "torch.compile options (mode=..., dynamic=..., fullgraph=...), which it passes on")


class CompiledFP8Module(torch._dynamo.eval_frame.OptimizedModule):
    """What :func:`fp8graph.compile` returns for an ``nn.Module``: ``torch.compile``'s wrapper, copied as it is.

    ``torch.compile``'s wrapper pickles as its module and its compile settings,
    never its compiled code. This one does the same with fp8graph's: a copy
    (``copy.deepcopy``, ``pickle``, ``torch.save``) is ``fp8graph.compile`` of the
    copied module with the options the original was compiled with. The module
    brings its buffers (delayed-scaling state, stats buffers, FP8 weight copies)
    and the hooks that anchor them, which the new compile adopts; the copy's
    graphs compile at its first call, its stats rows start empty and its weight
    copies are filled again before they are read.

    Its ``state_dict()`` is ``torch.compile``'s: the model's keys under ``_orig_mod.``, which
    ``torch.distributed.checkpoint`` requires of a compiled module. Its ``load_state_dict``, and a parent's
    reaching it, also take the model's own keys, as the model's ``state_dict()`` writes them.
    """

    def __reduce__(self):
        return vars(self)["_fp8graph_compile_again"], (self._orig_mod,)


def _called_as_a_compiled_unit(forward, user_model):
    """The compiled model's outermost forward: what an enclosing ``torch.compile`` calls, and what
    ``inspect.signature`` reads.

    An enclosing ``torch.compile`` would trace through the model's own compiled
    forward, which it inlines in high precision. Disabled for Dynamo, the call
    breaks the enclosing graph; inside it fp8graph's compile of the model sets
    its own backend again and runs the model in FP8. The signature is the user's forward's, so
    callers that pick arguments by it (HuggingFace's ``Trainer`` drops the
    dataset columns the model's forward does not name) see the model's.
    """
    def forward_fp8(*args, **kwargs):
        return forward(*args, **kwargs)

    forward_fp8.__signature__ = inspect.signature(user_model.forward)
    return torch._dynamo.disable(forward_fp8, recursive=True,
                                 reason="fp8graph.compile's model: it runs its own FP8 compile")
