"""Train a Llama in FP8 on several processes with FSDP2 or DDP, checkpointing with torch.distributed.checkpoint.

    torchrun --nproc-per-node 2 -m fp8graph train-distributed --recipe delayed --steps 20 --checkpoint ckpt
    torchrun --nproc-per-node 4 -m fp8graph train-distributed --recipe delayed --steps 20 --checkpoint ckpt

The second command resumes from what the first saved, on another world size.
Each decoder layer and then the model are ``fully_shard``-ed (or the model is
wrapped in ``DistributedDataParallel`` with ``--parallel ddp``) before
``fp8graph.compile``. On CPU the processes talk over gloo and the graphs are
lowered with ``aot_eager``; on GPUs over NCCL, one GPU per process, through
Inductor.

The loss is world-size invariant: each rank sums its tokens' losses, divides
by the global token count, and the ranks' gradients are summed. Then every
tensor a GEMM sees in backward is the same whatever the world size, and so is
delayed scaling's grad_output history in a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import pathlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

import fp8graph
from fp8graph.fsdp.gather_bytes import count_all_gathers
from fp8graph.models import build
from fp8graph.models.text_data import TextBatches
from fp8graph.recipes.scaling import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", choices=tuple(PRESETS), default="current")
    parser.add_argument("--parallel", choices=("fsdp2", "ddp"), default="fsdp2")
    parser.add_argument("--steps", type=int, default=20, help="train until this global step")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--model", default="tiny-blocks", help="Llama config from fp8graph.models.llama")
    parser.add_argument("--fp8-all-gather", action=argparse.BooleanOptionalAction, default=True,
                        help="FSDP2 all-gathers the FP8 sites' weights in FP8 "
                             "(fp8graph.compile's fp8_all_gather)")
    parser.add_argument("--checkpoint", type=pathlib.Path, default=None,
                        help="resume from this directory when it holds a checkpoint; save into it at the end")


def sum_gradients(process_group, bucket):
    """DDP communication hook: sum the ranks' gradients instead of averaging them."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def parallelize(model: torch.nn.Module, parallel: str, **ddp_kwargs) -> torch.nn.Module:
    """The module to compile: a Llama ``model`` sharded in place (FSDP2), or wrapped in DDP.

    Either way the ranks' gradients are summed, not averaged (see the module docstring).
    """
    if parallel == "ddp":
        # No buffer broadcast from rank 0 before each forward: fp8graph's state is
        # already identical on every rank (amaxes reduced in the graph), and a
        # broadcast would cost a collective per step and hide a divergence.
        ddp_kwargs.setdefault("broadcast_buffers", False)
        ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        ddp.register_comm_hook(None, sum_gradients)
        return ddp
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def summed_loss(logits: torch.Tensor, tokens: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """Next-token cross entropy of this rank's ``tokens``, summed and divided by the global count."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                           reduction="sum") / global_tokens


def _checkpoint_step(path: pathlib.Path | None) -> int:
    step_file = None if path is None else path / "step.txt"
    return int(step_file.read_text()) if step_file is not None and step_file.exists() else 0


def run(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ:
        raise SystemExit("train-distributed runs under torchrun: torchrun --nproc-per-node 2 -m fp8graph "
                         "train-distributed ...")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        _train(args, use_cuda)
        # Every rank done before any tears its group down: rank 0 writes and prints after the checkpoint, and a
        # peer that closed its connections meanwhile aborted rank 0's gloo teardown now and then ("terminate
        # called without an active exception", under load). Not on an error: the other ranks may never come.
        dist.barrier()
    finally:
        # After _train's frame is gone: a DDP module destroyed after its process group hangs at exit.
        dist.destroy_process_group()
    return 0


def _train(args: argparse.Namespace, use_cuda: bool) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world_size:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {world_size} ranks")
    device = torch.device("cuda" if use_cuda else "cpu")
    model = build("llama", args.model, seed=0).to(device)
    module = parallelize(model, args.parallel)
    compiled = fp8graph.compile(module, policy=PRESETS[args.recipe], compiler="inductor" if use_cuda else "aot_eager",
                                fp8_all_gather=args.fp8_all_gather)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # FSDP2's all-gathers counted at the collective: what each step gathers per rank.
    gathers = count_all_gathers(model) if args.parallel == "fsdp2" else None

    start = _checkpoint_step(args.checkpoint)
    if start:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(args.checkpoint))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    # Every rank draws the same global batches and keeps its share.
    batches = TextBatches(args.global_batch, args.seq_len, vocab_size=model.config.vocab_size, seed=0)
    local = args.global_batch // world_size
    global_tokens = args.global_batch * (args.seq_len - 1)
    for step in range(args.steps):
        tokens = batches.next()
        if step < start:
            continue  # consumed before the checkpoint
        tokens = tokens[rank * local:(rank + 1) * local].to(device)
        if gathers is not None:
            gathers.reset()
        loss = summed_loss(compiled(tokens).logits, tokens, global_tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        if rank == 0:
            gathered = "" if gathers is None else f"  all-gathered {gathers.gathered_bytes / 1e6:.2f} MB per rank"
            print(f"step {step + 1:4d}  loss {loss.item():.4f}{gathered}", flush=True)

    decisions = compiled.fp8graph_backend.decisions
    if rank == 0 and decisions:
        plan = compiled.fp8graph_backend.all_gather
        in_fp8 = "" if plan is None or not plan.records else \
            f", {sum(r.fp8 for r in plan.records)} of {len(plan.records)} weights all-gathered in FP8"
        print(f"{args.parallel} on {world_size} ranks, {args.recipe}: "
              f"{sum(d.rewritten for d in decisions)} of {len(decisions)} sites in FP8{in_fp8}", flush=True)
    if args.checkpoint is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(args.checkpoint))
        if rank == 0:
            (args.checkpoint / "step.txt").write_text(str(max(start, args.steps)))
            print(f"saved step {max(start, args.steps)} to {args.checkpoint}", flush=True)
