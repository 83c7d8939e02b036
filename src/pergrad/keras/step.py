"""The body of ``PerExampleModel``'s train step where it is one stateful function of
``keras.ops``: on JAX (inside the stateless scope of :mod:`pergrad.keras.jax_step`) and on
PyTorch (eager, :mod:`pergrad.keras.torch_step`). TensorFlow's step (``tf.distribute``
replicas, control dependencies) is ``PerExampleModel._tensorflow_train_step``.

One step is: split the example indices off ``x``; the first-batch example-mixing check; one
forward and one backward pass of the engine, with the loss scale folded into the sample
weights; the forward pass's variable writes applied or refused; the aggregator's local part
and ``finalize`` with the next key of the model's noise stream; regularization gradients; the
loss and metrics (rows of non-finite loss or predictions weighted out); the monitor; and
``optimizer.apply``. What differs per backend comes from ``on``, a module with
``check_example_mixing(model, engine, x, y, sample_weight)``, ``monitor(model, result,
indices, sample_weight, y, learning_rate)`` and ``apply(optimizer, grads, variables,
trainable)``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import keras
from keras import ops

from pergrad import aggregate
from pergrad._compat import compiled_loss, loss_tracker
from pergrad.aggregate import noise
from pergrad.backend.ops import vjp, zero_rows
from pergrad.keras import logical_batches

#: ``PerExampleModel.mixing_status`` on JAX and PyTorch: the first-batch example-mixing check
#: has not run, passed, or refused the step.
UNCHECKED, CHECKED, REFUSED = 0, 1, 2

REFUSED_MESSAGE = (
    "The first training batch failed the example-mixing check: an example's loss differs "
    "between being computed inside the batch and alone, so a layer or the loss mixes examples "
    "(a mean over the batch axis, BatchNormalization in training mode, a batch-dependent loss). "
    "Clipping and DP noise would not bound one example's influence, and no step was applied. "
    "Remove the mixing, or pass check_example_mixing=False to PerExampleModel if you have "
    "accounted for it.")


def unpack(model, data) -> tuple:
    """``(x, y, sample_weight, indices)`` of one training batch, every backend: the example
    indices split off ``x``, dict targets in the compiled loss's order, one sample weight per
    example or a ``ValueError``."""
    from pergrad.keras.model import _split_indices

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, indices = _split_indices(x)
    if isinstance(sample_weight, (dict, list, tuple)):
        raise ValueError("PerExampleModel supports one sample weight per example, shape "
                         "(batch,); got a structure of sample weights.")
    if model._target_order is not None and isinstance(y, dict):
        y = [y[name] for name in model._target_order]
    return x, y, sample_weight, indices


def regularization_gradients(variables: list) -> list | None:
    """``d/dw sum_k penalty_k(w_k)`` for every variable (zeros where there is no penalty), or
    ``None`` when no variable has a regularizer; one VJP of the summed penalties."""
    regularized = [k for k, v in enumerate(variables)
                   if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return None

    def total(chosen):
        return sum(ops.cast(variables[k].regularizer(value), "float32")
                   for k, value in zip(regularized, chosen, strict=True))

    values = tuple(ops.stop_gradient(ops.convert_to_tensor(variables[k].value))
                   for k in regularized)
    grads = vjp(total, values, ops.ones((), "float32"))
    out = [ops.zeros(v.shape, v.dtype) for v in variables]
    for k, g in zip(regularized, grads, strict=True):
        out[k] = g
    return out


def stateful_step(model, data, on: ModuleType) -> dict:
    """One step on ``data``, changing the variables in place; returns the logs."""
    from pergrad.keras.model import _RecordingScope, _scaled_weights

    x, y, sample_weight, indices = unpack(model, data)
    engine = model.per_example()
    on.check_example_mixing(model, engine, x, y, sample_weight)
    # Every variable read through the scope: on JAX the values of the step's state.
    everything = list(model.variables)
    scale = model._current_loss_scale()
    with _RecordingScope([(v, v.value) for v in everything]) as recording:
        # A loss scaled by S is the loss with every example's weight multiplied by S.
        result = engine.compute(x, y, _scaled_weights(sample_weight, scale, x))
    model._apply_state_updates(recording)
    model._check_no_call_losses(recording)
    variables = result.variables
    if scale is not None:
        result = result.scaled(1.0 / scale)  # unscaled gradients, float32 norms
    # As on TensorFlow: under a DP aggregator an overflowing example is dropped like a NaN one;
    # otherwise the overflow reaches the LossScaleOptimizer, which skips the step.
    loss_scaled = scale is not None and not model.aggregator.noisy
    batch = aggregate.Batch.of(result, sample_weight, loss_scaled=loss_scaled)
    local = model.aggregator.local(result, batch)
    if model.logical_sums is not None:  # noise once per logical batch
        grads = logical_batches.release_update(model, local, model.accumulation_steps)
    else:
        key = noise.next_key(model.noise_state) if model.aggregator.noisy else None
        grads = model.aggregator.finalize(local, key)
    model._check_shapes(grads, variables)
    regularization = regularization_gradients(variables)
    if regularization is not None:
        grads = [g + ops.cast(r, g.dtype) for g, r in zip(grads, regularization, strict=True)]
    logs = report(model, x, y, result, sample_weight, local.dropped)
    if model.monitor is not None:
        # This step's learning rate (for TracIn), read before the update moves a schedule on.
        logs = {**logs, **on.monitor(model, result, indices, sample_weight, y,
                                   ops.convert_to_tensor(model.optimizer.learning_rate))}
    if scale is not None:  # the optimizer divides by the loss scale
        grads = [g * ops.cast(scale, g.dtype) for g in grads]
    on.apply(model.optimizer, grads, variables, list(model.trainable_variables))
    if model.aggregator.noisy and isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        # As on TensorFlow: DP steps are never skipped, so the scale would only grow, on a
        # schedule, until every example overflows: hold it at its initial value.
        model.optimizer.step_counter.assign(0)
    return logs


def report(model, x, y, result, sample_weight, dropped) -> dict:
    """Keras's loss and metrics, with rows of non-finite loss or predictions (dropped examples)
    and rows of weight 0 (Poisson padding) given weight 0 and zeroed, so they count in no
    metric (JAX needs static shapes, so rows are weighted out rather than removed)."""
    batch = result.batch_size
    keep = ops.logical_and(ops.isfinite(result.losses),
                           _rows_finite(result.predictions, batch))
    keep = ops.logical_and(keep, _rows_finite(y, batch))
    y_pred = _zero_rows(result.predictions, keep)
    y = _zero_rows(y, keep)
    weight = ops.cast(keep, "float32")
    if sample_weight is not None:
        sw = ops.convert_to_tensor(sample_weight)
        weight = ops.reshape(ops.cast(weight, sw.dtype), [-1] + [1] * (len(sw.shape) - 1))
        weight = _zero_rows(sw, keep) * weight
    weight = loss_weights(weight, y_pred)
    loss = compiled_loss(model, x, y, y_pred, weight)
    loss_tracker(model).update_state(loss, sample_weight=batch)
    model.dropped_examples.update_state(dropped)
    return model.compute_metrics(x, y, y_pred, sample_weight=weight)


def loss_weights(weight: Any, predictions: Any) -> Any:
    """One weight per example, ``(B,)``, shaped for Keras's compiled loss and metrics: for an
    output of rank above 2 (a sequence ``(B, T, F)``) broadcast over the axes of its unreduced
    loss (the output's shape less its last axis, ``(B, T)``), which Keras cannot weight by a
    ``(B,)`` vector; unchanged where every output has rank 1 or 2."""
    leaves = [p for p in keras.tree.flatten(predictions) if p is not None]
    if all(len(p.shape) <= 2 for p in leaves):
        return weight

    def expand(p):
        if p is None or len(p.shape) <= 2:
            return weight
        column = ops.reshape(weight, [-1] + [1] * (len(p.shape) - 2))
        return column * ops.ones_like(p[..., 0], dtype=weight.dtype)

    return keras.tree.map_structure(expand, predictions)


def _rows_finite(structure, batch) -> Any:
    """``(B,)``: the rows whose every floating entry is finite."""
    keep = ops.ones([batch], "bool")
    for t in keras.tree.flatten(structure):
        if t is None or not keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype)):
            continue
        flat = ops.reshape(t, [batch, -1])
        keep = ops.logical_and(keep, ops.all(ops.isfinite(flat), axis=1))
    return keep


def _zero_rows(structure, keep) -> Any:
    def zero(t):
        if t is None or not keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype)):
            return t
        return zero_rows(t, keep)
    return keras.tree.map_structure(zero, structure)
