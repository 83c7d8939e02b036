"""Data debugging on your own model and data: train with every example's gradient watched,
rank the training examples most likely mislabeled or harmful, and explain test predictions by
training examples (TracIn). ``pergrad analyze`` is the command-line face of this module."""

from pergrad.analysis.data import Dataset, load_data
from pergrad.analysis.run import Analysis, analyze

__all__ = ["Analysis", "Dataset", "analyze", "load_data"]
