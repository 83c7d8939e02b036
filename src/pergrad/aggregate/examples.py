"""Which examples of a batch count, and views of a :class:`PerExampleResult` that mask or scale.

**Non-finite examples.** An example whose loss is NaN/inf, or whose gradient norm is, is
*dropped*: it gets coefficient 0 and its rows are zeroed before any sum, so one bad example
cannot poison the update (``0 * NaN`` is NaN, so a zero coefficient alone would not do). The
number dropped is reported (``PerExampleModel`` logs it as ``dropped_examples``).

Under dynamic loss scaling (``Batch.loss_scaled``) an infinite gradient with a finite loss is
the overflow signal the loss-scale optimizer needs to skip the step and lower the scale, so
such examples are *kept* (the update becomes non-finite and the optimizer skips it, as in plain
Keras); only examples with a non-finite loss are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from pergrad.engine import PerExampleResult


@dataclass(frozen=True)
class Batch:
    """Per-batch facts an aggregator may use besides the gradients.

    Attributes:
        nonzero_weight: ``(B,)`` bool, ``sample_weight != 0`` (all true without weights).
            Order statistics leave out zero-weight rows (e.g. Poisson padding).
        loss_scaled: the gradients come from a loss-scaled backward pass (see module doc).
    """

    nonzero_weight: tf.Tensor
    loss_scaled: bool = False

    @staticmethod
    def of(result: PerExampleResult, sample_weight=None, loss_scaled: bool = False) -> Batch:
        if sample_weight is None:
            nonzero = tf.ones([result.batch_size], tf.bool)
        else:
            w = tf.convert_to_tensor(sample_weight)
            w = tf.reshape(w, [tf.shape(w)[0], -1])
            nonzero = tf.reduce_any(tf.not_equal(w, tf.zeros([], w.dtype)), axis=1)
        return Batch(nonzero, loss_scaled)


def finite_examples(result: PerExampleResult, squared_norms: list, batch: Batch) -> tf.Tensor:
    """``(B,)`` bool: the examples that are not dropped (see the module docstring)."""
    finite_loss = tf.math.is_finite(result.losses)
    if batch.loss_scaled:
        return finite_loss
    finite_grad = tf.math.is_finite(tf.add_n(squared_norms))
    return tf.logical_and(finite_loss, finite_grad)
