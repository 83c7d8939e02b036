"""``training_report``: the monitor's statistics over training steps, one panel per question."""

from __future__ import annotations

import csv
import os
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from pergrad.plot._figure import new_figure, save


def load_history(source: Any) -> dict[str, np.ndarray]:
    """Columns of a monitor's log as float arrays: from a CSV path or a ``GradientMonitor``."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, newline="") as f:
            rows = list(csv.DictReader(f))
    elif hasattr(source, "history") and isinstance(source.history, list):
        rows = source.history
    else:
        raise TypeError("source must be a CSV path written by GradientMonitor(csv_path=...) or a "
                        f"GradientMonitor; got {type(source).__name__}.")
    if not rows:
        raise ValueError("The monitor's log has no rows yet: train with the monitor first.")
    return {key: np.array([float(r[key]) for r in rows]) for key in rows[0]}


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over ``window`` steps, ignoring non-finite entries (the mean of
    the finite values in each window; NaN where a window has none). The ends use the part of the
    window that exists, so the line spans every step."""
    values = np.asarray(values, np.float64)
    finite = np.isfinite(values)
    if window <= 1 or values.size == 0:
        return np.where(finite, values, np.nan)
    kernel = np.ones(window)
    total = np.convolve(np.where(finite, values, 0.0), kernel, mode="same")
    count = np.convolve(finite.astype(np.float64), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _window(steps: np.ndarray) -> int:
    """About a twentieth of the run, odd, at least 1."""
    return max(1, (len(steps) // 20) | 1)


def _series(ax, steps, values, color, label=None, log=False) -> None:
    """The raw series, faint, and its moving average on top (positive values only on a log
    axis)."""
    values = np.asarray(values, np.float64)
    if log:
        values = np.where(values > 0, values, np.nan)
    ax.plot(steps, values, color=color, alpha=0.25, lw=0.8)
    ax.plot(steps, smooth(values, _window(steps)), color=color, lw=1.8, label=label)


def training_report(source: Any, path: str | os.PathLike | None = None) -> Figure:
    """A 2 x 4 figure over training steps, one plain question per panel (the formulas are in
    ``docs/analysis.md``): the loss; how large per-example gradients are (median and p10-p90 of
    ``||g_i||``, with ``||G||``); how well examples agree with the batch (quantiles of
    ``cos(g_i, G)``); the share pulling against it; the gradient noise scale ``B_simple``; the
    norm, inner-product and orthogonality tests; gradient diversity; SNR. Each series is drawn
    raw (faint) with a moving average over about a twentieth of the run.

    Args:
        source: a CSV path written by ``GradientMonitor(csv_path=...)`` or the monitor itself.
        path: where to write a PNG (``None``: only return the figure).
    """
    h = load_history(source)
    steps = h["step"]
    window = _window(steps)
    fig = new_figure(17, 7.5)
    axes = fig.subplots(2, 4)

    ax = axes[0, 0]
    _series(ax, steps, h["loss"], "C0")
    ax.set(title="Training loss", xlabel="step", ylabel="mean loss of the batch")

    ax = axes[0, 1]
    ax.fill_between(steps, smooth(h["norm_p10"], window), smooth(h["norm_p90"], window),
                    alpha=0.3, color="C1", label="middle 80% of examples")
    _series(ax, steps, h["norm_p50"], "C1", label="median example")
    ax.plot(steps, smooth(h["batch_gradient_norm"], window), "--", color="k",
            label="batch gradient")
    ax.set(title="How large each example's gradient is", xlabel="step",
           ylabel="gradient norm")
    ax.legend(fontsize=8)

    ax = axes[0, 2]
    ax.fill_between(steps, smooth(h["cosine_p10"], window), smooth(h["cosine_p90"], window),
                    alpha=0.3, color="C2", label="middle 80% of examples")
    _series(ax, steps, h["cosine_p50"], "C2", label="median example")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set(title="How much examples agree with the batch", xlabel="step",
           ylabel="cosine(example, batch gradient)", ylim=(-1.05, 1.05))
    ax.legend(fontsize=8)

    ax = axes[0, 3]
    _series(ax, steps, h["fraction_opposed"], "C3")
    ax.set(title="Share pulling against the batch", xlabel="step",
           ylabel="fraction with cosine < 0", ylim=(0, 1))

    ax = axes[1, 0]
    _series(ax, steps, h["noise_scale"], "C4", log=True)
    ax.set(title="Noise scale (useful batch size)", xlabel="step",
           ylabel="examples", yscale="log")

    ax = axes[1, 1]
    for key, color, label in (("norm_test", "C5", "norm test"),
                              ("inner_product_test", "C6", "inner-product test"),
                              ("orthogonality_test", "C7", "orthogonality test")):
        _series(ax, steps, h[key], color, label=label, log=True)
    ax.set(title="Is the batch large enough?", xlabel="step",
           ylabel="test statistic (smaller than theta^2: yes)", yscale="log")
    ax.legend(fontsize=8)

    ax = axes[1, 2]
    _series(ax, steps, h["gradient_diversity"], "C8", log=True)
    ax.set(title="How different the gradients are", xlabel="step",
           ylabel="gradient diversity", yscale="log")

    ax = axes[1, 3]
    _series(ax, steps, h["snr"], "C9", log=True)
    ax.set(title="Batch gradient: signal vs. noise", xlabel="step",
           ylabel="signal-to-noise ratio", yscale="log")

    save(fig, path)
    return fig
