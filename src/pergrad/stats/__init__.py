"""Gradient statistics of a batch: each example's gradient against the batch gradient.

Everything is computed from per-example squared norms, dot products with the mean gradient and
the mean gradient's norm, so no per-example gradient is materialized for layers with a rule.

Data debugging builds on them: :func:`label_error_scores` (loss, margin/AUM, EL2N, GraNd, TracIn
self-influence, forgetting, conflict, and a default ranking) from a ``GradientMonitor``'s table,
and :func:`influence` (TracIn over checkpoints: which training examples helped or hurt a test
prediction).
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
from pergrad.stats.influence import Checkpoint, Influence, influence
from pergrad.stats.label_errors import (
    DEFAULT_SCORE,
    SINGLE_SCORES,
    label_error_scores,
    rank_average,
    ranking,
)
from pergrad.stats.scores import class_scores

__all__ = [
    "BATCH_STATISTICS",
    "CONSENSUS_STATISTICS",
    "DEFAULT_SCORE",
    "PER_EXAMPLE_STATISTICS",
    "SINGLE_SCORES",
    "Checkpoint",
    "Influence",
    "active_examples",
    "batch_statistics",
    "class_scores",
    "consensus_statistics",
    "gradient_statistics",
    "gram",
    "influence",
    "label_error_scores",
    "layer_of",
    "rank_average",
    "ranking",
    "statistics_from_result",
]
