"""Logical batches for DP-SGD: the clipped sums of ``k`` micro-batches, noise once per logical
step, with Keras's own ``gradient_accumulation_steps=k`` optimizer argument.

Keras's optimizer with ``gradient_accumulation_steps=k`` averages the updates of ``k``
consecutive train steps and moves the weights on every ``k``-th (when its count of ``apply``
calls plus one is a multiple of ``k``). Averaging ``k`` DP updates would add ``k`` noise draws: ``sqrt(k)`` times the
noise a logical batch needs, and ``k`` releases to account for. Under a noisy aggregator
``PerExampleModel`` therefore keeps the aggregator's local part itself, in two saved weights: the
running sum ``S = sum_j S_j`` of the micro-batches' clipped per-example gradients and their row
count ``R``. On the ``k``-th micro-step it finalizes the total once,

    U = (S + N(0, C^2 sigma^2 I)) / D,     D = R (or expected_batch_size under Poisson sampling),

and hands the optimizer ``k U``; on the other micro-steps it hands it zeros. Keras's average of
the ``k`` updates is then exactly ``U``, the DP-SGD update of the logical batch, and the noise
counter (so ``PrivacyCallback`` and a resumed model) advances once per logical step. The noise of
the release to come is also drawn, and discarded, on the micro-steps before it (its key is read,
not advanced): nothing noisy is ever released twice, at the cost of drawing it ``k`` times.

A logical batch never spans two epochs: ``fit`` on arrays refuses a micro-batch count per epoch
that ``k`` does not divide (an example at the end of one epoch and the start of the next could
otherwise be in one logical batch twice).
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from pergrad._compat import micro_steps
from pergrad.aggregate import noise

SUMS = "logical_batch_sums"
ROWS = "logical_batch_rows"


def accumulation_steps(optimizer: Any) -> int:
    """``k``, the optimizer's ``gradient_accumulation_steps`` (1 when it has none)."""
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    if not steps and inner is not None:
        steps = getattr(inner, "gradient_accumulation_steps", None)
    return int(steps or 1)


def add_accumulators(model) -> None:
    """The weights ``S`` (one per trainable variable) and ``R`` of a ``PerExampleModel`` whose
    noisy aggregator accumulates logical batches, made once (saved with the model)."""
    if getattr(model, "logical_sums", None) is not None:
        return
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError("Logical batches (gradient_accumulation_steps) under a DP aggregator "
                         "do not combine with a LossScaleOptimizer; train in float32.")
    if model.aggregator.gathers:
        raise ValueError(f"The aggregator {model.aggregator.name!r} keeps every example; "
                         "logical batches accumulate sums (dp_mean).")
    sums = []
    for k, variable in enumerate(model.model.trainable_variables):
        sums.append(model.add_weight(shape=tuple(variable.shape), dtype=variable.dtype,
                                     trainable=False, initializer="zeros",
                                     name=f"{SUMS}_{k}", aggregation="only_first_replica"))
    model.logical_sums = sums
    model.logical_rows = model.add_weight(shape=(), dtype="float32", trainable=False,
                                          initializer="zeros", name=ROWS,
                                          aggregation="only_first_replica")


def release_update(model, partial, steps: int) -> list:
    """The gradients to hand ``optimizer.apply`` on this micro-step (module docstring): ``k U``
    on the logical batch's last micro-step, zeros before it; ``S`` and ``R`` are updated and
    the noise counter advanced at the release only."""
    iterations = ops.cast(ops.convert_to_tensor(micro_steps(model.optimizer)), "int64")
    release = ops.equal(ops.mod(iterations + 1, steps), 0)
    values = [ops.cast(s, v.dtype) + v for s, v in zip(model.logical_sums, partial.values,
                                                      strict=True)]
    rows = model.logical_rows + ops.cast(partial.rows, "float32")
    total = partial._replace(values=values, rows=rows)
    key = noise.next_key(model.noise_state, advance=release)
    update = model.aggregator.finalize(total, key)
    for s, v in zip(model.logical_sums, values, strict=True):
        s.assign(ops.where(release, ops.zeros_like(v), v))
    model.logical_rows.assign(ops.where(release, ops.zeros_like(rows), rows))
    return [ops.where(release, g * ops.cast(steps, g.dtype), ops.zeros_like(g)) for g in update]


def check_whole_logical_batches(num_examples: int | None, batch_size: int | None,
                                steps_per_epoch: int | None, steps: int) -> None:
    """Refuse an epoch of micro-batches that ``steps`` does not divide (module docstring)."""
    if steps_per_epoch is None and (num_examples is None or batch_size is None):
        return
    micro = steps_per_epoch or math.ceil(num_examples / batch_size)
    if micro % steps:
        raise ValueError(
            f"An epoch has {micro} micro-batches, which gradient_accumulation_steps={steps} does "
            "not divide: a logical batch would span two epochs and could hold an example twice. "
            f"Choose batch_size (or steps_per_epoch) so that the micro-batches per epoch are a "
            f"multiple of {steps}.")
