"""Pieces of ``PerExampleModel.fit`` that the backends' trainers share (:class:`Trainer` of
:mod:`pergrad.backend.tensorflow.trainer`, :mod:`pergrad.backend.jax.trainer` and :mod:`pergrad.backend.torch.trainer`):
the monitor as a callback, a model's values kept through an error, refused steps."""

from __future__ import annotations

import inspect
import math

import keras

from pergrad._compat import held_value
from pergrad.backend import native
from pergrad.keras import step
from pergrad.rules.normalization import MixesExamplesError


def with_monitor_callback(model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fit``'s arguments with ``model.monitor`` added (last) to the callbacks, if it is a
    Keras callback and not there yet."""
    monitor = model.monitor
    if not isinstance(monitor, keras.callbacks.Callback):
        return args, kwargs
    bound = inspect.signature(keras.Model.fit).bind_partial(model, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks") or []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        if not any(c is monitor for c in callbacks.callbacks):
            callbacks.append(monitor)
            monitor.set_model(model)
        return args, kwargs
    callbacks = list(callbacks)
    if not any(c is monitor for c in callbacks):
        callbacks.append(monitor)
    bound.arguments["callbacks"] = callbacks
    return bound.args[1:], bound.kwargs


def with_first_callback(model, callback, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fit``'s arguments with ``callback`` first among the callbacks."""
    bound = inspect.signature(keras.Model.fit).bind_partial(model, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks") or []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks.insert(0, callback)
        callback.set_model(model)
        return args, kwargs
    bound.arguments["callbacks"] = [callback, *callbacks]
    return bound.args[1:], bound.kwargs


def callbacks_of(model, args: tuple, kwargs: dict):
    """The ``callbacks`` argument of a ``fit`` call."""
    return inspect.signature(keras.Model.fit).bind_partial(
        model, *args, **kwargs).arguments.get("callbacks")


class values_restored_on_error:
    """JAX's ``fit`` moves every variable's value into its compiled loop and clears the
    variables until the loop ends. An error raised inside (a refused step, a loss that returns
    a scalar) would leave the model without weights: put the values from before back."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self):
        model = self.model
        self.variables = list(model.variables)
        if getattr(model, "optimizer", None) is not None:
            self.variables += list(model.optimizer.variables)
        self.variables += list(model.metrics_variables)
        self.values = [held_value(v) for v in self.variables]
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None:
            noise_state = getattr(self.model, "noise_state", None)
            for variable, value in zip(self.variables, self.values, strict=True):
                # The noise stream never moves backwards: a key it already gave out would be
                # drawn again. A Keras that did not hand the state back leaves it empty (any
                # later use fails) rather than rewound.
                if variable is noise_state:
                    continue
                if value is not None and held_value(variable) is None:
                    variable.assign(value)
        return False


def require_one_process_for_monitor(monitor) -> None:
    """A monitor keeps its tables in the host memory of one process: on several JAX processes
    each would hold a different part of the batch's statistics."""
    processes = native().process_count()
    if monitor is not None and processes > 1:
        raise ValueError(
            f"A GradientMonitor keeps its per-example tables in one process; this run has "
            f"{processes} JAX processes. Train without a monitor here (several devices in one "
            "process are fine), or monitor a one-process run.")


def require_shared_seed(aggregator) -> None:
    """On several processes every process must start the same noise stream: ``seed=None``
    would draw a different seed in each."""
    processes = native().process_count()
    if aggregator.noise.seed is None and processes > 1:
        raise ValueError(
            f"{aggregator.name}(seed=None) on {processes} JAX processes would draw a "
            "different noise seed in each process. Draw one seed once (e.g. "
            "pergrad.aggregate.noise.fresh_seed() on process 0, sent to the others with your "
            "launcher) and pass it as seed= on every process.")


def raise_if_refused(logs: dict) -> None:
    """Pop the JAX step's mixing status (and the check's measured relative difference and
    tolerance) from ``logs``; raise if the step was refused."""
    status = logs.pop("example_mixing_status", None)
    difference = logs.pop("example_mixing_difference", None)
    tolerance = logs.pop("example_mixing_tolerance", None)
    if status is None or int(status) != 2:
        return
    detail = ""
    if difference is not None and math.isfinite(float(difference)):
        detail = f" Relative difference: {float(difference):.3g} (tolerance {float(tolerance):.1g})."
    raise MixesExamplesError(step.REFUSED_MESSAGE + detail)


class MixingRefusal(keras.callbacks.Callback):
    """Raises :class:`MixesExamplesError` after a refused JAX step (and keeps the status out of
    the progress bar and the history)."""

    def on_train_batch_end(self, batch, logs=None) -> None:
        if logs is not None:
            raise_if_refused(logs)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is not None:
            raise_if_refused(logs)


def add_mixing_status(model) -> None:
    """The JAX and PyTorch example-mixing state: a weight, 0 unchecked, 1 checked, 2 refused."""
    model.mixing_status = model.add_weight(
        shape=(), dtype="int32", trainable=False, name="example_mixing_status",
        initializer="zeros")
