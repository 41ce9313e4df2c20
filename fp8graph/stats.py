"""FP8 numerics statistics, collected inside the compiled graphs (off by default).

    compiled = fp8graph.compile(model, stats=True)
    for step in range(steps):
        loss = compiled(batch).loss
        loss.backward()
        compiled.fp8graph_stats.record(step)       # one device-to-host copy per step
    stats = compiled.fp8graph_stats
    print(stats)                                    # latest step, one row per site and role
    stats.to_csv("stats.csv"); stats.to_tensorboard("runs/fp8"); stats.plot("fp8_health.png")

How it stays in the graph: :class:`FP8Stats` registers on every module a
non-persistent buffer ``fp8graph_stats`` of shape (3 roles, 5 metrics), and
on every submodule a forward hook that passes the module's buffer (and the
root's, for sites in the root's own forward, whose hooks Dynamo runs outside
the graph) to :func:`stats_anchor`. Dynamo therefore lifts the buffers as
graph inputs; the backend removes the anchors and hands each FP8 site the
buffer of its module, whose forward writes the input and weight rows and
whose backward writes the grad_output row, in place (AOTAutograd keeps input
mutations, also from backward). A module called twice in one graph reports
its last call; one whose sites land in two training graphs is refused (see
``FP8Backend._claim_written_buffers``). A module reachable by two paths
reports under its first (``named_modules()``). Without ``stats=True`` none of this exists: no buffer, no
hook, no extra graph node.

Why a buffer per module and not one for the model: a buffer that backward
writes is saved for backward, and autograd refuses a saved tensor that
changed since. With one shared buffer, a model compiled into several graphs
(a graph break between layers, FSDP2's per-layer graphs) would have the
second graph's forward change what the first graph's backward saved. The
root's buffer is anchored in every graph but only written by sites in the
root's own forward; a model with no submodules has only the root's, and
Dynamo runs the root's hooks outside the graph, so its stats stay empty.
The hook runs after the module's forward, so DDP's graph split keeps it in
the same piece as the module's GEMM (see ``fp8graph.state``).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import pathlib

import torch
from rich.console import Console
from rich.table import Table

from .formats import ROLES
from .health import HEALTH_METRICS, StatsRow
from .health_plot import save_health_figure

__all__ = ["FP8Stats", "STATS_BUFFER", "StatsRow", "stats_anchor"]

STATS_BUFFER = "fp8graph_stats"


@torch._dynamo.allow_in_graph
def stats_anchor(*stats_buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Identity that Dynamo keeps as a graph node, so the stats buffers become graph inputs."""
    return stats_buffers


def _anchor_hook(root: torch.nn.Module):
    def reference_stats_buffers(module: torch.nn.Module, args, output) -> None:
        stats_anchor(getattr(module, STATS_BUFFER), getattr(root, STATS_BUFFER))

    return reference_stats_buffers


class FP8Stats:
    """Per-site, per-role FP8 health of a model compiled with ``stats=True``.

    Rows accumulate in :attr:`rows` at each :meth:`record`; a site and role
    appear once they have been cast at least once since the previous record
    (grad_output rows need a backward pass).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.modules = dict(model.named_modules())  # a module reached by two paths: its first
        for path, module in self.modules.items():
            if hasattr(module, STATS_BUFFER):
                raise ValueError(f"{path or '<root>'} already has a {STATS_BUFFER!r} attribute")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        for module in self.modules.values():
            module.register_buffer(STATS_BUFFER, torch.full((len(ROLES), len(HEALTH_METRICS)), float("nan"),
                                                            device=device), persistent=False)
        # Dynamo runs the root module's own hooks outside the graph, but inlines
        # those of the modules called inside it: hook every submodule.
        # A bare module (no submodules) is its own only hook: fp8graph.compile then traces its hooks.
        hook = _anchor_hook(model)
        bare = next(model.children(), None) is None
        self._hooks = [module.register_forward_hook(hook) for module in model.modules()
                       if module is not model or bare]
        self.rows: list[StatsRow] = []

    def buffer_of(self, path: str) -> torch.Tensor | None:
        """The stats buffer of the module at ``path`` (``None`` if the model has no such module)."""
        module = self.modules.get(path)
        return None if module is None else getattr(module, STATS_BUFFER)

    def record(self, step: int) -> list[StatsRow]:
        """Read what the compiled graphs wrote since the last record, as rows for ``step``."""
        buffers = [getattr(module, STATS_BUFFER) for module in self.modules.values()]
        with torch.no_grad():
            values = torch.stack(buffers).to("cpu", torch.float64)  # one device-to-host copy
            for buffer in buffers:
                buffer.fill_(float("nan"))
        new_rows = []
        for slot, path in enumerate(self.modules):
            for role_index, role in enumerate(ROLES):
                metrics = values[slot, role_index].tolist()
                if not math.isnan(metrics[0]) or not math.isnan(metrics[1]):
                    new_rows.append(StatsRow(step, path, role.value, *metrics))
        self.rows.extend(new_rows)
        return new_rows

    def latest(self) -> list[StatsRow]:
        """The rows of the most recent recorded step."""
        if not self.rows:
            return []
        last_step = self.rows[-1].step
        return [row for row in self.rows if row.step == last_step]

    def table(self, rows: list[StatsRow] | None = None) -> Table:
        """A table of ``rows`` (default: the latest step's)."""
        rows = self.latest() if rows is None else rows
        step = rows[0].step if rows else "-"
        table = Table(title=f"fp8graph stats, step {step}")
        for column in ("module path", "role", *HEALTH_METRICS):
            table.add_column(column)
        for row in rows:
            table.add_row(row.path or "<root>", row.role, f"{row.amax:.4g}", f"{row.scale:.4g}",
                          f"{row.underflow:.2%}", f"{row.overflow:.2%}", f"{row.sqnr_db:.1f}")
        return table

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=140, color_system=None).print(self.table())
        return buffer.getvalue()

    def to_csv(self, path) -> pathlib.Path:
        """Every recorded row, one per step, site and role."""
        path = pathlib.Path(path)
        with path.open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow([field.name for field in dataclasses.fields(StatsRow)])
            for row in self.rows:
                writer.writerow(dataclasses.astuple(row))
        return path

    def to_tensorboard(self, log_dir) -> pathlib.Path:
        """Write every row as TensorBoard scalars ``fp8/<metric>/<path>/<role>``."""
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(log_dir))
        for row in self.rows:
            for metric in HEALTH_METRICS:
                value = getattr(row, metric)
                if math.isfinite(value):
                    writer.add_scalar(f"fp8/{metric}/{row.path or 'root'}/{row.role}", value, row.step)
        writer.close()
        return pathlib.Path(log_dir)

    def plot(self, path, role: str = "input", highlight: int = 5) -> pathlib.Path:
        """PNG of per-site SQNR and underflow over the recorded steps for one role.

        The ``highlight`` least healthy sites of each panel are drawn in colour
        and named in its legend, the others in grey (see ``fp8graph.health_plot``).
        """
        return save_health_figure(self.rows, path, role, highlight)

    def remove(self) -> None:
        """Detach from the model: drop the hooks and the buffers (compiled graphs recompile)."""
        for hook in self._hooks:
            hook.remove()
        for module in self.modules.values():
            delattr(module, STATS_BUFFER)
