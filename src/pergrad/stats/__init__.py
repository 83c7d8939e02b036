"""Gradient statistics of a batch: each example's gradient against the batch gradient.

Everything is computed from per-example squared norms, dot products with the mean gradient and
the mean gradient's norm, so no per-example gradient is materialized for layers with a rule.
"""

from pergrad.stats.compute import (
    active_examples,
    gradient_statistics,
    gram,
    layer_of,
    statistics_from_result,
)
from pergrad.stats.formulas import (
    BATCH_STATISTICS,
    CONSENSUS_STATISTICS,
    PER_EXAMPLE_STATISTICS,
    batch_statistics,
    consensus_statistics,
)

__all__ = [
    "BATCH_STATISTICS",
    "CONSENSUS_STATISTICS",
    "PER_EXAMPLE_STATISTICS",
    "active_examples",
    "batch_statistics",
    "consensus_statistics",
    "gradient_statistics",
    "gram",
    "layer_of",
    "statistics_from_result",
]
