"""coat-train's loss plot, drawn by matplotlib: the optional extra ``coat-models[plot]``.

Without matplotlib a run still writes its metrics and summaries; ``PLOT_HINT`` says how to
get the picture.
"""

from __future__ import annotations

import io

PLOT_HINT = "pip install 'coat-models[plot]' (matplotlib) to get loss.png"


class PlotUnavailable(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def loss_figure(runs: dict[str, dict]):
    """A matplotlib ``Figure`` of loss curves. ``runs``: name -> ``{"train": (steps,
    losses), "val": (steps, losses)}``; per run a thin, light train line and a thick
    validation line with markers, in one colour of matplotlib's cycle (``C0``, ``C1``, ...).
    Raises ``PlotUnavailable`` without matplotlib."""
    try:
        # Figure alone, not pyplot: no global state, no GUI backend, safe in any process.
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(f"matplotlib is not installed: {PLOT_HINT}") from None
    fig = Figure(figsize=(9, 5.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, (name, run) in enumerate(runs.items()):
        colour = f"C{i}"
        ax.plot(*run["train"], color=colour, alpha=0.45, linewidth=1, label=f"{name} train")
        if len(run["val"][0]):
            ax.plot(*run["val"], color=colour, linewidth=2.5, marker="o", label=f"{name} val")
    ax.set(title="loss vs step", xlabel="optimizer step", ylabel="loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def loss_plot_png(runs: dict[str, dict]) -> bytes:
    """``loss_figure(runs)`` as PNG bytes (900 x 560 pixels)."""
    buf = io.BytesIO()
    loss_figure(runs).savefig(buf, format="png")
    return buf.getvalue()
