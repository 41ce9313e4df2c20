"""Helpers for tests that run several gloo processes on this CPU."""

import collections
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import forked

# Profiler event names of the collectives a step can issue: c10d ops (FSDP2's
# all-gather and reduce-scatter) and functional collectives traced into a
# compiled graph (fp8graph's amax reductions).
COLLECTIVE_EVENTS = ("c10d::", "_c10d_functional::all_reduce", "_c10d_functional::all_gather",
                     "_c10d_functional::reduce_scatter")


def _rank_entry(rank: int, fn, world_size: int, out_dir: str, env: dict[str, str]) -> None:
    forked.apply_environment(env)
    # A file rendezvous needs no port; the timeout turns a stuck collective into an error.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous-{world_size}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        fn(rank, world_size, out_dir)
    finally:
        # Only once fn's frame, and the DDP module in it, is gone: a DDP module
        # destroyed after its process group can hang the process at exit.
        dist.destroy_process_group()


def spawn_ranks(fn, world_size: int, out_dir: str, deadline_s: float = 300) -> None:
    """Run ``fn(rank, world_size, out_dir)`` in a gloo process group of ``world_size`` processes forked
    from the preloaded server (``forked``: no rank pays for importing torch); fail (not hang) past the
    deadline."""
    forked.context()  # the server imports what every rank needs, once
    context = mp.start_processes(_rank_entry, args=(fn, world_size, out_dir, dict(os.environ)), nprocs=world_size,
                                 join=False, start_method="forkserver")
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world_size} ranks did not finish within {deadline_s} s")


def collectives_issued(step) -> collections.Counter:
    """Run ``step()`` under the profiler and count the collectives it issues, by op name.

    Dynamo does not compile under a TorchDispatchMode (CommDebugMode), so the
    profiler, which leaves compiled code alone, is what sees them.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    return collections.Counter(event.name for event in profile.events()
                               if event.name.startswith(COLLECTIVE_EVENTS))
