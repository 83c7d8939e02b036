"""A matplotlib Figure on the Agg canvas: no pyplot, no display, no global state."""

from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def new_figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save(figure: Figure, path: str | os.PathLike | None, dpi: int = 100) -> None:
    if path is not None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        figure.savefig(path, dpi=dpi, format="png")
