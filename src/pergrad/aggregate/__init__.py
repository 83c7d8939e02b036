"""Composable aggregators of per-example gradients (optax-style named tuples of pure functions).

=====================  ========================================================================
``mean()``             ``(1/B) sum_i g_i``
``sum()``              ``sum_i g_i``
``clip_mean(C)``       ``(1/B) sum_i min(1, C/||g_i||) g_i``  (``per_layer=True``: per variable)
``dp_mean(C, sigma)``  ``(1/D) (sum_i min(1, C/||g_i||) g_i + N(0, (C sigma)^2 I))``
``normalized_mean()``  ``(1/B) sum_i g_i / (||g_i|| + gamma)``
``median()``           coordinate-wise median of the ``g_i``
``trimmed_mean(f)``    coordinate-wise mean without the ``floor(f n)`` smallest and largest
``custom(fn)``         ``fn(per_example_grads, norms[, losses=, predictions=])``
=====================  ========================================================================

Use one inside ``pergrad.keras.PerExampleModel`` or directly: ``grads = agg(result)`` for a
:class:`pergrad.PerExampleResult`. See :mod:`pergrad.aggregate.base` for the protocol and
:mod:`pergrad.aggregate.noise` for why DP noise never repeats.
"""

from pergrad.aggregate.base import (
    Aggregator,
    Partial,
    cross_replica,
    deserialize,
    serialize,
)
from pergrad.aggregate.examples import Batch
from pergrad.aggregate.linear import clip_mean, dp_mean, mean, normalized_mean, sum
from pergrad.aggregate.noise import NoiseStream
from pergrad.aggregate.order import custom, median, trimmed_mean

__all__ = [
    "Aggregator",
    "Batch",
    "NoiseStream",
    "Partial",
    "clip_mean",
    "cross_replica",
    "custom",
    "deserialize",
    "dp_mean",
    "mean",
    "median",
    "normalized_mean",
    "serialize",
    "sum",
    "trimmed_mean",
]
