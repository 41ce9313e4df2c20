"""DDP and FSDP2 with the fp8 backend: gloo processes on this CPU, tiny Llama.

    DDP:    fp8graph.compile(DistributedDataParallel(model))     2 and 4 ranks, graph split at buckets
    FSDP2:  fully_shard(each layer), fully_shard(model), then fp8graph.compile
            current, row-wise, block, delayed                     2 ranks (delayed and row-wise all-gather their
                                                                  weights in FP8; current's stats=True and
                                                                  block's split tiles gather in high precision:
                                                                  tests/fsdp/test_fp8_all_gather.py)
            delayed: distributed checkpoint saved on 2 ranks      -> loaded on 4 ranks, training resumes

Every run is compared with one process that sees the same global batches.

The loss is world-size invariant: each rank sums its tokens' losses and
divides by the global token count, and gradients are summed over ranks, not
averaged (``fp8graph.apps.train_distributed.parallelize``). Then grad_output is the same
tensor, token for token, whatever the world size, so delayed scaling's
grad_output history means the same after resuming on another world size.
"""

import functools
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fp8graph
from fp8graph import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling
from fp8graph.models import build
from fp8graph.apps.train_distributed import parallelize, summed_loss

from gloo_ranks import collectives_issued, spawn_ranks
from helpers import fp8_target_count

# tiny-blocks: every projection a multiple of 128, for block scaling, and
# parameters large enough (1.5 MB) for DDP to cut them into two 1 MB buckets.
CONFIG = "tiny-blocks"
GLOBAL_BATCH, SEQUENCE, VOCAB = 8, 32, 250
STEPS, RESUMED_STEPS = 3, 2
RECIPES = {
    "current": Float8CurrentScaling(),
    "rowwise": Float8RowwiseScaling(),
    "block": Float8BlockScaling(),
    "delayed": DelayedScaling(amax_history_len=4),
}
LINEAR_SITES = 14  # 7 projections per layer, 2 layers; lm_head (N=250) stays in high precision
# The FP8 calls of the step: sites that read one input (q, k and v; gate and up) are one call.
CALLS = LINEAR_SITES - 2 * (2 + 1)


def _global_batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQUENCE), generator=generator)
            for _ in range(STEPS + RESUMED_STEPS)]


def _local(tokens, rank, world_size):
    shard = GLOBAL_BATCH // world_size
    return tokens[rank * shard:(rank + 1) * shard]


def _step(compiled, optimizer, tokens):
    loss = summed_loss(compiled(tokens).logits, tokens, GLOBAL_BATCH * (SEQUENCE - 1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _global_loss(local_loss):
    dist.all_reduce(local_loss)  # sum of the ranks' shares: the global batch's mean loss
    return local_loss.item()


def _fp8_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "fp8graph" in k}


def _sharded_model(recipe, stats=False):
    model = build("llama", CONFIG, seed=0)
    parallelize(model, "fsdp2")  # each layer, then the model; gradients summed over ranks
    compiled = fp8graph.compile(model, policy=recipe, compiler="aot_eager", stats=stats)
    return model, compiled, torch.optim.AdamW(model.parameters(), lr=1e-3)


@functools.cache
def _single_process_losses(name):
    """Losses of one process that sees every global batch, for ``RECIPES[name]``: the ranks' rewritten graph run
    by fp8graph's ``eager`` compiler, which computes what their aot_eager does without AOTAutograd's trace."""
    model = build("llama", CONFIG, seed=0)
    compiled = fp8graph.compile(model, policy=RECIPES[name], compiler="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return [_step(compiled, optimizer, tokens).item() for tokens in _global_batches()]


# --- FSDP2, 2 ranks -------------------------------------------------------------------------------

def _fsdp_rank(rank, world_size, out_dir):
    batches = [_local(tokens, rank, world_size) for tokens in _global_batches()]
    results = {}
    for name, recipe in RECIPES.items():
        model, compiled, optimizer = _sharded_model(recipe, stats=name == "current")
        local_losses = []

        def train_step(tokens):
            local_loss = _step(compiled, optimizer, tokens)
            local_losses.append(local_loss.item())
            return _global_loss(local_loss)

        losses = [train_step(tokens) for tokens in batches[:STEPS - 1]]
        collectives = collectives_issued(lambda: losses.append(train_step(batches[STEPS - 1])))
        backend = compiled.fp8graph_backend
        results[name] = {
            "losses": losses,
            "local_losses": local_losses,
            "fp8_sites_per_graph": [fp8_target_count(gm) for gm in backend.graph_modules],
            "collectives": collectives,
            "rewritten": sorted(d.site.path for d in backend.decisions if d.rewritten),
            "state": _fp8_state(model),
        }
        if name == "current":
            # Under FSDP2 the weight is gathered before the graph quantizes it: same scale on every rank.
            results[name]["weight_scales"] = {
                row.path: row.scale for row in compiled.fp8graph_stats.record(STEPS) if row.role == "weight"}
        if name == "delayed":
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=f"{out_dir}/checkpoint")
            results[name]["continued"] = [_global_loss(_step(compiled, optimizer, tokens))
                                          for tokens in batches[STEPS:]]
    torch.save(results, f"{out_dir}/fsdp-rank{rank}.pt")


def _resume_rank(rank, world_size, out_dir):
    model, compiled, optimizer = _sharded_model(RECIPES["delayed"])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=f"{out_dir}/checkpoint")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    loaded = _fp8_state(model)
    batches = [_local(tokens, rank, world_size) for tokens in _global_batches()]
    losses = [_global_loss(_step(compiled, optimizer, tokens)) for tokens in batches[STEPS:]]
    torch.save({"loaded": loaded, "losses": losses, "state": _fp8_state(model)},
               f"{out_dir}/resume-rank{rank}.pt")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Two FSDP2 ranks train every recipe; the delayed run's checkpoint resumes on four."""
    out_dir = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(_fsdp_rank, 2, str(out_dir))
    spawn_ranks(_resume_rank, 4, str(out_dir))
    two = [torch.load(out_dir / f"fsdp-rank{r}.pt") for r in range(2)]
    four = [torch.load(out_dir / f"resume-rank{r}.pt") for r in range(4)]
    return two, four


# Largest relative loss difference, FSDP2 on 2 ranks vs one process, 3 steps (measured):
# current 6.0e-5; row-wise, block and delayed 1.2e-7 (one or two fp32 ulps).
# Current scaling takes the input's and grad_output's amax over each rank's half
# of the batch, so their scales, and a few roundings, differ from the whole
# batch's; so can row-wise scales of the wgrad operands, whose rows span the
# rank's tokens (being powers of 2, here they did not change). Block tiles that
# span tokens hold 128 of them, exactly one rank's half, and delayed scaling
# reduces its amaxes across ranks: only the fp32 summation order differs, and
# the bound leaves room for one element crossing an FP8 rounding boundary
# (about 1e-5 of the loss), not for a different scale.
LOSS_RTOL = {"current": 5e-4, "rowwise": 5e-4, "block": 1e-5, "delayed": 1e-5}


@pytest.mark.parametrize("name", list(RECIPES))
def test_fsdp2_losses_match_one_process(fsdp_runs, name):
    two, _ = fsdp_runs
    # Each rank's share of the loss comes from its own half of the batch.
    assert all(a != b for a, b in zip(two[0][name]["local_losses"], two[1][name]["local_losses"]))
    assert two[0][name]["rewritten"] == two[1][name]["rewritten"]
    # Each decoder layer is a region (fully_shard per layer leaves the blocks as they were): both
    # layers run the one graph compiled for them, with the layer's 7 projections in FP8.
    sites_per_graph = sorted(two[0][name]["fp8_sites_per_graph"])
    assert [n for n in sites_per_graph if n] == [7]
    assert len(two[0][name]["rewritten"]) == LINEAR_SITES, two[0][name]["rewritten"]
    single = _single_process_losses(name)[:STEPS]
    torch.testing.assert_close(torch.tensor(two[0][name]["losses"]), torch.tensor(single),
                               rtol=LOSS_RTOL[name], atol=0)


def test_fsdp2_ranks_hold_the_same_scales(fsdp_runs):
    two, _ = fsdp_runs
    delayed = [rank["delayed"]["state"] for rank in two]
    assert len(delayed[0]) == 4 * LINEAR_SITES  # a history and a scale per weight, forward and grad_output
    for key in delayed[0]:
        assert torch.equal(delayed[0][key], delayed[1][key]), key
    weight_scales = [rank["current"]["weight_scales"] for rank in two]
    assert len(weight_scales[0]) == LINEAR_SITES
    assert weight_scales[0] == weight_scales[1]


def test_fsdp2_step_issues_amax_reductions_only_for_delayed_scaling(fsdp_runs):
    two, _ = fsdp_runs
    counts = {name: two[0][name]["collectives"] for name in RECIPES}
    fsdp_collectives = {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"}
    for name in ("current", "rowwise", "block"):
        # FSDP2's own all-gathers and reduce-scatters, plus the all-reduce of the reported loss
        assert set(counts[name]) - fsdp_collectives == {"c10d::allreduce_"}, counts[name]
        assert counts[name]["c10d::allreduce_"] == 1
        assert counts[name]["c10d::_allgather_base_"] == counts["delayed"]["c10d::_allgather_base_"]
    # delayed: one max all-reduce per call and direction, each waited on once: a call (q/k/v, o,
    # gate/up, down in each layer) reduces its input's and weights' amaxes together in the forward and
    # its grad_outputs' in the backward. Its weights are all-gathered in FP8 (fp8graph.fsdp): one more
    # all-reduce per step, of every gathered weight's shard amax at once.
    amax_reductions = 2 * CALLS
    assert counts["delayed"]["_c10d_functional::all_reduce"] == amax_reductions, counts["delayed"]
    assert counts["delayed"]["c10d::allreduce_"] == amax_reductions + 1 + 1


def test_fsdp2_checkpoint_from_two_ranks_resumes_on_four(fsdp_runs):
    two, four = fsdp_runs
    saved = two[0]["delayed"]["state"]
    for rank in four:
        assert rank["loaded"].keys() == saved.keys()
        for key in saved:
            assert torch.equal(rank["loaded"][key], saved[key]), key
    # Same global batches, same state: four ranks continue as two did, and as one process
    # that trained all the steps (fp32 summation order only, as above).
    torch.testing.assert_close(torch.tensor(four[0]["losses"]), torch.tensor(two[0]["delayed"]["continued"]),
                               rtol=1e-5, atol=0)
    single = _single_process_losses("delayed")[STEPS:]
    torch.testing.assert_close(torch.tensor(four[0]["losses"]), torch.tensor(single), rtol=1e-5, atol=0)
    for key in four[0]["state"]:
        assert all(torch.equal(rank["state"][key], four[0]["state"][key]) for rank in four), key


# --- DDP, 2 ranks, compile around DDP: Dynamo cuts the graph at bucket boundaries ----------------

def _ddp_rank(rank, world_size, out_dir):
    model = build("llama", CONFIG, seed=0)
    ddp = parallelize(model, "ddp", bucket_cap_mb=1)  # gradients summed over ranks
    compiled = fp8graph.compile(ddp, policy=RECIPES["delayed"], compiler="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [_local(tokens, rank, world_size) for tokens in _global_batches()]

    losses = [_global_loss(_step(compiled, optimizer, tokens)) for tokens in batches[:STEPS - 1]]
    collectives = collectives_issued(
        lambda: losses.append(_global_loss(_step(compiled, optimizer, batches[STEPS - 1]))))
    backend = compiled.fp8graph_backend
    report = fp8graph.explain(compiled, batches[0])
    torch.save({"losses": losses, "collectives": collectives, "graph_count": backend.graph_count,
                "compiled_paths": [d.site.path for d in backend.decisions if d.rewritten],
                "explained_paths": [r.path for r in report if r.recipe is not None],
                "explain_graphs": report.graph_count, "state": _fp8_state(model)},
               f"{out_dir}/ddp-rank{rank}.pt")


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_graph_split_at_buckets_rewrites_every_piece(tmp_path, world_size):
    spawn_ranks(_ddp_rank, world_size, str(tmp_path))
    ranks = [torch.load(tmp_path / f"ddp-rank{r}.pt") for r in range(world_size)]
    result = ranks[0]
    assert result["graph_count"] >= 2  # DDPOptimizer handed the backend one graph per bucket
    assert result["explain_graphs"] == result["graph_count"]
    # Each site once, by the user's module paths (no DDP "module." prefix).
    assert sorted(result["compiled_paths"]) == sorted(set(result["compiled_paths"]))
    assert len(result["compiled_paths"]) == LINEAR_SITES
    assert sorted(result["explained_paths"]) == sorted(result["compiled_paths"])
    assert all(path.startswith("model.layers.") for path in result["compiled_paths"])
    for key in result["state"]:
        assert all(torch.equal(result["state"][key], rank["state"][key]) for rank in ranks), key
    assert result["collectives"]["_c10d_functional::all_reduce"] == 2 * CALLS
    single = _single_process_losses("delayed")[:STEPS]
    # Amaxes are reduced and gradients summed: the scales are the whole batch's (measured 1.2e-7).
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single), rtol=1e-5, atol=0)


# --- The torchrun commands of docs/distributed.md (tests/test_docs.py parses them, this runs them) ---

def _torchrun(nproc, *args):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "-m", "fp8graph", "train-distributed", "--seq-len", "32", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_torchrun_trains_on_two_ranks_and_resumes_on_four(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    two = _torchrun(2, "--recipe", "delayed", "--steps", "2", "--checkpoint", str(checkpoint))
    assert re.findall(r"^step +(\d+)", two, re.M) == ["1", "2"]
    assert "fsdp2 on 2 ranks, delayed: 14 of 15 sites in FP8, 14 of 21 weights all-gathered in FP8" in two
    four = _torchrun(4, "--recipe", "delayed", "--steps", "3", "--checkpoint", str(checkpoint))
    assert re.findall(r"^step +(\d+)", four, re.M) == ["3"]
    # Each rank receives every weight whatever the world size: the same bytes per step on 2 and 4 ranks.
    gathered = [re.findall(r"all-gathered ([\d.]+) MB per rank", output, re.M) for output in (two, four)]
    assert len(gathered[0]) == 2 and gathered[0][1] == gathered[1][0] and float(gathered[1][0]) > 0
    assert "fsdp2 on 4 ranks" in four and "saved step 3" in four
