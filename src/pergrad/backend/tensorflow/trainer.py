"""``PerExampleModel``'s train step on the TensorFlow backend: the parts of
:func:`pergrad.keras.step.train_step` that are TensorFlow's.

Keras's TensorFlow trainer traces ``train_step(data)`` into a ``tf.function`` (under
``tf.distribute``, once per replica) and the variables change in place:

* the first-batch example-mixing check runs inside a ``tf.cond`` on the model's
  ``example_mixing_checked`` variable (later steps skip its forward passes) and ends in a
  ``tf.debugging.Assert``; every state change of the step waits for it (``after``), so a refused
  first step changes nothing, and ``fit`` turns the assertion into
  :class:`pergrad.MixesExamplesError` (:class:`mixing_errors`);
* variables are read as they are (a replica reads its own copy), not through a state mapping;
* under ``tf.distribute`` the aggregator's local parts are combined across replicas by its
  collectives and the optimizer, which sums replicas' gradients, is given the global update
  divided by the number of replicas;
* a monitor with ``compute_alongside`` (``GradientMonitor``) computes the aggregator's local
  part with its statistics, so the aggregator's sums read the per-example matrices the
  statistics built;
* rows of weight 0 are removed before the compiled metrics (dynamic shapes are allowed).
"""

from __future__ import annotations

import sys
import warnings

import keras
import numpy as np

from pergrad._compat import every_layer_built, symbolic_build
from pergrad.backend.lazy import tensorflow as tf
from pergrad.engine import compute_dtype, mixing_tolerance
from pergrad.keras import fit_parts, step
from pergrad.rules.normalization import MixesExamplesError

RECORD_VALUES = False
monitor = step.call_monitor
_MIXING_MARKER = "pergrad: examples mix"


def train_step(model, data) -> dict:
    """One ``PerExampleModel`` step, variables written in place (see the module doc)."""
    return step.train_step(model, data, on=sys.modules[__name__])


def check_example_mixing(model, engine, x, y, sample_weight) -> list:
    """On the first batch only: assert that no example's loss depends on another example.

    Returns the assertion and the flag's update, to run before any state changes (``[]`` when
    the check is off). The check's forward passes run inside a ``tf.cond``."""
    checked = model.mixing_checked
    if checked is None:
        return []
    tolerance = mixing_tolerance(compute_dtype(model.model))

    def check():
        error = engine.example_mixing(x, y, sample_weight)
        assertion = tf.debugging.Assert(
            error <= tolerance, [_mixing_message(tolerance), error], name="example_mixing")
        with tf.control_dependencies([assertion]):
            return tf.identity(error)

    done = tf.convert_to_tensor(checked)
    error = tf.cond(done, lambda: tf.zeros([], tf.float64), check)
    with tf.control_dependencies([error]):
        mark = checked.assign(True)
    return [error, mark]


def after(checks: list):
    """State changes that wait for ``checks``."""
    return tf.control_dependencies(checks)


def replicas() -> int:
    return tf.distribute.get_strategy().num_replicas_in_sync


def local_and_stats(model, result, batch, indices, sample_weight, extras) -> tuple:
    """The aggregator's local part, with the monitor's statistics where it computes them
    alongside (statistics first: the aggregator's sums read the matrices their norms built)."""
    aggregator = model.aggregator
    if not hasattr(model.monitor, "compute_alongside"):
        return aggregator.local(result, batch), None
    stats, local = model.monitor.compute_alongside(
        result, lambda r: aggregator.local(r, batch), indices=indices,
        sample_weight=sample_weight, **extras)
    return local, stats


def kept_rows(structure, counted):
    """Only the rows where ``counted`` is true (a dynamic number of them)."""
    return tf.nest.map_structure(lambda t: None if t is None else tf.boolean_mask(t, counted),
                                 structure)


def apply(optimizer, grads: list, variables: list, trainable: list) -> None:
    del trainable
    optimizer.apply(grads, variables)


def _mixing_message(tolerance: float) -> str:
    return (f"{_MIXING_MARKER}. On the first batch an example's loss differs (relative "
            f"difference at the end of this message, tolerance {tolerance:.1g}) between being "
            "computed inside the batch and alone: a layer or the loss mixes examples (a mean "
            "over the batch axis, BatchNormalization in training mode, a batch-dependent loss). "
            "Clipping and DP noise would not bound one example's influence. Remove the mixing, "
            "or pass check_example_mixing=False to PerExampleModel if you have accounted for "
            "it.")


class mixing_errors:
    """Turn the first-batch mixing assertion (a TF runtime error) into MixesExamplesError."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, tf.errors.InvalidArgumentError) and _MIXING_MARKER in str(error):
            raise MixesExamplesError(_mixing_detail(str(error))) from None
        return False


def _mixing_detail(text: str) -> str:
    """The assertion's message and the relative difference it printed after it."""
    detail = text[text.index(_MIXING_MARKER):].split("\n")[0]
    return detail.replace("] [", " Relative difference: ").strip(" []")


def _argument(args: tuple, kwargs: dict, position: int, name: str):
    """A call's argument given by position or by name (None if neither)."""
    return args[position] if len(args) > position else kwargs.get(name)


class Trainer:
    """``PerExampleModel``'s TensorFlow trainer part (as Keras composes ``Model`` from its
    backend's trainer): the mixing flag as a variable the first replica owns, the assertion
    turned into :class:`pergrad.MixesExamplesError`, and ``fit`` refused under
    ``MultiWorkerMirroredStrategy`` (Keras's ``fit`` cannot run there)."""

    def _add_mixing_state(self) -> None:
        self.mixing_checked = tf.Variable(
            False, trainable=False, name="example_mixing_checked",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def _compiled_for_backend(self, kwargs: dict) -> None:
        if self.mixing_checked is None:
            return
        self.mixing_checked.assign(False)  # a new loss may mix examples: check it again
        if self.jit_compile:
            # XLA compiles tf.debugging.Assert to nothing, which would skip the check.
            if kwargs.get("jit_compile") is True:
                warnings.warn("PerExampleModel compiles its train step without XLA while "
                              "check_example_mixing=True (an XLA assertion cannot stop a "
                              "step). Check with PerExample.check(x, y) and pass "
                              "check_example_mixing=False to use XLA.", stacklevel=3)
            self.jit_compile = False

    def fit(self, *args, **kwargs):
        if isinstance(self.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy) \
                and self.distribute_strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "Keras's fit does not run under MultiWorkerMirroredStrategy (keras-team/keras "
                "issue 20585). Train with pergrad.keras.fit_distributed(model, x, y, "
                "batch_size=..., epochs=..., checkpoint_dir=...): the same train step, "
                "callbacks and aggregator, under strategy.run.")
        args, kwargs = fit_parts.with_monitor_callback(self, args, kwargs)
        self._build_before_tracing(_argument(args, kwargs, 0, "x"), _argument(args, kwargs, 1, "y"),
                                   kwargs.get("sample_weight"),
                                   _argument(args, kwargs, 2, "batch_size") or 32)
        with mixing_errors():
            return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        self._build_before_tracing(_argument(args, kwargs, 0, "x"), _argument(args, kwargs, 1, "y"),
                                   _argument(args, kwargs, 2, "sample_weight"), None)
        with mixing_errors():
            return super().train_on_batch(*args, **kwargs)

    def _build_before_tracing(self, x, y, sample_weight, batch_size: int | None) -> None:
        """The compiled metrics' and loss's variables and the optimizer's slots, made from the
        first batch of array data (``batch_size`` rows; all with None) before the train step is
        traced. Keras's TensorFlow trainer
        makes them so only under a distribution strategy and otherwise leaves them to the
        first trace, and ``tf.function`` traces a function that creates variables twice: the
        first step of a ``keras.applications`` CNN's DP training took twice as long. Data
        that is not arrays (a dataset, a generator) is left to Keras, and so is a model that
        cannot be built from the batch (its traced step then reports why)."""
        if self._distribute_strategy is not None or not self.model.built:
            return  # Keras builds first under a strategy; an unbuilt model builds in its trace
        data = (x, y, sample_weight)
        leaves = [leaf for leaf in keras.tree.flatten(data) if leaf is not None]
        if not leaves or not all(isinstance(leaf, (np.ndarray, tf.Tensor)) and len(leaf.shape)
                                 for leaf in leaves):
            return
        first = keras.tree.map_structure(lambda a: None if a is None else a[:batch_size], data)
        try:
            symbolic_build(self, first)
        except Exception:  # noqa: BLE001 - the traced step raises it again, in its own words
            return

    def make_train_function(self, force=False):
        """Keras's, with the optimizer's slots made first where the model is built: Keras
        (without a distribution strategy) leaves them to the first trace of the train step,
        and ``tf.function`` traces a function that creates variables twice, which doubled the
        first step's time (the per-example step is a large graph to trace)."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not optimizer.built and every_layer_built(self):
            with self.distribute_strategy.scope():
                optimizer.build(self.trainable_variables)
        return super().make_train_function(force)
