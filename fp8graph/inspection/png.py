"""Write a matplotlib figure as a PNG file without a display (the Agg backend)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

__all__ = ["write_png"]


def write_png(make_figure: Callable, path, dpi: int) -> pathlib.Path:
    """Build the figure with ``make_figure()`` after selecting Agg, save it, and free it.

    The backend is chosen before pyplot creates the figure, so a machine
    without a display (CI, a GPU node) never tries to open a window.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = make_figure()
    path = pathlib.Path(path)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path
