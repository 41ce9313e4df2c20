"""Shared test helpers: compile with a handle on the backend's decisions; run a kernel check under Triton's
interpreter."""

import os
import pathlib
import subprocess
import sys

import torch

import fp8graph
from fp8graph.numerics import health


class Checkpointed(torch.nn.Module):
    """``module`` run under ``torch.utils.checkpoint`` (non-reentrant): one checkpoint region."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.module, x, use_reentrant=False)


def compile_fp8(model, compiler="aot_eager", **kwargs):
    """``fp8graph.compile`` returning ``(compiled, backend)``."""
    compiled = fp8graph.compile(model, compiler=compiler, **kwargs)
    return compiled, compiled.fp8graph_backend


def graphs_per_unit(backend) -> list[int]:
    """Graphs each compiled unit kept: ``[n]`` for a whole-model compile, ``[root, group, ...]`` with regions.

    Every entry 1 means what one graph meant before regions: no graph break (other than the region
    boundaries fp8graph makes) and no recompile.
    """
    units = [backend.root, *backend.block_backends] if hasattr(backend, "block_backends") else [backend]
    return [len(unit.graph_modules) for unit in units]


def fp8_sites_compiled(backend) -> int:
    """FP8 linears in the compiled graphs, a region's counted once for each instance it serves."""
    if not hasattr(backend, "block_backends"):
        return sum(fp8_target_count(gm) for gm in backend.graph_modules)
    return (sum(fp8_target_count(gm) for gm in backend.root.graph_modules)
            + sum(fp8_target_count(gm) * len(unit.group.paths) for unit in backend.block_backends
                  for gm in unit.graph_modules))


def decisions_by_path(backend):
    return {d.site.path: d for d in backend.decisions}


def fp8_target_count(gm: torch.fx.GraphModule) -> int:
    """FP8 sites called in ``gm``: one per call, a group's call (``fp8graph_linears_*``) one per weight."""
    return sum(len(n.args[1]) if n.target.__name__.startswith("fp8graph_linears_") else 1 for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "__name__", "").startswith("fp8graph_"))


def sgd_steps(compiled, model, batches, steps, lr=1e-2, optimizer=None):
    """Plain training loop (AdamW unless ``optimizer`` is given); returns the loss of every step."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        tokens = batches.next()
        loss = compiled(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


_SCRIPTS = pathlib.Path(__file__).parent / "scripts"
_HEADER = "=== fp8graph interpreter check: "  # a line of its own before each script's output
# Runs every check script in one process (imports paid once: about 4 s of a 9 s check each), each script's output
# (or its traceback) after a line naming it.
_RUN_EVERY_CHECK = f"""
import contextlib, io, pathlib, runpy, sys, traceback
sys.path.insert(0, {str(_SCRIPTS.parent)!r})
import garbage_collection  # the collector tuned as in the test workers
sys.path[0] = {str(_SCRIPTS)!r}
for path in sorted(pathlib.Path({str(_SCRIPTS)!r}).glob("check_*.py")):
    output = io.StringIO()
    status = "passed"
    try:
        with contextlib.redirect_stdout(output):
            runpy.run_path(str(path), run_name="__main__")
    except BaseException:
        status = "failed"
        output.write(traceback.format_exc())
    print(f"{_HEADER}{{path.name}} {{status}}")
    print(output.getvalue())
"""
_interpreted: dict[str, tuple[str, str]] = {}  # script -> (status, output), of this process's one run of them all


def cases_checked_under_triton_interpreter(script_name: str) -> int:
    """Run ``tests/scripts/<script_name>`` under ``TRITON_INTERPRET=1`` (read when a kernel is defined, so never
    in this process) and return the number of cases it says it checked. Every check script runs in one fresh
    process, once a test process: each script is a separate run there (``runpy``), failing alone."""
    if not _interpreted:
        result = subprocess.run([sys.executable, "-c", _RUN_EVERY_CHECK], env=dict(os.environ, TRITON_INTERPRET="1"),
                                capture_output=True, text=True, timeout=1200)
        name = None
        for line in result.stdout.splitlines():
            if line.startswith(_HEADER):
                name, status = line.removeprefix(_HEADER).split()
                _interpreted[name] = (status, "")
            elif name is not None:
                _interpreted[name] = (_interpreted[name][0], _interpreted[name][1] + line + "\n")
        if result.returncode != 0:  # the process died: the scripts it did not finish fail with its output
            for path in _SCRIPTS.glob("check_*.py"):
                _interpreted.setdefault(path.name, ("crashed", result.stdout + result.stderr))
    assert script_name in _interpreted, sorted(_interpreted)
    status, output = _interpreted[script_name]
    assert status == "passed", output
    counted = [line for line in output.splitlines() if line.startswith("cases checked: ")]
    assert counted, output
    return int(counted[-1].split(": ")[1])


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """fp8graph's SQNR (``fp8graph.numerics.health.sqnr_db``) of ``actual`` against ``reference``, in fp64."""
    return float(health.sqnr_db(reference.detach().to(torch.float64), actual.detach().to(torch.float64)))


def gathered_by_two_ranks(recipe, weight_hp: torch.Tensor, requires_grad: bool = False):
    """``weight_hp`` as FSDP2's FP8 all-gather over two ranks hands it to the graph: each half's shard cast
    (``fp8graph.fsdp.shard_casts``), concatenated along the first dimension as the gather does."""
    from fp8graph.buffers.kept_casts import ReuseScope
    from fp8graph.fsdp.shard_casts import GatherCalls, TiledShardCast

    cast = TiledShardCast("weight", recipe, weight_hp, weight_hp.dtype, GatherCalls(ReuseScope()))
    sent = [cast._cast(shard) for shard in weight_hp.detach().chunk(2)]
    weight, _ = cast.fsdp_post_all_gather(tuple(torch.cat(parts) for parts in zip(*sent)), (), weight_hp.dtype)
    return weight.requires_grad_(requires_grad)


def group_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each group of rows that expert-GEMM ``offsets`` (E,) end."""
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))
