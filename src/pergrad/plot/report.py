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


def _positive(ax, steps, values, **kwargs) -> None:
    keep = np.isfinite(values) & (values > 0)
    ax.plot(steps[keep], values[keep], **kwargs)


def training_report(source: Any, path: str | os.PathLike | None = None) -> Figure:
    """A 2 x 4 figure over training steps: loss; per-example gradient norm quantiles (p10-p90
    band, median) with the batch gradient norm; cosine-to-batch quantiles; the fraction of
    opposed examples; the gradient noise scale ``B_simple``; the norm, inner-product and
    orthogonality tests; gradient diversity; SNR.

    Args:
        source: a CSV path written by ``GradientMonitor(csv_path=...)`` or the monitor itself.
        path: where to write a PNG (``None``: only return the figure).
    """
    h = load_history(source)
    steps = h["step"]
    fig = new_figure(16, 7)
    axes = fig.subplots(2, 4)

    ax = axes[0, 0]
    ax.plot(steps, h["loss"], color="C0")
    ax.set(title="Loss (batch mean)", xlabel="step")

    ax = axes[0, 1]
    ax.fill_between(steps, h["norm_p10"], h["norm_p90"], alpha=0.3, color="C1", label="p10-p90")
    ax.plot(steps, h["norm_p50"], color="C1", label="median ||g_i||")
    ax.plot(steps, h["batch_gradient_norm"], "--", color="k", label="||G||")
    ax.set(title="Per-example gradient norms", xlabel="step")
    ax.legend(fontsize=8)

    ax = axes[0, 2]
    ax.fill_between(steps, h["cosine_p10"], h["cosine_p90"], alpha=0.3, color="C2",
                    label="p10-p90")
    ax.plot(steps, h["cosine_p50"], color="C2", label="median")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set(title="Cosine to the batch gradient, cos(g_i, G)", xlabel="step", ylim=(-1.05, 1.05))
    ax.legend(fontsize=8)

    ax = axes[0, 3]
    ax.plot(steps, h["fraction_opposed"], color="C3")
    ax.set(title="Fraction of examples opposed (cos < 0)", xlabel="step", ylim=(0, 1))

    ax = axes[1, 0]
    _positive(ax, steps, h["noise_scale"], color="C4")
    ax.set(title="Noise scale B_simple = tr(Sigma)/||G||^2", xlabel="step", yscale="log")

    ax = axes[1, 1]
    for key, color in (("norm_test", "C5"), ("inner_product_test", "C6"),
                       ("orthogonality_test", "C7")):
        _positive(ax, steps, h[key], color=color, label=key)
    ax.set(title="Sample-size tests (compare with theta^2)", xlabel="step", yscale="log")
    ax.legend(fontsize=8)

    ax = axes[1, 2]
    _positive(ax, steps, h["gradient_diversity"], color="C8")
    ax.set(title="Gradient diversity", xlabel="step", yscale="log")

    ax = axes[1, 3]
    _positive(ax, steps, h["snr"], color="C9")
    ax.set(title="SNR ||G||^2 / (tr(Sigma)/B)", xlabel="step", yscale="log")

    save(fig, path)
    return fig
