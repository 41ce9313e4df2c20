"""Regional compilation: each repeated block compiled once, every behaviour as in a whole-model compile.

The reference for every numeric check is ``fp8graph.compile(..., regions=None)`` (one graph, the
behaviour the rest of the suite pins) with the same initial weights and batches, run by fp8graph's ``eager``
compiler (``REFERENCE``): the regions' ``aot_eager`` and it run the same ATen ops, so losses, gradients and
recipe state must agree exactly, and the reference costs no AOTAutograd trace. What these
tests prove: which blocks become regions, that one compile serves every instance (graph counts),
and that policies, state, stats, weight caches, checkpointing and reports stay per instance. They
do not measure compile time (``python -m bench compile --deep`` does).
"""

import copy
import io
import logging
import pickle

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import forked
import fp8graph
from fp8graph import DelayedScaling, Float8CurrentScaling, Policy
from fp8graph.models import build
from fp8graph.models.text_data import TextBatches
from fp8graph.regions.regional_compile import block_class
from fp8graph.regions.repeated_blocks import find_blocks, group_blocks


# The whole-model reference's compiler: the same rewritten graph and ATen ops as aot_eager, without its trace.
REFERENCE = "eager"


def _llama(layers=3):
    return build("llama", "tiny", num_hidden_layers=layers)


def _train(model, steps=3, regions="auto", use_cache=None, compiler="aot_eager", **kwargs):
    """Losses, and the model's state after ``steps`` SGD steps on fixed batches."""
    compiled = fp8graph.compile(model, compiler=compiler, regions=regions, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = TextBatches(batch_size=2, seq_len=16, vocab_size=250, seed=0)
    losses = []
    for _ in range(steps):
        tokens = batches.next()
        extra = {} if use_cache is None else {"use_cache": use_cache}
        loss = compiled(tokens, labels=tokens, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return compiled, losses, {name: value.clone() for name, value in model.state_dict().items()}


def _same_training(policy=None, layers=3, **kwargs):
    """Train regional and whole-model copies; assert they agree; return the regional compile."""
    regional, losses, state = _train(_llama(layers), policy=policy, **kwargs)
    _, whole_losses, whole_state = _train(_llama(layers), regions=None, compiler=REFERENCE, policy=policy, **kwargs)
    assert losses == whole_losses
    assert state.keys() == whole_state.keys()
    for name in state:
        assert torch.equal(state[name], whole_state[name]), name
    return regional


def _block_graphs(compiled):
    """Graphs compiled per group of decoder layers (the embedding and final norm are regions of their own)."""
    return [len(backend.graph_modules) for backend in compiled.fp8graph_backend.block_backends
            if backend.group.block_type is LlamaDecoderLayer]


def test_auto_finds_the_decoder_layers_of_a_huggingface_model():
    model = _llama()
    assert [path for path, _ in find_blocks(model)] == [f"model.layers.{i}" for i in range(3)]
    assert find_blocks(model, None) == []


def test_auto_finds_module_lists_of_one_class_and_skips_lists_of_bare_linears():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x):
            return torch.relu(self.proj(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
            self.heads = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
            self.single = torch.nn.ModuleList([Block()])

    assert [path for path, _ in find_blocks(Net())] == ["blocks.0", "blocks.1", "blocks.2"]


def test_explicit_regions_take_classes_or_path_globs_and_refuse_what_matches_nothing():
    model = _llama()
    assert [p for p, _ in find_blocks(model, [LlamaDecoderLayer])] == [f"model.layers.{i}" for i in range(3)]
    # Outermost only: the attention inside a layer is part of the layer's region.
    assert [p for p, _ in find_blocks(model, ["model.layers.*"])] == [f"model.layers.{i}" for i in range(3)]
    assert [p for p, _ in find_blocks(model, ["*.self_attn"])] == [f"model.layers.{i}.self_attn" for i in range(3)]
    with pytest.raises(ValueError, match=r"regions\[0\] \('decoder\.\*'\) matches no submodule"):
        find_blocks(model, ["decoder.*"])
    with pytest.raises(ValueError, match="must be an nn.Module subclass or a glob"):
        find_blocks(model, [3])
    for bad in ("model.layers.*", True, 5):
        with pytest.raises(ValueError, match="regions must be 'auto', None, or a list"):
            find_blocks(model, bad)


def test_a_rule_naming_one_blocks_weightless_submodule_gives_that_block_its_own_group():
    """GPT-2's attention module holds no weight of its own, but its matmuls are sites a path rule may name."""
    model = build("gpt2", "tiny")
    policy = Policy(rules=[("transformer.h.0.attn", Float8CurrentScaling())])
    groups = group_blocks(find_blocks(model), fp8graph.plan(model, policy))
    assert [group.paths for group in groups] == [["transformer.h.0"], ["transformer.h.1"]]
    report = fp8graph.explain(model, torch.randint(0, 100, (2, 16)), policy=policy)
    matmuls = {record.path: record.recipe for record in report if record.path.endswith(".attn")}
    assert matmuls == {"transformer.h.0.attn": Float8CurrentScaling(), "transformer.h.1.attn": None}


def test_instances_the_policy_treats_differently_get_their_own_group():
    model = _llama(4)
    policy = Policy(default=Float8CurrentScaling(), rules=[("model.layers.0.*", None), ("*.3.mlp.*", None)])
    groups = group_blocks(find_blocks(model), fp8graph.plan(model, policy))
    assert [group.paths for group in groups] == [["model.layers.0"], ["model.layers.1", "model.layers.2"],
                                                ["model.layers.3"]]


def test_one_compile_serves_every_layer_and_training_matches_the_whole_model_compile():
    compiled = _same_training()
    assert _block_graphs(compiled) == [1]  # three layers, one graph
    backend = compiled.fp8graph_backend
    paths = [d.site.path for d in backend.decisions if d.site.path.startswith("model.layers.")]
    assert paths == [f"model.layers.{i}.{proj}" for i in range(3) for proj in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert all(d.rewritten for d in backend.decisions if d.site.path.startswith("model.layers."))
    # The head (N=250, not a multiple of 16) is compiled by the root's backend, outside the regions.
    assert {d.site.path: d.reason for d in backend.decisions}["lm_head"] == "N=250 is not a multiple of 16"


def test_a_policy_that_differs_between_instances_is_honoured_per_instance():
    policy = Policy(default=Float8CurrentScaling(), rules=[("model.layers.1.mlp.*", None)])
    compiled = _same_training(policy)
    assert _block_graphs(compiled) == [1, 1]  # layers 0 and 2 share a region, layer 1 has its own
    rewritten = {d.site.path: d.rewritten for d in compiled.fp8graph_backend.decisions}
    assert not rewritten["model.layers.1.mlp.up_proj"] and rewritten["model.layers.1.self_attn.q_proj"]
    assert rewritten["model.layers.0.mlp.up_proj"] and rewritten["model.layers.2.mlp.up_proj"]


def test_a_policy_that_tells_instances_apart_only_once_traced_is_refused():
    def many_tokens_in_layer_0(path, module, site):  # reads M, which only tracing knows, for every layer
        return site.M is not None and site.M >= 32 and path.startswith("model.layers.0.")

    model = _llama()
    compiled = fp8graph.compile(model, policy=Policy(rules=[(many_tokens_in_layer_0, None)]), compiler="aot_eager")
    tokens = torch.randint(0, 250, (2, 16))
    with pytest.raises(Exception, match=r"gives model\.layers\.1\.self_attn\.q_proj .* another recipe than "
                                        r"model\.layers\.0\.self_attn\.q_proj"):
        compiled(tokens, labels=tokens)


def test_a_rule_on_the_token_count_of_one_layer_gives_that_layer_its_own_region():
    """The plan sees the rule read M for layer 0 only: layer 0 is grouped apart and its rule decided when traced."""
    def layer_0_with_many_tokens(path, module, site):
        return path.startswith("model.layers.0.") and site.M is not None and site.M >= 32

    model = _llama()
    compiled = fp8graph.compile(model, policy=Policy(rules=[(layer_0_with_many_tokens, None)]), compiler="aot_eager")
    tokens = torch.randint(0, 250, (2, 16))
    compiled(tokens, labels=tokens)
    groups = [backend.group.paths for backend in compiled.fp8graph_backend.block_backends
              if backend.group.block_type is LlamaDecoderLayer]
    assert sorted(groups) == [["model.layers.0"], ["model.layers.1", "model.layers.2"]]
    rewritten = {d.site.path: d.rewritten for d in compiled.fp8graph_backend.decisions}
    assert not rewritten["model.layers.0.self_attn.q_proj"] and rewritten["model.layers.1.self_attn.q_proj"]


def test_delayed_scaling_state_stays_per_instance_and_matches_the_whole_model_compile():
    compiled = _same_training(DelayedScaling(amax_history_len=4), steps=4)
    assert _block_graphs(compiled) == [1]
    state = compiled._orig_mod.state_dict()
    histories = [state[f"model.layers.{i}.mlp.up_proj.fp8graph_amax_history_weight"] for i in range(3)]
    # Each layer recorded its own weights' amax: three different histories from one compiled graph.
    assert len({tuple(history[1].tolist()) for history in histories}) == 3


def test_stats_are_collected_per_instance():
    regional, _, _ = _train(_llama(), stats=True)
    whole, _, _ = _train(_llama(), stats=True, regions=None, compiler=REFERENCE)
    rows, whole_rows = regional.fp8graph_stats.record(step=3), whole.fp8graph_stats.record(step=3)
    assert {row.path for row in rows} >= {f"model.layers.{i}.mlp.down_proj" for i in range(3)}
    assert rows == whole_rows


def test_weight_cache_fills_and_reuses_per_instance():
    model = _llama()
    compiled = fp8graph.compile(model, compiler="aot_eager", cache_weights=True)
    reference = _llama()
    whole = fp8graph.compile(reference, compiler=REFERENCE, cache_weights=True, regions=None)
    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    with fp8graph.weights_unchanged(compiled), fp8graph.weights_unchanged(whole):
        for _ in range(3):  # fill, then reuse twice
            loss, whole_loss = compiled(tokens, labels=tokens).loss, whole(tokens, labels=tokens).loss
            assert loss.item() == whole_loss.item()
            loss.backward()
            whole_loss.backward()
        assert compiled.fp8graph_backend.weight_cache.reuse
        for i in range(3):
            name = f"model.layers.{i}.mlp.up_proj.fp8graph_cached_weight_weight"
            assert torch.equal(model.get_buffer(name).float(), reference.get_buffer(name).float())
    assert _block_graphs(compiled) == [2]  # the fill graph and the reuse graph, for all three layers
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


def test_huggingface_gradient_checkpointing_runs_inside_the_regions():
    def checkpointed(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model

    regional, losses, state = _train(checkpointed(_llama()), policy=DelayedScaling(amax_history_len=4))
    # The reference under aot_eager too: the eager compiler keeps delayed-scaling sites in checkpoint regions in
    # high precision (their state snapshots need AOTAutograd: docs/limits.md).
    _, whole_losses, whole_state = _train(checkpointed(_llama()), regions=None,
                                          policy=DelayedScaling(amax_history_len=4))
    assert losses == whole_losses
    for name in state:
        assert torch.equal(state[name], whole_state[name]), name
    assert _block_graphs(regional) == [1]


def test_dynamic_shapes_compile_the_region_for_every_length_after_one_recompile():
    model = _llama()
    compiled = fp8graph.compile(model, compiler="aot_eager", dynamic=True)
    # The region receives the rotary cos/sin and the hidden states as separate inputs, each with its
    # own length symbol; their broadcast pins the first length, and the second call recompiles with
    # the length dynamic (Dynamo's automatic dynamic shapes). From then on no length recompiles.
    for length in (16, 24, 40, 56):
        tokens = torch.randint(0, 250, (2, length))
        compiled(tokens, labels=tokens).loss.backward()
    assert _block_graphs(compiled) == [2]
    assert all(d.rewritten for d in compiled.fp8graph_backend.decisions if d.site.path.startswith("model.layers."))


def test_no_recompiles_over_a_hundred_steps():
    model = _llama()
    compiled, _, _ = _train(model, steps=100)
    backend = compiled.fp8graph_backend
    assert [len(b.graph_modules) for b in backend.block_backends] == [1, 1, 1]  # layers, embedding, final norm
    assert len(backend.root.graph_modules) == 1  # the head and the loss; the trunk (model.model) runs eagerly


# Dynamo's recompile limit (8 by default) lowered to 4, so that 6 layers compiled one by one go past it (as 10
# layers would past 8): each compile of a layer's region costs seconds.
@torch._dynamo.config.patch(recompile_limit=4)
def test_a_training_call_builds_no_kv_cache_and_an_inference_cache_still_gets_fp8_everywhere(caplog):
    layers = 6
    assert layers > torch._dynamo.config.recompile_limit
    model = _llama(layers)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    tokens = torch.randint(0, 250, (2, 16))
    output = compiled(tokens, labels=tokens)
    assert output.past_key_values is None  # the training call ran with use_cache=False
    assert _block_graphs(compiled) == [1]
    # Inference with a KV cache: each layer indexes the cache by its number, so Dynamo compiles each
    # layer on its own (said in a warning); past Dynamo's recompile limit none may run eagerly.
    model.eval()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fp8graph"):
        logits = compiled(tokens, use_cache=True).logits
    assert "compiled again for model.layers.1" in caplog.text
    reference = _llama(layers).eval()
    reference.load_state_dict(model.state_dict())
    whole = fp8graph.compile(reference, compiler=REFERENCE, regions=None)
    with torch.no_grad():
        assert torch.equal(logits, whole(tokens, use_cache=True).logits)


def test_the_model_called_eagerly_runs_its_own_blocks_and_pickles_with_its_own_class():
    model = _llama()
    eager_reference = copy.deepcopy(model)
    fp8graph.compile(model, compiler="aot_eager")
    layer = model.model.layers[0]
    assert type(layer) is not LlamaDecoderLayer and isinstance(layer, LlamaDecoderLayer)
    assert block_class(layer) is LlamaDecoderLayer and type(layer).__name__ == "LlamaDecoderLayer"
    tokens = torch.randint(0, 250, (2, 16))
    # Outside the compiled model the blocks are the user's: no FP8, the same numbers as before compiling.
    assert torch.equal(model(tokens).logits, eager_reference(tokens).logits)
    buffer = io.BytesIO()  # plain pickle refuses the layer's FP8 weight copies (a float8 storage): torch.save
    torch.save(layer, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)) is LlamaDecoderLayer
    assert type(copy.deepcopy(model).model.layers[1]) is LlamaDecoderLayer


def test_explain_reports_every_instance_by_its_own_path():
    model = _llama()
    compiled = fp8graph.compile(model, compiler="aot_eager", policy=Policy(rules=[("model.layers.2.*", None)]))
    tokens = torch.randint(0, 250, (2, 16))
    report = fp8graph.explain(compiled, tokens)
    by_path = {row.path: row for row in report}
    for i in range(3):
        row = by_path[f"model.layers.{i}.mlp.gate_proj"]
        assert (row.recipe is None) == (i == 2), i
    assert len(report) == 3 * 7 + 1  # seven projections per layer, and the head


def test_regions_refuse_frozen_weights_and_auto_compiles_them_whole():
    with pytest.raises(ValueError, match="regions=None"):
        fp8graph.compile(_llama(), freeze_weights=True, regions=[LlamaDecoderLayer])
    compiled = fp8graph.compile(_llama(), freeze_weights=True)
    assert not hasattr(compiled.fp8graph_backend, "block_backends")


def test_fullgraph_compiles_the_model_as_one_graph_and_refuses_regions_asked_for():
    """Regions break the model's graph at each block; ``fullgraph=True`` asks for none (Dynamo refused the regions'
    eager calls with a message about ``torch.compiler.disable`` before)."""
    with pytest.raises(ValueError, match="fullgraph=True.*regions=None"):
        fp8graph.compile(_llama(), compiler="aot_eager", fullgraph=True, regions=[LlamaDecoderLayer])
    torch.manual_seed(0)
    model, tokens = _llama(), torch.randint(0, 250, (2, 16))
    expected = fp8graph.compile(copy.deepcopy(model), compiler=REFERENCE, regions=None)(tokens, labels=tokens).loss
    compiled = fp8graph.compile(model, compiler="aot_eager", fullgraph=True)
    assert not hasattr(compiled.fp8graph_backend, "block_backends")
    assert torch.equal(compiled(tokens, labels=tokens).loss, expected)
    assert compiled.fp8graph_backend.graph_count == 1


_STEP_IN_A_NEW_PROCESS = """
import json, sys
import torch
from torch._dynamo.utils import counters
import fp8graph
from fp8graph.models import build

recipe = {"hybrid": fp8graph.Float8CurrentScaling(), "e4m3": fp8graph.Float8CurrentScaling(fp8graph.Format.E4M3)}
model = build("llama", "tiny", num_hidden_layers=2)
compiled = fp8graph.compile(model, policy=recipe[sys.argv[1]])
tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
compiled(tokens, labels=tokens).loss.backward()
torch.save(model.model.embed_tokens.weight.grad, sys.argv[2])
print(json.dumps({"counters": dict(counters["aot_autograd"]), "graphs": compiled.fp8graph_backend.graph_count}))
"""


def _start(policy_name, cache_dir, grad_path):
    """A fresh process's first training step with Inductor's caches in ``cache_dir``: its counters and gradient."""
    import json
    import os

    completed = forked.run_python(["-c", _STEP_IN_A_NEW_PROCESS, policy_name, str(grad_path)],
                                  env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}, check=True)
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return result["counters"], result["graphs"], torch.load(grad_path)


@pytest.mark.inductor
def test_a_warm_start_reuses_every_region_from_the_caches_and_another_policy_misses(tmp_path):
    """Every compiled unit (the head's graph, each region) is stored by AOTAutograd: a new process with
    the same policy compiles nothing again; a policy changing the layers' format misses there only."""
    first, units, grad = _start("hybrid", tmp_path / "cache", tmp_path / "first.pt")
    again, _, grad_again = _start("hybrid", tmp_path / "cache", tmp_path / "again.pt")
    other, _, e4m3_grad = _start("e4m3", tmp_path / "cache", tmp_path / "other.pt")
    assert units == 4  # the head and loss; the layers; the embedding; the final norm
    assert first.get("autograd_cache_saved") == units and "autograd_cache_hit" not in first, first
    assert again.get("autograd_cache_hit") == units and "autograd_cache_miss" not in again, again
    torch.testing.assert_close(grad_again, grad, rtol=0, atol=0)
    # E4M3 changes the layers' graph only: the embedding, the norm and the head (kept in high
    # precision, N=250) are the same graphs and hit.
    assert other.get("autograd_cache_miss") == 1 and other.get("autograd_cache_hit") == units - 1, other
    assert not torch.equal(e4m3_grad, grad)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _LoopingRoot(torch.nn.Module):
    """Calls its blocks itself, in a loop, and multiplies by its embedding's weight in its own code (a tied head)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(64, 256)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) + x @ self.embed.weight.T


def test_a_root_that_loops_over_its_regions_is_run_eagerly_and_says_so(caplog):
    """Each region call breaks the root's graph inside its loop, and Dynamo then runs the root's whole forward
    eagerly: its own GEMM (the tied head's matmul) never reaches fp8graph. The first call warns, naming the
    function and regions=None, which traces it whole; explain lists it."""
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    whole = fp8graph.compile(_LoopingRoot(), compiler="aot_eager", regions=None)  # first: Dynamo skips a code once
    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        whole(ids)
    assert "eagerly" not in caplog.text
    assert [(d.site.path, d.rewritten) for d in whole.fp8graph_backend.decisions][-1] == ("embed", True)

    regional = fp8graph.compile(_LoopingRoot(), compiler="aot_eager")
    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        regional(ids)
        regional(ids)
    warnings = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "forward (" in warnings[0] and "regions=None" in warnings[0]
    assert "for/while loop" in warnings[0]
    assert "embed" not in {d.site.path for d in regional.fp8graph_backend.decisions}
    breaks = fp8graph.explain(regional, ids).graph_breaks
    assert [b for b in breaks if b.startswith("ran eagerly: forward (")], breaks


class _CachingBlocks(torch.nn.Module):
    """Repeated blocks (regions) under a forward that takes ``use_cache``, by position or by name."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
                                          for _ in range(2))

    def forward(self, x, use_cache=False):
        for block in self.blocks:
            x = block(x)
        return x * 2 if use_cache else x


@pytest.mark.parametrize("passed", ["position", "name", "omitted"])
def test_a_training_call_s_own_use_cache_is_kept_however_it_is_passed(passed):
    """A training call gets ``use_cache=False`` only where it passed none: passed by position it must not be
    given again by name (a TypeError before), and ``True`` stays ``True``."""
    torch.manual_seed(0)
    model, x = _CachingBlocks(), torch.randn(8, 64)
    args, kwargs = {"position": ((x, True), {}), "name": ((x,), {"use_cache": True}), "omitted": ((x,), {})}[passed]
    expected = fp8graph.compile(copy.deepcopy(model), compiler=REFERENCE, regions=None)(*args, **kwargs)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    assert torch.equal(compiled(*args, **kwargs), expected)
    assert len(fp8graph.explain(model, *args, **kwargs).rewritten) == 2
