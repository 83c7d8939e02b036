"""Figures of gradient statistics recorded by ``pergrad.keras.GradientMonitor`` (matplotlib, Agg)."""

from pergrad.plot.examples import conflicting_examples, flagged_examples, influential_examples
from pergrad.plot.report import load_history, training_report

__all__ = ["conflicting_examples", "flagged_examples", "influential_examples", "load_history",
           "training_report"]
