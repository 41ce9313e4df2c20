"""Delayed scaling under DDP: two gloo processes on CPU reduce amaxes in the graph.

Each rank sees half of every global batch. With ``reduce_amax`` both ranks
record the global amax, so they hold identical histories and scales without
DDP broadcasting buffers, and the losses match one process that sees the
whole batch.
"""

import torch
import torch.distributed as dist

import fp8graph
from fp8graph import DelayedScaling
from fp8graph.models import build

from gloo_ranks import spawn_ranks

STEPS, GLOBAL_BATCH = 5, 16
RECIPE = DelayedScaling(amax_history_len=4)
# The runs on a DDP of a group of one rank: (model, compiler); the MoE block in BF16 (grouped_mm multiplies BF16
# only), and each run's first history read, of the model's input.
OWN_GROUP_RUNS = (("mlp", "aot_eager"), ("mlp", "eager"), ("moe", "eager"))
DTYPES = {"mlp": torch.float32, "moe": torch.bfloat16}
INPUT_HISTORY = {"mlp": "up.fp8graph_amax_history_weight", "moe": "experts.fp8graph_amax_history_gate_up_proj"}


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(GLOBAL_BATCH, 64, generator=generator) for _ in range(STEPS)]


def _train(compiled, model, batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches:
        loss = compiled(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _rank_main(rank, world_size, out_dir):
    model = build("mlp", "tiny", seed=0)
    compiled = fp8graph.compile(model, policy=RECIPE, compiler="aot_eager")
    # No buffer broadcast: identical state must come from the in-graph all-reduce.
    ddp = torch.nn.parallel.DistributedDataParallel(compiled, broadcast_buffers=False)
    shard = GLOBAL_BATCH // world_size
    local = [x[rank * shard:(rank + 1) * shard] for x in _batches()]
    local_losses = _train(ddp, model, local)
    global_losses = []
    for loss in local_losses:  # the global batch's mean loss
        dist.all_reduce(loss)
        global_losses.append(loss / world_size)
    state = {k: v for k, v in model.state_dict().items() if "fp8graph" in k}
    # explain finds the compiled model's policy through the DDP wrapper.
    explained = [(r.path, r.recipe and str(r.recipe)) for r in fp8graph.explain(ddp, local[0])]
    torch.save({"losses": torch.stack(global_losses), "state": state, "explained": explained,
                "own_group_state": _trained_in_a_group_of_its_own(rank, world_size, local)},
               f"{out_dir}/rank{rank}.pt")


def _trained_in_a_group_of_its_own(rank, world_size, local):
    """Each rank a DDP of its own (process_group of one rank, as a pipeline stage's replicas would be): its amaxes
    are reduced over that group, not over every rank, in the backward too, also where the backward runs eagerly,
    outside the DDP's forward (``compiler="eager"``), and at expert GEMMs. Returns each run's delayed histories."""
    own = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group
    histories = {}
    for name, compiler in OWN_GROUP_RUNS:
        dtype = DTYPES[name]
        model = build(name, "tiny", seed=0, dtype=dtype)
        compiled = fp8graph.compile(model, policy=RECIPE, compiler=compiler)
        ddp = torch.nn.parallel.DistributedDataParallel(compiled, process_group=own, broadcast_buffers=False)
        _train(ddp, model, [x.reshape(-1, 8, 64).to(dtype) if name == "moe" else x for x in local[:1]])
        histories[name, compiler] = {k: v for k, v in model.state_dict().items() if "amax_history" in k}
    return histories


def test_two_ranks_hold_identical_state_and_match_one_process(tmp_path):
    spawn_ranks(_rank_main, 2, str(tmp_path))
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0["state"].keys() == rank1["state"].keys() and rank0["state"]
    for key in rank0["state"]:
        assert torch.equal(rank0["state"][key], rank1["state"][key]), key
    assert rank0["explained"] == [("up", RECIPE.name), ("mid", RECIPE.name), ("head", None)]
    # A DDP over a group of one rank reduces nothing: each rank's first input amax is its own half's, and the
    # ranks' grad_output amaxes differ (reduced over every rank, they would be equal).
    for run in OWN_GROUP_RUNS:
        for rank, saved in enumerate((rank0, rank1)):
            local = _batches()[0][rank * GLOBAL_BATCH // 2:(rank + 1) * GLOBAL_BATCH // 2].to(DTYPES[run[0]])
            # row 0: the input's amaxes, newest first (the experts' input: the tokens, each gathered top_k times)
            assert saved["own_group_state"][run][INPUT_HISTORY[run[0]]][0, 0] == local.abs().amax(), (run, rank)
        grad_keys = [key for key in rank0["own_group_state"][run] if "grad_output" in key]
        assert grad_keys, run
        for key in grad_keys:
            assert rank0["own_group_state"][run][key][0, 0] > 0, (run, key)
            assert rank0["own_group_state"][run][key][0, 0] != rank1["own_group_state"][run][key][0, 0], (run, key)

    model = build("mlp", "tiny", seed=0)
    compiled = fp8graph.compile(model, policy=RECIPE, compiler="aot_eager")
    single_losses = torch.stack(_train(compiled, model, _batches()))
    # Same scales (grad_output's differ by exactly 2x, a power of two); only
    # the fp32 summation order differs between half and whole batches, which
    # can move a value across an FP8 rounding boundary: one element in
    # thousands off by one FP8 step, about 1e-4 of the loss (measured 2.7e-4).
    torch.testing.assert_close(rank0["losses"], single_losses, rtol=1e-3, atol=0)
    single_state = {k: v for k, v in model.state_dict().items() if "fp8graph" in k}
    for key in ("up.fp8graph_amax_history_weight", "mid.fp8graph_amax_history_weight"):
        # input and weight amaxes are the global ones; grad_output's are 2x (local means)
        torch.testing.assert_close(rank0["state"][key], single_state[key], rtol=1e-5, atol=0)
