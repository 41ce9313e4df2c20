"""FSDP2 all-gathers weights in FP8 (fp8graph.fsdp): gloo processes on this CPU, tiny Llama, 2 and 4 ranks.

Three runs, each training 2 steps twice on the same local batches: weights gathered in FP8 (the default) and
in high precision (``fp8_all_gather=False``). A run gives each layer its own recipe, so every recipe is
covered by three compiled models instead of five:

    per-tensor   layer 0 current scaling, layer 1 delayed
    tiles        layer 0 block scaling (128x128 weight tiles), layer 1 MXFP8; hidden 512, intermediate 768
    rowwise      both layers row-wise

What must hold:

- the gathered bytes, counted at the collective, are the high-precision gather's with each FP8 weight at
  1 byte an element instead of 4 (fp32 parameters), plus its gathered scales (block: an fp32 a 128x128 tile;
  row-wise: an fp32 a row), and MXFP8 at 2 bytes an element (both layouts) and an E8M0 byte a block of 32
  in each; the same count of all-gathers;
- per-tensor, block and MXFP8: losses and every rank's gradient shards are bit-equal: each rank casts its
  shard as the graph would cast the gathered weight (current: the whole weight's scale, one all-reduce of
  the weights' shard amaxes per call; delayed: the history; block and MXFP8: each tile or block its own,
  whole ones on each rank);
- row-wise: the first loss is bit-equal (the forward reads the same bytes); grad_input reads the
  forward's bytes with the row scales folded into grad_output instead of a column-scaled copy
  (``fp8graph.targets.linear_tiled``), so gradients and later losses agree within stated floors;
- delayed-scaling state is identical on every rank, and equal to the high-precision gather's;
- ``explain`` lists which weights were gathered in FP8, and why the others were not.

The 2 ranks compile the FP8 gathers with aot_eager, as the CPU training app does, so AOTAutograd traces the
gathered FP8 weights; their high-precision references, and both gathers on 4 ranks, with fp8graph's ``eager``
compiler (the same rewritten graph, run without AOTAutograd: bit for bit what aot_eager computes here). That is
what makes these ranks sharing this machine's 2 cores affordable: the references need no AOTAutograd trace, and
4 ranks add what only they show (tiles split between ranks, kept in high precision; the same bits on 4 shards),
not another compiler path.
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import fp8graph
from fp8graph import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling, MXFP8BlockScaling
from fp8graph.apps.train_distributed import parallelize, summed_loss
from fp8graph.fsdp import shard_casts
from fp8graph.fsdp.gather_bytes import count_all_gathers
from fp8graph.models import build

from gloo_ranks import spawn_ranks
from helpers import gathered_by_two_ranks, sqnr_db

CONFIG = "tiny-blocks"
# 2 steps: the second casts with scales from the state the first left (delayed: its history).
GLOBAL_BATCH, SEQUENCE, VOCAB, STEPS = 8, 32, 250, 2


def _by_layer(first, second):
    return fp8graph.Policy(default=None, rules=[("model.layers.0.*", first), ("model.layers.1.*", second)])


RUNS = {"per-tensor": _by_layer(Float8CurrentScaling(), DelayedScaling(amax_history_len=4)),
        "tiles": _by_layer(Float8BlockScaling(), MXFP8BlockScaling()),
        "rowwise": Float8RowwiseScaling()}
# Block scaling's 128x128 tiles need 128-row multiples on every rank: projections of 512 rows, and the MLP's
# gate and up of 768 rows, whole tiles on 2 ranks (384 rows each), split on 4 (192). MXFP8's 32-row blocks
# are whole on 4 ranks too.
OVERRIDES = {"tiles": dict(hidden_size=512, intermediate_size=768)}
LAYER_WEIGHTS = 7  # q, k, v, o, gate, up, down; lm_head (N=250) and the norms gather in high precision
SPLIT_TILES = {2: [], 4: [f"model.layers.0.mlp.{name}.weight" for name in ("gate_proj", "up_proj")]}
COMPILER = {2: "aot_eager", 4: "eager"}  # the FP8 gathers', by world size; the references' "eager": the module's doc
TILE, MX_BLOCK = 128, 32
# Row-wise against the high-precision gather (measured on 2 ranks, 2026-11-25: first-step gradients 44 dB and up,
# the second loss within 6.3e-5).
ROWWISE_GRAD_SQNR_DB, ROWWISE_LOSS_RTOL = 35.0, 5e-4


def _batches(rank, world_size):
    generator = torch.Generator().manual_seed(0)
    shard = GLOBAL_BATCH // world_size
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQUENCE), generator=generator)[rank * shard:(rank + 1) * shard]
            for _ in range(STEPS)]


def _train(run, fp8_all_gather, batches, compiler):
    # Each run compiles afresh: a layer seen at another width would recompile with dynamic shapes (Dynamo's
    # automatic dynamic), several times slower on this CPU.
    torch._dynamo.reset()
    model = build("llama", CONFIG, seed=0, **OVERRIDES.get(run, {}))
    parallelize(model, "fsdp2")
    compiled = fp8graph.compile(model, policy=RUNS[run], compiler=compiler, fp8_all_gather=fp8_all_gather)
    gathers = count_all_gathers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, step_bytes, grads = [], [], []
    for tokens in batches:
        gathers.reset()
        loss = summed_loss(compiled(tokens).logits, tokens, GLOBAL_BATCH * (SEQUENCE - 1))
        loss.backward()
        step_bytes.append((gathers.gathered_bytes, gathers.calls))
        grads.append({name: param.grad.to_local().clone() for name, param in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items() if "fp8graph" in k}
    plan = compiled.fp8graph_backend.all_gather
    records = plan.records if plan is not None else []
    fp8_recipes = {record.path: record.recipe for record in records if record.fp8}
    gathered_in_fp8 = {path: (param.shape, fp8_recipes[path]) for path, param in model.named_parameters()
                       if path in fp8_recipes}
    return {"losses": losses, "bytes": step_bytes, "grads": grads, "state": state, "records": records,
            "fp8_weights": gathered_in_fp8,
            "hp_bytes_per_element": next(iter(model.parameters())).element_size()}


def _rank(rank, world_size, out_dir):
    batches = _batches(rank, world_size)
    results = {run: {gather: _train(run, gather, batches, COMPILER[world_size] if gather else "eager")
                     for gather in (True, False)}
               for run in RUNS}
    if world_size == 2:
        model = build("llama", CONFIG, seed=0)
        parallelize(model, "fsdp2")
        compiled = fp8graph.compile(model, policy=Float8CurrentScaling(), compiler="aot_eager")
        report = fp8graph.explain(compiled, batches[0])  # on every rank: its forward gathers
        results["explain"] = {"all_gathers": report.all_gathers, "summary": report.summary_lines()}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _gathered_bytes(shape, recipe):
    """Bytes gathered of one weight in FP8: its FP8 bytes and the scales gathered with them (per-tensor scales
    are not gathered: every rank has the same)."""
    rows, columns = shape
    if isinstance(recipe, Float8BlockScaling):
        return rows * columns + 4 * (rows // TILE) * (columns // TILE)
    if isinstance(recipe, Float8RowwiseScaling):
        return rows * columns + 4 * rows
    if isinstance(recipe, MXFP8BlockScaling):  # both layouts, an E8M0 byte a block of 32 each
        return 2 * rows * columns + 2 * rows * columns // MX_BLOCK
    return rows * columns


def _check_against_the_high_precision_gather(runs, run):
    world_size = len(runs)
    for rank in runs:
        fp8, hp = rank[run][True], rank[run][False]
        split = SPLIT_TILES[world_size] if run == "tiles" else []
        assert len(fp8["fp8_weights"]) == 2 * LAYER_WEIGHTS - len(split), run
        reasons = {record.path: record.reason for record in fp8["records"] if not record.fp8}
        for path in split:
            assert reasons[path] == f"each of 4 ranks holds 192 of its rows, which splits its {TILE}-row tiles"
        # Per step: the same all-gathers; each FP8 weight's bytes and scales where it was 4 bytes an element
        # (fp32), gathered twice (before the forward, and again before the backward: FSDP2 reshards after
        # the forward).
        saved = 2 * sum(hp["hp_bytes_per_element"] * shape.numel() - _gathered_bytes(shape, recipe)
                        for shape, recipe in fp8["fp8_weights"].values())
        for (fp8_bytes, fp8_calls), (hp_bytes, hp_calls) in zip(fp8["bytes"], hp["bytes"]):
            assert fp8_calls == hp_calls, run
            assert fp8_bytes == hp_bytes - saved, (run, fp8_bytes, hp_bytes, saved)
        if run == "rowwise":
            # The first step from the same weights: the same loss, gradients within the floor. The second
            # starts from weights the first step's gradients moved (AdamW's first steps move each weight by
            # about lr, whatever the gradient's size; its gradients measured 23 dB apart, the trajectories',
            # not the gather's): its loss within the tolerance. The second step's gathers go through the same
            # cast and FSDP2 refill as block's and MXFP8's, which the "tiles" run holds bit-equal.
            assert fp8["losses"][0] == hp["losses"][0]
            torch.testing.assert_close(fp8["losses"], hp["losses"], rtol=ROWWISE_LOSS_RTOL, atol=0)
            first_fp8, first_hp = fp8["grads"][0], hp["grads"][0]
            assert first_fp8.keys() == first_hp.keys()
            for param_name, grad in first_fp8.items():
                assert sqnr_db(first_hp[param_name], grad) >= ROWWISE_GRAD_SQNR_DB, param_name
            continue
        assert fp8["losses"] == hp["losses"], run
        for fp8_step, hp_step in zip(fp8["grads"], hp["grads"], strict=True):
            assert fp8_step.keys() == hp_step.keys()
            for param_name, grad in fp8_step.items():
                assert torch.equal(grad, hp_step[param_name]), (run, param_name)
        for key, value in fp8["state"].items():
            assert torch.equal(value, hp["state"][key]), (run, key)
            assert torch.equal(value, runs[0][run][True]["state"][key]), (run, key)  # every rank's


def _check_explain(explained):
    fp8 = [record.path for record in explained["all_gathers"] if record.fp8]
    assert len(fp8) == 2 * LAYER_WEIGHTS and "model.layers.0.self_attn.q_proj.weight" in fp8
    # Current scaling gathers a byte an element where fp32 gathers 4; the scale is not gathered.
    assert all(4 * r.fp8_bytes == r.high_precision_bytes for r in explained["all_gathers"] if r.fp8)
    kept = {record.path: record.reason for record in explained["all_gathers"] if not record.fp8}
    assert kept["lm_head.weight"] == "shape (250, 128): N=250 is not a multiple of 16"
    assert kept["model.embed_tokens.weight"] == "an Embedding's weight, not a GEMM's"
    assert kept["model.norm.weight"] == "not a matrix"
    assert f"FSDP2 all-gathers {2 * LAYER_WEIGHTS} of {len(explained['all_gathers'])} sharded weight(s) in FP8" in \
        explained["summary"]


# One test per world size: the ranks run once, every check reads their results.
@pytest.mark.parametrize("world_size", sorted(COMPILER))
def test_fp8_gather_shrinks_the_weight_bytes_and_computes_the_same(tmp_path, world_size):
    spawn_ranks(_rank, world_size, str(tmp_path), deadline_s=600)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    for run in RUNS:
        _check_against_the_high_precision_gather(runs, run)
    assert len(runs[0]["per-tensor"][True]["state"]) == 4 * LAYER_WEIGHTS  # layer 1's delayed state
    if world_size == 2:
        _check_explain(runs[0]["explain"])


# --- one process (a gloo world of one): the bad and mixed cases -------------------------------------------

@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _losses_and_grads(fp8_all_gather, policy, reshard_after_forward=True, steps=2, micro_batches=1, casts=None,
                      declared=True):
    """``steps`` SGD steps of ``micro_batches`` micro-batches, each step's declared to see the same weights
    (``declared``); each step's loss (summed) and gradients. ``casts``: a list that gets, per micro-batch, how
    many shards were cast to FP8 for its gathers."""
    from torch.distributed.fsdp import fully_shard

    model = build("llama", "tiny", seed=0)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    compiled = fp8graph.compile(model, policy=policy, compiler="aot_eager", fp8_all_gather=fp8_all_gather)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        loss = 0.0
        with fp8graph.weights_unchanged(compiled) if declared else contextlib.nullcontext():
            for micro_batch in range(micro_batches):
                tokens = torch.randint(0, 250, (2, 16),
                                       generator=torch.Generator().manual_seed(step * 10 + micro_batch))
                cast_before = shard_casts.quantize.calls if casts is not None else 0
                micro_loss = compiled(tokens, labels=tokens).loss
                micro_loss.backward()
                loss = loss + micro_loss.detach()
                if casts is not None:
                    casts.append(shard_casts.quantize.calls - cast_before)
        grads.append({name: p.grad.to_local().clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads, compiled.fp8graph_backend.all_gather


def test_a_module_the_policy_keeps_gathers_in_high_precision_and_reshard_false_gathers_once(world_of_one):
    """A mixed policy (the MLPs' down projections kept) under reshard_after_forward=False (no gather before
    the backward): the kept weights gather in high precision with the policy as the reason, the others in
    FP8, and training equals the high-precision gather's bit for bit."""
    policy = fp8graph.Policy(default=DelayedScaling(amax_history_len=4), rules=[("*.down_proj", None)])
    fp8_losses, fp8_grads, plan = _losses_and_grads(True, policy, reshard_after_forward=False)
    hp_losses, hp_grads, _ = _losses_and_grads(False, policy, reshard_after_forward=False)
    kept = {r.path: r.reason for r in plan.records if not r.fp8 and r.path.endswith("down_proj.weight")}
    assert kept == {f"model.layers.{i}.mlp.down_proj.weight": "the policy keeps its sites in high precision"
                    for i in range(2)}
    assert sum(r.fp8 for r in plan.records) == 12
    assert fp8_losses == hp_losses
    for fp8_step, hp_step in zip(fp8_grads, hp_grads):
        assert all(torch.equal(grad, hp_step[name]) for name, grad in fp8_step.items())


def _sharded_delayed(fp8_all_gather):
    from torch.distributed.fsdp import fully_shard

    model = build("llama", "tiny", seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, fp8graph.compile(model, policy=DelayedScaling(amax_history_len=4), compiler="aot_eager",
                                   fp8_all_gather=fp8_all_gather)


def _tokens(seed):
    return torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(seed))


def test_a_backward_gathers_its_own_forwards_cast_not_a_later_no_grad_calls(world_of_one):
    """Delayed scaling: a call without gradients between a forward and its backward casts the weights with the
    scale the moved history gives; the backward's gathers send the forward's bytes, so the gradients are the
    high-precision gather's bit for bit."""
    grads = []
    for fp8_all_gather in (True, False):
        model, compiled = _sharded_delayed(fp8_all_gather)
        loss = compiled(_tokens(0), labels=_tokens(0)).loss
        with torch.no_grad():
            compiled(_tokens(1), labels=_tokens(1))
        loss.backward()
        grads.append({name: p.grad.to_local().clone() for name, p in model.named_parameters()})
    assert all(torch.equal(grad, grads[1][name]) for name, grad in grads[0].items())


def test_forwards_without_a_backward_keep_two_casts_a_weight_at_most(world_of_one):
    """An evaluation loop run with gradients enabled never calls backward: what awaits one stays bounded."""
    model, compiled = _sharded_delayed(True)
    for seed in range(5):
        compiled(_tokens(seed), labels=_tokens(seed))
    casts = [cast for _, cast in compiled.fp8graph_backend.all_gather.casts]
    assert len(casts) == 14 and all(len(cast._awaiting_backward) == 2 for cast in casts)


def test_two_delayed_forwards_before_one_backward_are_refused_by_its_gather_naming_the_weight(world_of_one):
    """Each forward cast the weights with its own scale (the history moved between them); the gather before their
    backward cannot tell whose backward it serves."""
    _, compiled = _sharded_delayed(True)
    first = compiled(_tokens(0), labels=_tokens(0)).loss
    second = compiled(_tokens(1), labels=_tokens(1)).loss
    with pytest.raises(RuntimeError, match=r"fp8graph: model\.layers\.\d\.[\w.]+\.weight: two forwards with "
                                           r"gradients ran before a backward.*fp8_all_gather=False"):
        (first + second).backward()


class _CountedQuantize:
    def __init__(self, quantize):
        self.quantize, self.calls = quantize, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.quantize(*args, **kwargs)


def test_micro_batches_gather_the_shards_each_step_cast_once(world_of_one, monkeypatch):
    """Gradient accumulation under FSDP2's FP8 all-gathers, each step's micro-batches declared to see the same
    weights: the first micro-batch casts each weight's shard (its backward's gathers resend the forward's
    bytes), the others send those bytes again without casting; the next declaration casts anew. Outside a
    declaration every call casts. Losses and gradients are the high-precision gather's bit for bit."""
    monkeypatch.setattr(shard_casts, "quantize", _CountedQuantize(shard_casts.quantize))
    casts, undeclared_casts = [], []
    fp8_losses, fp8_grads, plan = _losses_and_grads(True, Float8CurrentScaling(), micro_batches=3, casts=casts)
    gathered_in_fp8 = sum(r.fp8 for r in plan.records)
    assert gathered_in_fp8 == 14 and casts == [gathered_in_fp8, 0, 0] * 2
    undeclared_losses, _, _ = _losses_and_grads(True, Float8CurrentScaling(), steps=1, micro_batches=2,
                                                casts=undeclared_casts, declared=False)
    assert undeclared_casts == [gathered_in_fp8] * 2
    hp_losses, hp_grads, _ = _losses_and_grads(False, Float8CurrentScaling(), micro_batches=3)
    assert fp8_losses == hp_losses
    for fp8_step, hp_step in zip(fp8_grads, hp_grads, strict=True):
        assert all(torch.equal(grad, hp_step[name]) for name, grad in fp8_step.items())


def test_delayed_micro_batches_resend_each_shards_cast_as_a_kept_copy_is_read(world_of_one, monkeypatch):
    """Delayed scaling under FSDP2's FP8 all-gathers: each weight's shard is cast once per declaration too, and
    the micro-batches that resend it train as a model without FSDP2 that keeps its weights' casts (the fill's
    scale, no weight amax recorded by the calls that reuse it) does, bit for bit."""
    monkeypatch.setattr(shard_casts, "quantize", _CountedQuantize(shard_casts.quantize))
    recipe, casts = DelayedScaling(amax_history_len=4), []
    fp8_losses, fp8_grads, plan = _losses_and_grads(True, recipe, micro_batches=3, casts=casts)
    gathered_in_fp8 = sum(r.fp8 for r in plan.records)
    assert gathered_in_fp8 == 14 and casts == [gathered_in_fp8, 0, 0] * 2
    model = build("llama", "tiny", seed=0)
    compiled = fp8graph.compile(model, policy=recipe, compiler="aot_eager")  # cache_weights="auto": casts kept
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (fp8_loss, fp8_step) in enumerate(zip(fp8_losses, fp8_grads, strict=True)):
        loss = 0.0
        with fp8graph.weights_unchanged(compiled):
            for micro_batch in range(3):
                tokens = torch.randint(0, 250, (2, 16),
                                       generator=torch.Generator().manual_seed(step * 10 + micro_batch))
                micro_loss = compiled(tokens, labels=tokens).loss
                micro_loss.backward()
                loss = loss + micro_loss.detach()
            assert compiled.fp8graph_backend.weight_cache.reuse
        assert loss.item() == fp8_loss, step
        assert all(torch.equal(param.grad, fp8_step[name]) for name, param in model.named_parameters()), step
        optimizer.step()
        optimizer.zero_grad()


class _ReadsItsWeight(torch.nn.Module):
    """A linear whose forward also reads its weight outside the GEMM (a penalty on it)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.proj(x) + self.proj.weight.square().mean()


def test_a_gathered_weight_read_outside_an_fp8_site_is_refused_naming_it(world_of_one):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(_ReadsItsWeight())
    fully_shard(model[0])
    fully_shard(model)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    with pytest.raises(Exception, match=r"all-gathered in FP8 under FSDP2, but it is read by .*fp8_all_gather=False"):
        compiled(torch.randn(32, 64))
    # Outside the compiled model the gathered weight is not a weight: an error, never a silent dequantization.
    with pytest.raises(RuntimeError, match="all-gathered in FP8 by fp8graph"):
        model(torch.randn(32, 64))


class _AroundASequential(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))

    def forward(self, x):
        return self.seq(x) * 2


class _SubclassedLinear(torch.nn.Linear):
    """nn.Linear's forward, in a class of the user's own."""


@pytest.mark.parametrize("units", ["each linear", "a sequential inside the model's own module",
                                   "each subclass of nn.Linear"])
def test_torch_nn_modules_that_dynamo_runs_eagerly_gather_in_high_precision_saying_why(world_of_one, units):
    """An FSDP2 unit's call breaks the graph that calls it, and Dynamo does not compile a torch.nn module's forward
    as a frame of its own: the linears run eagerly, where a weight gathered in FP8 could not be read. They gather
    in high precision, each with the reason, and the step computes what the unsharded model computes."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if units == "each linear":
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
        reference, units_made, paths = copy.deepcopy(model), list(model), ["0.weight", "1.weight"]
    elif units == "each subclass of nn.Linear":
        model = torch.nn.Sequential(_SubclassedLinear(64, 64, bias=False), _SubclassedLinear(64, 32, bias=False))
        reference, units_made, paths = copy.deepcopy(model), list(model), ["0.weight", "1.weight"]
    else:
        model = _AroundASequential()
        reference, units_made, paths = copy.deepcopy(model), [model.seq], ["seq.0.weight", "seq.1.weight"]
    for unit in units_made:
        fully_shard(unit)
    fully_shard(model)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    x = torch.randn(32, 64)
    output = compiled(x)
    output.sum().backward()
    records = compiled.fp8graph_backend.all_gather.records
    assert [record.path for record in records] == paths and [record.fp8 for record in records] == [False, False]
    assert all("Dynamo runs its module eagerly" in record.reason for record in records)
    torch.testing.assert_close(output, reference(x), rtol=0, atol=0)  # high precision: eager's result


def test_one_fully_shard_of_a_list_of_layers_is_one_unit_with_one_record_a_weight(world_of_one):
    """``fully_shard([layer, ...])`` makes one unit of the layers: each weight is recorded once, and the layers'
    linears (a user's module's forward calls them) gather in FP8."""
    from torch.distributed.fsdp import fully_shard

    model = build("llama", "tiny", seed=0)
    fully_shard(list(model.model.layers))
    fully_shard(model)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    tokens = torch.randint(0, 250, (2, 16))
    compiled(tokens, labels=tokens).loss.backward()
    records = compiled.fp8graph_backend.all_gather.records
    assert len({record.path for record in records}) == len(records)
    projections = [record for record in records if record.path.endswith("_proj.weight")]
    assert len(projections) == 14 and all(record.fp8 for record in projections), projections


def test_a_model_sharded_after_compiling_gathers_in_high_precision_and_says_so(world_of_one, caplog):
    from torch.distributed.fsdp import fully_shard

    model = build("llama", "tiny", seed=0)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    tokens = torch.randint(0, 250, (2, 16))
    with caplog.at_level("WARNING", logger="fp8graph"):
        compiled(tokens, labels=tokens).loss.backward()
    assert "fully_shard-ed after fp8graph.compile" in caplog.text
    assert compiled.fp8graph_backend.all_gather.records == []


def test_the_gathered_weight_is_fp8_bytes_that_only_its_shape_can_be_read_from():
    from fp8graph.fsdp.gathered_weight import GatheredFP8Weight

    weight_hp = torch.randn(32, 16)
    scale = 448.0 / weight_hp.abs().amax()
    weight = GatheredFP8Weight((weight_hp * scale).to(torch.float8_e4m3fn), scale, torch.float32, form="tensor",
                               amax=weight_hp.abs().amax())
    assert weight.shape == (32, 16) and weight.dtype == torch.float32
    assert torch.equal(torch.zeros_like(weight), torch.zeros(32, 16))  # FSDP2's zero gradient for an unused weight
    assert type(weight.detach()) is GatheredFP8Weight and weight.detach().fp8_data is not None
    torch.testing.assert_close(weight.dequantized(), weight_hp, rtol=0.07, atol=0)
    with pytest.raises(RuntimeError, match="all-gathered in FP8 by fp8graph"):
        weight.sum()


def test_a_block_scaled_gathered_weight_carries_its_tiles_scales_and_no_amax():
    from fp8graph.fsdp.gathered_weight import GatheredFP8Weight
    from fp8graph.numerics.formats import Role
    from fp8graph.numerics.tiles import reference_quantize_tiles

    weight_hp = torch.randn(256, 128)
    weight_hp[128:] *= 100  # the second tile row's scale differs from the first's
    weight_fp8, tile_scales = reference_quantize_tiles(weight_hp, Float8BlockScaling().tiling(Role.WEIGHT))
    weight = GatheredFP8Weight(weight_fp8, tile_scales, torch.float32, form="tiles")
    names, context = weight.__tensor_flatten__()
    assert names == ["fp8_data", "scale"] and context == (torch.float32, "tiles") and tile_scales.shape == (2, 1)
    rebuilt = GatheredFP8Weight.__tensor_unflatten__({"fp8_data": weight_fp8, "scale": tile_scales}, context, None,
                                                     None)
    assert rebuilt.amax is None and rebuilt.form == "tiles" and rebuilt.shape == (256, 128)
    torch.testing.assert_close(weight.dequantized(), weight_hp, rtol=0.07, atol=0)
    with pytest.raises(ValueError, match="amax is per tensor only"):
        GatheredFP8Weight(weight_fp8, tile_scales, torch.float32, form="tiles", amax=weight_hp.abs().amax())


def test_row_wise_and_mxfp8_shards_gather_to_the_whole_weights_casts():
    """Two shards' casts, gathered, are the casts of the whole weight, scales included: row-wise's bytes
    and row scales; MXFP8's blocks along K, and along N (grad_input's copy), with E8M0 bytes."""
    from fp8graph.numerics.formats import Role
    from fp8graph.numerics.tiles import e8m0_to_scale, reference_quantize_tiles

    weight_hp = torch.randn(128, 96) * torch.logspace(-3, 3, 128)[:, None]  # rows of every magnitude
    rows = gathered_by_two_ranks(Float8RowwiseScaling(), weight_hp)
    whole_fp8, whole_scale = reference_quantize_tiles(weight_hp, Float8RowwiseScaling().tiling(Role.WEIGHT))
    assert rows.form == "rows" and rows.fp8_t_data is None
    assert torch.equal(rows.fp8_data.view(torch.uint8), whole_fp8.view(torch.uint8))
    assert torch.equal(rows.scale, whole_scale.reshape(-1))
    torch.testing.assert_close(rows.dequantized(), weight_hp, rtol=0.07, atol=0)

    mx = gathered_by_two_ranks(MXFP8BlockScaling(), weight_hp)
    tiling = MXFP8BlockScaling().tiling(Role.WEIGHT)
    along_k, along_k_scale = reference_quantize_tiles(weight_hp, tiling)
    along_n, along_n_scale = reference_quantize_tiles(weight_hp.t(), tiling)  # (K, N), blocks along N
    assert mx.form == "mx" and mx.scale.dtype == mx.scale_t.dtype == torch.uint8
    assert torch.equal(mx.fp8_data.view(torch.uint8), along_k.view(torch.uint8))
    assert torch.equal(e8m0_to_scale(mx.scale), along_k_scale)
    assert torch.equal(mx.fp8_t_data.t().view(torch.uint8), along_n.view(torch.uint8))
    assert torch.equal(e8m0_to_scale(mx.scale_t).t(), along_n_scale)
    torch.testing.assert_close(mx.dequantized(), weight_hp, rtol=0.07, atol=0)
    names, context = mx.__tensor_flatten__()
    assert names == ["fp8_data", "scale", "fp8_t_data", "scale_t"] and context == (torch.float32, "mx")


def test_explain_sums_the_gathered_bytes_and_names_fp8_gathers_that_save_none():
    """The summary gives a gather's bytes in FP8 against high precision, and names the weights whose FP8 gather
    moves no fewer bytes (MXFP8's two layouts against BF16 parameters): what they save is the graph's casts."""
    from fp8graph.fsdp.install import GatherRecord
    from fp8graph.fsdp.shard_casts import fp8_gathered_bytes
    from fp8graph.inspection.report import ExplainReport

    mxfp8, rowwise = MXFP8BlockScaling(), Float8RowwiseScaling()
    records = [GatherRecord("a.weight", True, recipe=mxfp8, fp8_bytes=fp8_gathered_bytes(256, 128, mxfp8),
                            high_precision_bytes=2 * 256 * 128),
               GatherRecord("b.weight", True, recipe=rowwise, fp8_bytes=fp8_gathered_bytes(256, 128, rowwise),
                            high_precision_bytes=2 * 256 * 128),
               GatherRecord("norm.weight", False, reason="not a matrix", high_precision_bytes=2 * 128)]
    assert records[0].fp8_bytes == 2 * 256 * 128 + 2 * 256 * 128 // 32 and records[1].fp8_bytes == 256 * 128 + 4 * 256
    lines = ExplainReport([], all_gathers=records).summary_lines()
    assert "FSDP2 all-gathers 2 of 3 sharded weight(s) in FP8" in lines
    assert "  0.101 MB a gather of them, scales included, against 0.131 MB in high precision" in lines
    assert (f"  1 of them ({mxfp8.name}) gather no fewer bytes than in high precision: they save the graph's casts, "
            "not bytes") in lines


@pytest.mark.parametrize("recipe, rows, ranks, reason", [
    (MXFP8BlockScaling(), 256, 4, None),  # 64 rows a rank: whole 32-row blocks
    (MXFP8BlockScaling(), 96, 3, None),  # 32 rows a rank
    (MXFP8BlockScaling(), 96, 4, "each of 4 ranks holds 24 of its rows, which splits its 32-row tiles"),
    (Float8BlockScaling(), 256, 4, "each of 4 ranks holds 64 of its rows, which splits its 128-row tiles"),
    (Float8RowwiseScaling(), 96, 4, None),  # a row's scale is its own: any even split
    (Float8RowwiseScaling(), 96, 1,
     "one rank: FSDP2 copies a single tensor per weight there, and rowwise(E4M3, pow2) gathers scales too"),
    (Float8CurrentScaling(), 96, 1, None),
    (Float8RowwiseScaling(), 96, 5, "its 96 rows do not split evenly over 5 ranks"),
])
def test_which_shards_each_recipe_gathers_in_fp8(recipe, rows, ranks, reason):
    """The decision per weight, table by table, on stand-ins of FSDP2's parameter and group (no process group):
    MXFP8 needs shards of whole 32-row blocks (grad_input's copy is blocked along N), block scaling of whole
    128-row tiles; row-wise and per-tensor scales split anywhere; tiled recipes gather scales beside the bytes,
    which FSDP2 does not do on one rank."""
    from types import SimpleNamespace

    from fp8graph.fsdp.install import _reason_not_fp8

    module = torch.nn.Linear(128, rows, bias=False)
    mesh_info = object()
    fsdp_param = SimpleNamespace(_module_info=SimpleNamespace(shared_modules=[]), offload_to_cpu=False,
                                 is_dtensor=False, fsdp_placement=SimpleNamespace(dim=0),
                                 shard_mesh=SimpleNamespace(size=lambda: ranks))
    group = SimpleNamespace(mesh_info=mesh_info, post_forward_mesh_info=mesh_info)
    plan = fp8graph.plan(module, fp8graph.Policy(default=recipe))
    decided = _reason_not_fp8(plan, module, module.weight, fsdp_param, group, {})
    assert decided == ((None, recipe) if reason is None else (reason, None))
