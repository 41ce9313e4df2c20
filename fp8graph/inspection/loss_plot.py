"""The demo's loss figure: both training curves, and below them the FP8 minus reference gap.

Two curves that overlap to the pixel hide a gap of a few hundredths of a nat,
which is what a user wants to see; the lower panel shows it per step (grey)
and as a moving mean over a twentieth of the run (coloured), against zero.
"""

from __future__ import annotations

import pathlib

from fp8graph.inspection.png import write_png

__all__ = ["loss_figure", "save_loss_figure"]


def _moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
            for i in range(len(values))]


def loss_figure(fp8_losses: list[float], reference_losses: list[float], reference_name: str):
    """A matplotlib Figure: the losses above, ``fp8 - reference`` below."""
    import matplotlib.pyplot as plt

    marker = "o" if len(fp8_losses) < 2 else None  # a one-point line draws nothing
    figure, (loss_axis, gap_axis) = plt.subplots(
        2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": (2, 1)})
    for name, losses in (("FP8", fp8_losses), (reference_name, reference_losses)):
        loss_axis.plot(losses, label=f"{name} (final {losses[-1]:.3f})", linewidth=1, marker=marker)
    loss_axis.set_ylabel("training loss (nats per byte)")
    loss_axis.set_title(f"Llama on Python reference text: FP8 vs {reference_name}")
    loss_axis.legend()
    gap = [fp8 - reference for fp8, reference in zip(fp8_losses, reference_losses)]
    gap_axis.axhline(0.0, color="black", linewidth=0.6)
    gap_axis.plot(gap, color="#b8b8b8", linewidth=0.7, marker=marker, label="per step")
    window = len(gap) // 20
    if window > 1:  # a mean of one step would only repeat the grey line
        gap_axis.plot(_moving_average(gap, window), color="#d95f02", linewidth=1.6,
                      label=f"mean of {window} steps")
    gap_axis.set_ylabel(f"FP8 - {reference_name} loss")
    gap_axis.set_xlabel("step")
    gap_axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def save_loss_figure(fp8_losses: list[float], reference_losses: list[float], reference_name: str,
                     path) -> pathlib.Path:
    """Write :func:`loss_figure` as a PNG (no display needed)."""
    return write_png(lambda: loss_figure(fp8_losses, reference_losses, reference_name), path, dpi=120)
