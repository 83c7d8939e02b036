"""``PerExampleModel``'s train step on the JAX backend.

Keras's JAX trainer compiles ``train_step(state, data) -> (logs, state)``, a pure function of the
variables' values. This step maps every variable (the model's, the optimizer's, the metrics') to
its value in ``state`` with one ``keras.StatelessScope``, runs the one train step
(:func:`pergrad.keras.step.train_step`: engine, aggregator, DP noise from the model's
``noise_state``, regularization, metrics, ``optimizer.apply``) with this module's JAX parts,
and returns every variable's value at the end as the new state. Rows of weight 0 stay in the
batch (static shapes): the unweighted ``metrics=`` get the kept rows as their weight, so they
count in no metric (:func:`pergrad.keras.step.report`).

The first-batch example-mixing check cannot raise inside a compiled function, so it *gates*
the step: the model's ``example_mixing_status`` weight goes from 0 (unchecked) to 1 (checked,
no mixing) or 2 (refused). A refused step returns the state it was given, except that status: no
weight, optimizer slot, iteration count or noise counter moves, and no noise is drawn into
anything released. After the step the status (and the measured relative difference, with its
tolerance, in the logs) is read on the host and :class:`pergrad.MixesExamplesError` is raised
(``fit`` through a callback, ``train_on_batch`` directly); every later step with status 2 is
refused the same way.

A monitor (``PerExampleModel(monitor=...)``) is called inside the step with the step's
``PerExampleResult``, like on TensorFlow; its scalars join the logs. ``GradientMonitor`` keeps
its counters and tables on the host (ordered ``io_callback``s, see
:mod:`pergrad.keras.monitor`); on a refused step it is not run at all.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import keras
from keras import ops

from pergrad.engine import compute_dtype, mixing_tolerance
from pergrad.keras import fit_parts, step
from pergrad.keras.faults import lost_process_errors

UNCHECKED, CHECKED, REFUSED = step.UNCHECKED, step.CHECKED, step.REFUSED
RECORD_VALUES = True  # every variable read through the scope: the values of the step's state
after = step.after  # the gate applies to the whole new state at the end
local_and_stats = step.local_only
kept_rows = None


def replicas() -> int:
    return 1  # keras.distribution shards one global batch: the gradients are already global


def _state_variables(model) -> list[list]:
    return [list(model.trainable_variables), list(model.non_trainable_variables),
            list(model.optimizer.variables), list(model.metrics_variables)]


def train_step(model, state, data) -> tuple[dict, tuple]:
    """One ``PerExampleModel`` step as a pure function of ``state`` (see the module doc)."""
    groups = _state_variables(model)
    mapping = [(v, value) for variables, values in zip(groups, state, strict=True)
               for v, value in zip(variables, values, strict=True)]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        logs = step.train_step(model, data, on=sys.modules[__name__])
        new_state = tuple([_current(scope, v) for v in variables] for variables in groups)
    status = model.mixing_status
    if status is None:
        return logs, new_state
    refused = _current(scope, status) == REFUSED
    gated = []
    for variables, old, new in zip(groups, state, new_state, strict=True):
        gated.append([n if v is status else jnp.where(refused, o, n)
                      for v, o, n in zip(variables, old, new, strict=True)])
    difference, tolerance = getattr(_MEASURED, "value", (jnp.nan, jnp.nan))
    _MEASURED.value = (jnp.nan, jnp.nan)
    logs = {**logs, "example_mixing_status": _current(scope, status),
            "example_mixing_difference": difference, "example_mixing_tolerance": tolerance}
    return logs, tuple(gated)


def _current(scope, variable) -> Any:
    value = scope.get_current_value(variable)
    return variable.value if value is None else value


def apply(optimizer, grads: list, variables: list, trainable: list) -> None:
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


def monitor(model, result, indices, sample_weight, extras: dict) -> dict:
    """The monitor's statistics of this step, computed from the raw per-example gradients (it
    draws no noise key and writes no state). On a step the mixing check refuses, the monitor
    is not run at all (its host-side counters and tables do not see the step): its outputs are
    NaN there."""
    def run():
        stats = step.call_monitor(model, result, indices, sample_weight, extras)
        return {k: ops.convert_to_tensor(v) for k, v in stats.items()}

    status = model.mixing_status
    if status is None:
        return run()
    shapes = jax.eval_shape(run)

    def refused():
        return {k: jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.inexact) else 0,
                            s.dtype) for k, s in shapes.items()}

    return jax.lax.cond(ops.convert_to_tensor(status.value) == REFUSED, refused, run)


#: The step being traced: the mixing check's measured relative difference and its tolerance
#: (:func:`check_example_mixing` sets it, :func:`train_step` puts it in the logs).
_MEASURED = threading.local()


def check_example_mixing(model, engine, x, y, sample_weight) -> list:
    """On the first batch (status 0), set the status to 1 or, if an example's loss depends on
    another example, to 2. One ``lax.cond``: later steps skip the check's forward passes.
    Nothing to wait for (``[]``): the gate applies to the step's whole new state."""
    status = model.mixing_status
    if status is None:
        return []
    tolerance = mixing_tolerance(compute_dtype(model.model))

    def check():
        # The check's own forward passes write nothing: their writes stay in this scope.
        mapping = [(v, v.value) for v in model.variables]
        with keras.StatelessScope(state_mapping=mapping):
            error = engine.example_mixing(x, y, sample_weight)
        return (jnp.where(error <= tolerance, CHECKED, REFUSED).astype(status.dtype),
                error.astype(jnp.float32))

    current = ops.convert_to_tensor(status.value)
    new_status, difference = jax.lax.cond(
        current == UNCHECKED, check, lambda: (current, jnp.full((), jnp.nan, jnp.float32)))
    status.assign(new_status)
    _MEASURED.value = (difference, jnp.float32(tolerance))
    return []


class Trainer:
    """``PerExampleModel``'s JAX trainer part: a refused step is reported by a callback
    (``fit``) or from the logs (``train_on_batch``), the model's values are put back if the
    compiled loop raises, a lost process is reported, and a monitor needs one process."""

    def _add_mixing_state(self) -> None:
        fit_parts.add_mixing_status(self)

    def _compiled_for_backend(self, kwargs: dict) -> None:
        if self.mixing_status is not None:
            self.mixing_status.assign(0)  # a new loss may mix examples: check it again

    def fit(self, *args, **kwargs):
        fit_parts.require_one_process_for_monitor(self.monitor)
        args, kwargs = fit_parts.with_monitor_callback(self, args, kwargs)
        if self.mixing_status is not None:
            args, kwargs = fit_parts.with_first_callback(self, fit_parts.MixingRefusal(), args,
                                                         kwargs)
        callbacks = fit_parts.callbacks_of(self, args, kwargs)
        with lost_process_errors(callbacks), fit_parts.values_restored_on_error(self):
            return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        return_dict = kwargs.pop("return_dict", False)
        fit_parts.require_one_process_for_monitor(self.monitor)
        with lost_process_errors(), fit_parts.values_restored_on_error(self):
            logs = dict(super().train_on_batch(*args, return_dict=True, **kwargs))
        fit_parts.raise_if_refused(logs)
        return logs if return_dict else self._flatten_metrics_in_order(logs)
