"""FSDP2 all-gathers weights in FP8 (fp8graph.fsdp): gloo processes on this CPU, tiny Llama, 2 and 4 ranks.

Each recipe trains 2 steps twice on the same local batches: weights gathered in FP8 (the default) and in
high precision (``fp8_all_gather=False``). What must hold:

- the gathered bytes, counted at the collective, are the high-precision gather's with each FP8 weight at
  1 byte an element instead of 4 (fp32 parameters), plus block scaling's tile scales (4 bytes a 128x128
  tile), the same count of all-gathers;
- losses and every rank's gradient shards are bit-equal: each rank casts its shard with the whole weight's
  scale (current: one all-reduce of the weights' shard amaxes per call; delayed: the history; block: each
  tile its own, whole tiles on each rank), so the FP8 bytes the graph reads are the ones it would have cast
  from the gathered weight;
- delayed-scaling state is identical on every rank, and equal to the high-precision gather's;
- ``explain`` lists which weights were gathered in FP8, and why the others were not.
"""

import pytest
import torch
import torch.distributed as dist

import fp8graph
from fp8graph import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from fp8graph.apps.train_distributed import parallelize, summed_loss
from fp8graph.fsdp.gather_bytes import count_all_gathers
from fp8graph.models import build

from gloo_ranks import spawn_ranks

CONFIG = "tiny-blocks"
# 2 steps: the second casts with scales from the state the first left (delayed: its history).
GLOBAL_BATCH, SEQUENCE, VOCAB, STEPS = 8, 32, 250, 2
RECIPES = {"current": Float8CurrentScaling(), "delayed": DelayedScaling(amax_history_len=4),
           "block": Float8BlockScaling()}
# Block scaling's 128x128 tiles need 128-row multiples on every rank: projections of 512 rows, and the MLP's
# gate and up of 768 rows, whole tiles on 2 ranks (384 rows each), split on 4 (192).
OVERRIDES = {"block": dict(hidden_size=512, intermediate_size=768)}
FP8_WEIGHTS = 14  # 7 projections per layer, 2 layers; lm_head (N=250) and the norms gather in high precision
SPLIT_TILES = {2: [], 4: [f"model.layers.{i}.mlp.{name}.weight" for i in range(2) for name in ("gate_proj", "up_proj")]}
TILE = 128


def _batches(rank, world_size):
    generator = torch.Generator().manual_seed(0)
    shard = GLOBAL_BATCH // world_size
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQUENCE), generator=generator)[rank * shard:(rank + 1) * shard]
            for _ in range(STEPS)]


def _train(name, fp8_all_gather, batches):
    recipe = RECIPES[name]
    model = build("llama", CONFIG, seed=0, **OVERRIDES.get(name, {}))
    parallelize(model, "fsdp2")
    compiled = fp8graph.compile(model, policy=recipe, compiler="aot_eager", fp8_all_gather=fp8_all_gather)
    gathers = count_all_gathers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, step_bytes = [], []
    for tokens in batches:
        gathers.reset()
        loss = summed_loss(compiled(tokens).logits, tokens, GLOBAL_BATCH * (SEQUENCE - 1))
        loss.backward()
        step_bytes.append((gathers.gathered_bytes, gathers.calls))
        grads = {name: param.grad.to_local().clone() for name, param in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items() if "fp8graph" in k}
    plan = compiled.fp8graph_backend.all_gather
    records = plan.records if plan is not None else []
    fp8_paths = {record.path for record in records if record.fp8}
    gathered_in_fp8 = {path: param.shape for path, param in model.named_parameters() if path in fp8_paths}
    return {"losses": losses, "bytes": step_bytes, "grads": grads, "state": state, "records": records,
            "fp8_shapes": gathered_in_fp8,
            "hp_bytes_per_element": next(iter(model.parameters())).element_size()}


def _rank(rank, world_size, out_dir):
    batches = _batches(rank, world_size)
    results = {name: {gather: _train(name, gather, batches) for gather in (True, False)} for name in RECIPES}
    if world_size == 2:
        model = build("llama", CONFIG, seed=0)
        parallelize(model, "fsdp2")
        compiled = fp8graph.compile(model, policy=RECIPES["current"], compiler="aot_eager")
        report = fp8graph.explain(compiled, batches[0])  # on every rank: its forward gathers
        results["explain"] = {"all_gathers": report.all_gathers, "summary": report.summary_lines()}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _gathered_scale_bytes(name, shape):
    """Bytes of scales gathered with a weight: block scaling's, one fp32 a tile; per-tensor scales are not
    gathered (every rank has the same)."""
    return 4 * (shape[0] // TILE) * (shape[1] // TILE) if name == "block" else 0


def _check_against_the_high_precision_gather(runs, name):
    world_size = len(runs)
    for rank in runs:
        fp8, hp = rank[name][True], rank[name][False]
        split = SPLIT_TILES[world_size] if name == "block" else []
        assert len(fp8["fp8_shapes"]) == FP8_WEIGHTS - len(split), name
        reasons = {record.path: record.reason for record in fp8["records"] if not record.fp8}
        for path in split:
            assert reasons[path] == f"each of 4 ranks holds 192 of its rows, which splits its {TILE}-row tiles"
        # Per step: the same all-gathers; each FP8 weight 1 byte an element where it was 4 (fp32), plus its
        # scales, gathered twice (before the forward, and again before the backward: FSDP2 reshards after
        # the forward).
        saved = 2 * sum((hp["hp_bytes_per_element"] - 1) * shape.numel() - _gathered_scale_bytes(name, shape)
                        for shape in fp8["fp8_shapes"].values())
        for (fp8_bytes, fp8_calls), (hp_bytes, hp_calls) in zip(fp8["bytes"], hp["bytes"]):
            assert fp8_calls == hp_calls, name
            assert fp8_bytes == hp_bytes - saved, (name, fp8_bytes, hp_bytes, saved)
        assert fp8["losses"] == hp["losses"], name
        assert fp8["grads"].keys() == hp["grads"].keys()
        for param_name, grad in fp8["grads"].items():
            assert torch.equal(grad, hp["grads"][param_name]), (name, param_name)
        for key, value in fp8["state"].items():
            assert torch.equal(value, hp["state"][key]), (name, key)
            assert torch.equal(value, runs[0][name][True]["state"][key]), (name, key)  # every rank's


def _check_explain(explained):
    fp8 = [record.path for record in explained["all_gathers"] if record.fp8]
    assert len(fp8) == FP8_WEIGHTS and "model.layers.0.self_attn.q_proj.weight" in fp8
    kept = {record.path: record.reason for record in explained["all_gathers"] if not record.fp8}
    assert kept["lm_head.weight"] == "shape (250, 128): FP8 GEMMs need multiples of 16"
    assert kept["model.embed_tokens.weight"] == "an Embedding's weight, not a GEMM's"
    assert kept["model.norm.weight"] == "not a matrix"
    assert f"FSDP2 all-gathers {FP8_WEIGHTS} of {len(explained['all_gathers'])} sharded weight(s) in FP8" in \
        explained["summary"]


# One test per world size: the ranks run once, every check reads their results.
@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_gather_halves_the_weight_bytes_and_computes_the_same(tmp_path, world_size):
    spawn_ranks(_rank, world_size, str(tmp_path), deadline_s=600)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    for name in RECIPES:
        _check_against_the_high_precision_gather(runs, name)
    assert len(runs[0]["delayed"][True]["state"]) == 4 * FP8_WEIGHTS
    if world_size == 2:
        _check_explain(runs[0]["explain"])


# --- one process (a gloo world of one): the bad and mixed cases -------------------------------------------

@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _losses_and_grads(fp8_all_gather, policy, reshard_after_forward=True, steps=2):
    from torch.distributed.fsdp import fully_shard

    model = build("llama", "tiny", seed=0)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    compiled = fp8graph.compile(model, policy=policy, compiler="aot_eager", fp8_all_gather=fp8_all_gather)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = compiled(tokens, labels=tokens).loss
        loss.backward()
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
    weight = GatheredFP8Weight((weight_hp * scale).to(torch.float8_e4m3fn), scale, weight_hp.abs().amax(),
                               torch.float32)
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
    weight = GatheredFP8Weight(weight_fp8, tile_scales, None, torch.float32)
    names, dtype = weight.__tensor_flatten__()
    assert names == ["fp8_data", "scale"] and dtype == torch.float32 and tile_scales.shape == (2, 1)
    rebuilt = GatheredFP8Weight.__tensor_unflatten__({"fp8_data": weight_fp8, "scale": tile_scales}, dtype, None, None)
    assert rebuilt.amax is None and rebuilt.shape == (256, 128)
    torch.testing.assert_close(weight.dequantized(), weight_hp, rtol=0.07, atol=0)
