"""``PerExampleModel``'s train step on the JAX backend.

Keras's JAX trainer compiles ``train_step(state, data) -> (logs, state)``, a pure function of the
variables' values. This step maps every variable (the model's, the optimizer's, the metrics') to
its value in ``state`` with one ``keras.StatelessScope``, runs the same stateful steps as on
TensorFlow (engine, aggregator, DP noise from the model's ``noise_state``, regularization,
``optimizer.apply``, metrics) and returns every variable's value at the end as the new state.

The first-batch example-mixing check cannot raise inside a compiled function, so it *gates*
the step: the model's ``example_mixing_status`` weight goes from 0 (unchecked) to 1 (checked,
no mixing) or 2 (refused). A refused step returns the state it was given, except that status: no
weight, optimizer slot, iteration count or noise counter moves, and no noise is drawn into
anything released. After the step the status is read on the host and
:class:`pergrad.MixesExamplesError` is raised (``fit`` through a callback, ``train_on_batch``
directly); every later step with status 2 is refused the same way.

A monitor (``PerExampleModel(monitor=...)``) is called inside the step with the step's
``PerExampleResult``, like on TensorFlow; its scalars join the logs. ``GradientMonitor`` keeps
its counters and tables on the host (ordered ``io_callback``s, see
:mod:`pergrad.keras.monitor`); on a refused step it is not run at all.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import keras
from keras import ops

from pergrad import aggregate
from pergrad._compat import compiled_loss, loss_tracker
from pergrad.aggregate import noise
from pergrad.backend.ops import zero_rows
from pergrad.engine import compute_dtype, mixing_tolerance

UNCHECKED, CHECKED, REFUSED = 0, 1, 2


def _state_variables(model) -> list[list]:
    return [list(model.trainable_variables), list(model.non_trainable_variables),
            list(model.optimizer.variables), list(model.metrics_variables)]


def train_step(model, state, data) -> tuple[dict, tuple]:
    """One ``PerExampleModel`` step as a pure function of ``state`` (see the module doc)."""
    groups = _state_variables(model)
    mapping = [(v, value) for variables, values in zip(groups, state, strict=True)
               for v, value in zip(variables, values, strict=True)]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        logs = _stateful_step(model, data)
        new_state = tuple([_current(scope, v) for v in variables] for variables in groups)
    status = model.mixing_status
    if status is None:
        return logs, new_state
    refused = _current(scope, status) == REFUSED
    gated = []
    for variables, old, new in zip(groups, state, new_state, strict=True):
        gated.append([n if v is status else jnp.where(refused, o, n)
                      for v, o, n in zip(variables, old, new, strict=True)])
    logs = {**logs, "example_mixing_status": _current(scope, status)}
    return logs, tuple(gated)


def _current(scope, variable) -> Any:
    value = scope.get_current_value(variable)
    return variable.value if value is None else value


def _stateful_step(model, data) -> dict:
    from pergrad.keras.model import _RecordingScope, _scaled_weights, _split_indices

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, indices = _split_indices(x)
    if isinstance(sample_weight, (dict, list, tuple)):
        raise ValueError("PerExampleModel supports one sample weight per example, shape "
                         "(batch,); got a structure of sample weights.")
    engine = model.per_example()
    if model._target_order is not None and isinstance(y, dict):
        y = [y[name] for name in model._target_order]
    _check_example_mixing(model, engine, x, y, sample_weight)
    # JAX's fit keeps variable values only in the state: the recording scope reads them from it.
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
    key = noise.next_key(model.noise_state) if model.aggregator.noisy else None
    grads = model.aggregator.finalize(local, key)
    model._check_shapes(grads, variables)
    regularization = _regularization_gradients(variables)
    if regularization is not None:
        grads = [g + ops.cast(r, g.dtype) for g, r in zip(grads, regularization, strict=True)]
    logs = _report(model, x, y, result, sample_weight, local.dropped)
    if model.monitor is not None:
        # This step's learning rate (for TracIn), read before the update moves a schedule on.
        logs = {**logs, **_monitor(model, result, indices, sample_weight, y,
                                   ops.convert_to_tensor(model.optimizer.learning_rate))}
    if scale is not None:  # the optimizer divides by the loss scale
        grads = [g * ops.cast(scale, g.dtype) for g in grads]
    _apply(model.optimizer, grads, variables, list(model.trainable_variables))
    if model.aggregator.noisy and isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        # As on TensorFlow: DP steps are never skipped, so the scale would only grow, on a
        # schedule, until every example overflows: hold it at its initial value.
        model.optimizer.step_counter.assign(0)
    return logs


def _apply(optimizer, grads: list, variables: list, trainable: list) -> None:
    """``optimizer.apply(grads, variables)`` inside the step's stateless scope. A
    ``LossScaleOptimizer`` assigns variables inside its ``cond`` (skip or apply), which under
    ``jax.jit`` would leak tracers out of the branch: it goes through its public
    ``stateless_apply`` (the route Keras's own JAX trainer takes), over every trainable
    variable in the order the optimizer was built with, and the new values are written after."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer.apply(grads, variables)
        return
    by_variable = {id(v): g for v, g in zip(variables, grads, strict=True)}
    full = [by_variable.get(id(v), jnp.zeros(v.shape, v.dtype)) for v in trainable]
    new_trainable, new_optimizer = optimizer.stateless_apply(
        [v.value for v in optimizer.variables], full, [v.value for v in trainable])
    for variable, value in zip(trainable, new_trainable, strict=True):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_optimizer, strict=True):
        variable.assign(value)


def _monitor(model, result, indices, sample_weight, y, learning_rate) -> dict:
    """The monitor's statistics of this step, computed from the raw per-example gradients (it
    draws no noise key and writes no state). On a step the mixing check refuses, the monitor
    is not run at all (its host-side counters and tables do not see the step): its outputs are
    NaN there."""
    from pergrad.keras.model import _accepted

    monitor = model.monitor
    extras = {"labels": y, "learning_rate": learning_rate, "from_logits": model._from_logits}
    extras = _accepted(monitor.compute, extras)

    def run():
        stats = monitor.compute(result, indices=indices, sample_weight=sample_weight, **extras)
        return {k: ops.convert_to_tensor(v) for k, v in dict(stats).items()}

    status = model.mixing_status
    if status is None:
        return run()
    shapes = jax.eval_shape(run)

    def refused():
        return {k: jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.inexact) else 0,
                            s.dtype) for k, s in shapes.items()}

    return jax.lax.cond(ops.convert_to_tensor(status.value) == REFUSED, refused, run)


def _check_example_mixing(model, engine, x, y, sample_weight) -> None:
    """On the first batch (status 0), set the status to 1 or, if an example's loss depends on
    another example, to 2. One ``lax.cond``: later steps skip the check's forward passes."""
    status = model.mixing_status
    if status is None:
        return
    tolerance = mixing_tolerance(compute_dtype(model.model))

    def check():
        # The check's own forward passes write nothing: their writes stay in this scope.
        mapping = [(v, v.value) for v in model.variables]
        with keras.StatelessScope(state_mapping=mapping):
            error = engine.example_mixing(x, y, sample_weight)
        return jnp.where(error <= tolerance, CHECKED, REFUSED).astype(status.dtype)

    current = ops.convert_to_tensor(status.value)
    status.assign(jax.lax.cond(current == UNCHECKED, check, lambda: current))


def _regularization_gradients(variables: list) -> list | None:
    regularized = [k for k, v in enumerate(variables)
                   if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return None
    values = [v.value for v in variables]

    def total(chosen):
        return sum(ops.cast(variables[k].regularizer(value), "float32")
                   for k, value in zip(regularized, chosen, strict=True))

    grads = jax.grad(total)([values[k] for k in regularized])
    out = [jnp.zeros(v.shape, v.dtype) for v in variables]
    for k, g in zip(regularized, grads, strict=True):
        out[k] = g
    return out


def _report(model, x, y, result, sample_weight, dropped) -> dict:
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
    loss = compiled_loss(model, x, y, y_pred, weight)
    loss_tracker(model).update_state(loss, sample_weight=batch)
    model.dropped_examples.update_state(dropped)
    return model.compute_metrics(x, y, y_pred, sample_weight=weight)


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
