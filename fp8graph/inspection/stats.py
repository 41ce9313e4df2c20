"""FP8 numerics statistics, collected inside the compiled graphs (off by default).

    compiled = fp8graph.compile(model, stats=True)
    for step in range(steps):
        loss = compiled(batch).loss
        loss.backward()
        compiled.fp8graph_stats.record(step)       # one device-to-host copy per step
    stats = compiled.fp8graph_stats
    print(stats)                                    # latest step, one row per site and role
    stats.to_csv("stats.csv"); stats.to_tensorboard("runs/fp8"); stats.plot("fp8_health.png")

The buffers and how they reach the compiled graphs: :mod:`fp8graph.buffers.stats`.
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

from fp8graph.buffers.stats import STATS_BUFFER, register_stats_buffers, remove_stats_buffers
from fp8graph.inspection.health_plot import save_health_figure
from fp8graph.numerics.formats import ROLES
from fp8graph.numerics.health import HEALTH_METRICS, StatsRow

__all__ = ["FP8Stats", "StatsRow"]


class FP8Stats:
    """Per-site, per-role FP8 health of a model compiled with ``stats=True``.

    Rows accumulate in :attr:`rows` at each :meth:`record`; a site and role
    appear once they have been cast at least once since the previous record
    (grad_output rows need a backward pass).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.modules, _ = register_stats_buffers(model)
        self.rows: list[StatsRow] = []

    def buffer_of(self, path: str) -> torch.Tensor | None:
        """The stats buffer of the module at ``path`` (``None`` if the model has no such module, or after
        :meth:`remove`)."""
        module = self.modules.get(path)
        return None if module is None else getattr(module, STATS_BUFFER)

    def record(self, step: int) -> list[StatsRow]:
        """Read what the compiled graphs wrote since the last record, as rows for ``step``."""
        if not self.modules:
            raise RuntimeError("fp8graph_stats: removed from the model (remove()), so nothing records; compile it "
                               "again with stats=True to collect again")
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
        and named in its legend, the others in grey (see ``fp8graph.inspection.health_plot``).
        """
        return save_health_figure(self.rows, path, role, highlight)

    def remove(self) -> None:
        """Detach from the model: drop the hooks and the buffers. The compiled model recompiles at its next call,
        without stats; the rows recorded so far stay."""
        remove_stats_buffers(self.model)
        self.modules = {}
