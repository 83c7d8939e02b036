"""Data debugging on your own model and data: train with every example's gradient watched,
rank the training examples most likely mislabeled or harmful, and explain test predictions by
training examples (TracIn). ``pergrad analyze`` is the command-line face of this module."""

from pergrad.analysis.data import DataError, Dataset, load_data
from pergrad.analysis.out_of_sample import (
    LabelIssues,
    add_out_of_sample,
    class_probabilities,
    confidence_scores,
    confident_learning,
    cross_fitted_probabilities,
)
from pergrad.analysis.run import Analysis, analyze

__all__ = ["Analysis", "DataError", "Dataset", "LabelIssues", "add_out_of_sample", "analyze",
           "class_probabilities",
           "confidence_scores", "confident_learning", "cross_fitted_probabilities", "load_data"]
