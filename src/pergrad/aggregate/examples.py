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
from typing import Any

from keras import ops

from pergrad.backend.ops import add_n
from pergrad.engine import PerExampleResult


@dataclass(frozen=True)
class Batch:
    """Per-batch facts an aggregator may use besides the gradients.

    Attributes:
        nonzero_weight: ``(B,)`` bool, ``sample_weight != 0`` (all true without weights).
            Order statistics leave out zero-weight rows (e.g. Poisson padding).
        loss_scaled: the gradients come from a loss-scaled backward pass (see module doc).
    """

    nonzero_weight: Any
    loss_scaled: bool = False

    @staticmethod
    def of(result: PerExampleResult, sample_weight=None, loss_scaled: bool = False) -> Batch:
        if sample_weight is None:
            nonzero = ops.ones([result.batch_size], "bool")
        else:
            w = ops.convert_to_tensor(sample_weight)
            w = ops.reshape(w, [ops.shape(w)[0], -1])
            nonzero = ops.any(ops.not_equal(w, ops.zeros([], w.dtype)), axis=1)
        return Batch(nonzero, loss_scaled)


def finite_examples(result: PerExampleResult, squared_norms: list, batch: Batch) -> Any:
    """``(B,)`` bool: the examples that are not dropped (see the module docstring)."""
    finite_loss = ops.isfinite(result.losses)
    if batch.loss_scaled:
        return finite_loss
    finite_grad = ops.isfinite(add_n(squared_norms))
    return ops.logical_and(finite_loss, finite_grad)
