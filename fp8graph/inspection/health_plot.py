"""The FP8 health figure: per-site SQNR and underflow over a run, the worst sites named.

A model has dozens of FP8 sites; drawn alike with one legend entry each, no
line can be told from another. So each panel picks the few sites that are
least healthy by its own metric at the last recorded step (lowest SQNR,
highest underflow), draws them in colour with a legend entry that gives the
final value, and draws every other site as a thin grey line: the grey band
shows what healthy looks like, the coloured lines which site falls out of it.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Iterable

from fp8graph.inspection.png import write_png
from fp8graph.numerics.health import StatsRow

__all__ = ["least_healthy", "health_figure", "save_health_figure"]

_GREY = "#b8b8b8"
# (metric attribute, axis label, scale to the plotted unit, whether higher is worse)
_PANELS = (("sqnr_db", "SQNR (dB)", 1.0, False),
           ("underflow", "underflow (% of non-zeros)", 100.0, True))


def _series(rows: Iterable[StatsRow], role: str) -> dict[str, list[StatsRow]]:
    """``{site path: rows in step order}`` for one role."""
    series: dict[str, list[StatsRow]] = {}
    for row in sorted((r for r in rows if r.role == role), key=lambda r: r.step):
        series.setdefault(row.path or "<root>", []).append(row)
    return series


def _same_tensor_groups(series: dict[str, list[StatsRow]]) -> dict[str, list[str]]:
    """``{label: paths}``: sibling sites that cast one tensor, drawn as one line.

    q, k and v projections read the same input, so their input rows are equal
    in every metric at every step; listing them as three "least healthy"
    sites would hide two others. Only siblings (one parent module) whose rows
    agree on all five metrics are merged: two unrelated sites that merely share
    an underflow of 0 stay apart.
    """
    groups: dict[tuple, list[str]] = {}
    for path, site_rows in series.items():
        history = tuple((r.step, r.amax, r.scale, r.underflow, r.overflow, r.sqnr_db) for r in site_rows)
        groups.setdefault((path.rpartition(".")[0], history), []).append(path)
    return {_joined_label(parent, paths): paths for (parent, _), paths in groups.items()}


def _joined_label(parent: str, paths: list[str]) -> str:
    """Siblings ``a.b.q_proj`` and ``a.b.k_proj`` as ``a.b.{q_proj,k_proj}``."""
    if len(paths) == 1:
        return paths[0]
    leaves = ",".join(path.rpartition(".")[2] for path in paths)
    return f"{parent}.{{{leaves}}}" if parent else f"{{{leaves}}}"


def least_healthy(rows: Iterable[StatsRow], role: str, metric: str, count: int,
                  higher_is_worse: bool) -> list[str]:
    """The labels of the ``count`` sites whose last ``metric`` for ``role`` is worst, worst first.

    Sites with identical histories (one shared input) count once, labelled
    together (see :func:`_same_tensor_groups`). A non-finite value ranks by
    what it means: NaN is the worst of all (the cast produced garbage), an
    infinite SQNR (an exact cast) the best.
    """
    series = _series(rows, role)
    return _worst_groups(series, _same_tensor_groups(series), metric, count, higher_is_worse)


def _worst_groups(series: dict[str, list[StatsRow]], groups: dict[str, list[str]], metric: str,
                  count: int, higher_is_worse: bool) -> list[str]:
    """The ``count`` worst groups by their last ``metric``; a perfect value (no underflow, an
    exact cast's infinite SQNR) is never "least healthy", however few sites there are."""
    def final(label: str) -> float:
        return getattr(series[groups[label][0]][-1], metric)

    def badness(label: str) -> float:
        value = final(label)
        if math.isnan(value):
            return math.inf
        return value if higher_is_worse else -value

    perfect = 0.0 if higher_is_worse else math.inf
    return sorted((label for label in groups if final(label) != perfect), key=badness, reverse=True)[:count]


def _marker(site_rows: list[StatsRow]) -> str | None:
    """A line of one point draws nothing: mark the points of a site recorded once."""
    return "o" if len(site_rows) < 2 else None


def health_figure(rows: list[StatsRow], role: str = "input", highlight: int = 5):
    """A matplotlib Figure with the SQNR and underflow panels for one role."""
    import matplotlib.pyplot as plt

    series = _series(rows, role)
    groups = _same_tensor_groups(series)
    figure, axes = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for axis, (metric, label, unit, higher_is_worse) in zip(axes, _PANELS):
        worst = _worst_groups(series, groups, metric, highlight, higher_is_worse)
        for group_label, paths in groups.items():
            if group_label in worst:
                continue  # drawn on top below, in colour
            site_rows = series[paths[0]]
            axis.plot([r.step for r in site_rows], [unit * getattr(r, metric) for r in site_rows],
                      color=_GREY, linewidth=0.7, zorder=1, marker=_marker(site_rows), markersize=3)
        for rank, group_label in enumerate(worst):
            site_rows = series[groups[group_label][0]]
            final = unit * getattr(site_rows[-1], metric)
            axis.plot([r.step for r in site_rows], [unit * getattr(r, metric) for r in site_rows],
                      color=plt.cm.tab10(rank), linewidth=1.6, zorder=2, marker=_marker(site_rows),
                      label=f"{group_label} ({final:.3g})")
        others = len(series) - sum(len(groups[group_label]) for group_label in worst)
        axis.set_ylabel(f"{role} {label}")
        if worst:
            direction = "highest" if higher_is_worse else "lowest"
            axis.legend(fontsize=7, loc="best",
                        title=f"{direction} at the last step; {others} other sites in grey",
                        title_fontsize=7)
    axes[-1].set_xlabel("step")
    axes[0].set_title(f"FP8 health per site ({role}, {len(series)} sites)")
    figure.tight_layout()
    return figure


def save_health_figure(rows: list[StatsRow], path, role: str = "input", highlight: int = 5) -> pathlib.Path:
    """Write :func:`health_figure` as a PNG (no display needed)."""
    return write_png(lambda: health_figure(rows, role, highlight), path, dpi=110)
