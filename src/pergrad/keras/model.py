"""``PerExampleModel``: ``model.fit`` whose update aggregates per-example gradients.

The train step is :func:`pergrad.keras.step.train_step`, written once, with the parts of the
backend (:mod:`~pergrad.keras.tf_step`, :mod:`~pergrad.keras.jax_step`,
:mod:`~pergrad.keras.torch_step`); this module is the Keras model around it: compiling the loss
per example, the noise stream and guards' state, and ``fit``/``train_on_batch`` per backend.

Guards for aggregators that bound each example's influence (clipping, DP): on the first batch
the model checks that no example's loss depends on another example (:class:`MixesExamplesError`
otherwise); under a noisy (DP) aggregator a non-trainable variable written during the step from
the batch (a running statistic) is refused, and an example whose loss-scaled gradient overflows
is dropped like a NaN example, so no single example decides whether a DP step happens.
"""

from __future__ import annotations

import inspect
import math
import warnings
from types import ModuleType
from typing import Any

import keras
from keras import ops

from pergrad import aggregate
from pergrad._compat import held_value
from pergrad.aggregate import noise
from pergrad.backend import ENGINE_SUPPORTED, is_jax, is_tensorflow, is_torch, require_supported
from pergrad.backend.lazy import tensorflow as tf
from pergrad.engine import PerExample
from pergrad.engine.losses import leaf_loss
from pergrad.keras import logical_batches, step, tf_step
from pergrad.keras.faults import backups_first, lost_process_errors
from pergrad.keras.step import INDEX_KEY
from pergrad.rules.normalization import MixesExamplesError
from pergrad.stats.scores import loss_from_logits

__all__ = ["INDEX_KEY", "PerExampleModel", "compiled_per_example_loss"]


def _weighted_leaf(loss, weight):
    """One output's per-example loss times its ``loss_weights`` entry; ``leaf`` is the
    :func:`leaf_loss` inside (``None`` for an output without a loss), whose ``masked`` the
    train step reads."""
    leaf = None if loss is None else leaf_loss(loss, like_compile=True)
    if leaf is None:  # no loss for this output
        def weighted(y_true, y_pred):
            return ops.zeros([ops.shape(y_pred)[0]], keras.config.floatx())
    elif weight is None or float(weight) == 1.0:
        return leaf
    else:
        def weighted(y_true, y_pred):
            return leaf(y_true, y_pred) * float(weight)
    weighted.leaf = leaf
    return weighted


def compiled_per_example_loss(loss, loss_weights, output_names, dict_outputs: bool):
    """The compiled ``loss``/``loss_weights`` per example, in the form the engine takes.

    Returns ``(engine_loss, target_order)``: ``engine_loss`` is one callable, or a list/dict of
    callables per model output, each ``(y_true, y_pred) -> (B,)`` with the batch mean of
    ``l_i`` equal to Keras's compiled loss; ``target_order`` is ``None``, or the output names in
    which a dict of targets must be passed as a list (a dict ``loss`` for a model whose outputs
    are a list).
    """
    if loss is None:
        raise ValueError("PerExampleModel needs a loss: pass `loss=` to compile().")
    if isinstance(loss, dict):
        weights = loss_weights or {}
        if not isinstance(weights, dict):
            raise ValueError("With a dict of losses pass loss_weights as a dict too.")
        unknown = set(loss) - set(output_names or loss)
        if unknown:
            raise ValueError(f"Loss dict keys {sorted(unknown)} are not model outputs; outputs "
                             f"are {list(output_names)}.")
        if dict_outputs or not output_names:
            return {k: _weighted_leaf(v, weights.get(k)) for k, v in loss.items()}, None
        names = list(output_names)
        return [_weighted_leaf(loss.get(n), weights.get(n)) for n in names], names
    if isinstance(loss, (list, tuple)):
        weights = loss_weights or [None] * len(loss)
        return [_weighted_leaf(lo, w) for lo, w in zip(loss, weights, strict=True)], None
    weight = loss_weights
    if isinstance(weight, (list, tuple, dict)):
        weight = keras.tree.flatten(weight)[0]
    return _weighted_leaf(loss, weight), None


@keras.saving.register_keras_serializable(package="pergrad")
class PerExampleModel(keras.Model):
    """A Keras model whose ``fit`` aggregates per-example gradients with ``aggregator``.

    ``compile``, ``fit``, ``evaluate``, ``predict``, ``summary``, ``save`` behave as in Keras.
    The update is ``aggregator(g_1, ..., g_B) + grad(regularization)``, where ``g_i`` is the
    gradient of example ``i``'s (sample-weighted) compiled loss. With ``aggregate.mean()`` that is
    exactly Keras's own gradient. The loss and metrics reported are Keras's; the number of
    examples dropped for a non-finite loss or gradient is logged as ``dropped_examples``.

    Args:
        model: the inner Keras model (``.model``); it must not mix examples
            (no BatchNormalization in training mode).
        aggregator: a :mod:`pergrad.aggregate` aggregator (or its ``serialize`` dict).
        monitor: optional object with ``compute(result, indices=, sample_weight=) -> dict`` of
            scalar tensors merged into the logs (``pergrad.keras.GradientMonitor``), also given
            ``labels=``, ``learning_rate=`` (this step's) and ``from_logits=`` (read from the
            compiled loss, ``None`` if unknown) when it accepts them; if it is a
            Keras callback, ``fit`` adds it to the callbacks. A monitor that also has
            ``compute_alongside(result, alongside, ...) -> (dict, value)`` (``GradientMonitor``)
            computes the aggregator's part of the step with it, on TensorFlow inside its
            monitored branch, so the aggregator's sums read the per-example matrices the
            statistics built. Not saved with the model. Its
            statistics come from raw, unclipped gradients: under a DP aggregator they are not
            private, and a warning says so.
        check_example_mixing: with an aggregator that bounds each example's influence (clipping,
            DP), check on the first training batch that each example's loss depends on that
            example alone (:meth:`pergrad.PerExample.example_mixing`) and refuse with
            :class:`pergrad.MixesExamplesError` before any update otherwise.
        allow_state_updates: under a noisy (DP) aggregator, non-trainable variables written from
            the batch during the training step (running statistics of a custom layer) are
            released without noise, so they are refused with an error naming them. Pass
            ``True`` only if you account for that release yourself.

    Weight regularizers are added once to the aggregated gradient (they belong to no example).
    Losses added in ``call`` (``add_loss``, activity regularizers) are refused: they would be
    neither per example nor differentiated.

    The DP noise key comes from the weight ``noise_state`` (``[seed, counter]``, advanced by every
    step), which is saved with the model: recompiling continues the stream, and a model loaded
    from a ``.keras`` file resumes it. See :mod:`pergrad.aggregate.noise`.
    """

    def __init__(self, model: keras.Model, aggregator: aggregate.Aggregator | dict | None = None,
                 monitor: Any = None, check_example_mixing: bool = True,
                 allow_state_updates: bool = False, **kwargs) -> None:
        require_supported("pergrad.keras.PerExampleModel", ENGINE_SUPPORTED)
        super().__init__(**kwargs)
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"model must be a Keras model, got {type(model).__name__}.")
        self.model = model
        self.aggregator = aggregate.mean() if aggregator is None \
            else aggregate.deserialize(aggregator)
        self.monitor = monitor
        self.from_logits: bool | None = None
        self.check_example_mixing = bool(check_example_mixing)
        self.allow_state_updates = bool(allow_state_updates)
        self.dropped_examples = keras.metrics.Sum(name="dropped_examples")
        self._per_example: PerExample | None = None
        self._per_example_loss = None
        self.target_order = None
        self.noise_state = None
        self.dp_config = None  # set by pergrad.keras.make_private
        # Logical batches (gradient_accumulation_steps) under a noisy aggregator: set by compile.
        self.accumulation_steps = 1
        self.logical_sums = None
        self.logical_rows = None
        if self.aggregator.noisy:
            if is_jax():
                noise.require_64_bit_keys()
                _require_shared_seed(self.aggregator)
            seed = self.aggregator.noise.claim(self, self.aggregator.name)
            self.noise_state = self.add_weight(
                shape=noise.KEY_SHAPE, dtype="int64", trainable=False, name="noise_state",
                initializer=keras.initializers.Constant(noise.initial_state(seed)),
                aggregation="only_first_replica")
            if monitor is not None:
                warnings.warn(
                    "A monitor on a DP model (aggregator "
                    f"{self.aggregator.name!r}) computes its statistics from raw, unclipped, "
                    "noise-free per-example gradients: they are not differentially private. Use "
                    "them for debugging only; do not release them.", stacklevel=2)
        self.mixing_checked = None
        self.mixing_status = None  # JAX: 0 unchecked, 1 checked, 2 refused (see jax_step)
        if self.check_example_mixing and self.aggregator.clips:
            if is_tensorflow():
                self.mixing_checked = tf.Variable(
                    False, trainable=False, name="example_mixing_checked",
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            else:
                self.mixing_status = self.add_weight(
                    shape=(), dtype="int32", trainable=False, name="example_mixing_status",
                    initializer="zeros")
        if model.built:
            self.built = True

    def build(self, input_shape=None) -> None:
        if not self.model.built and input_shape is not None:
            self.model.build(input_shape)
        self.built = True
        if self.accumulation_steps > 1 and self.aggregator.noisy and self.model.built:
            logical_batches.add_accumulators(self)

    # -- Keras plumbing -----------------------------------------------------------------------------
    @property
    def output_names(self) -> list | None:
        """The inner model's output names (``None`` for a subclassed one): ``compile`` names each
        output's logged loss and metrics by them, as for the inner model itself."""
        return getattr(self.model, "output_names", None)

    def call(self, inputs, training=None):
        inputs, _ = step.split_indices(inputs)
        return self.model(inputs, training=training)

    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, **kwargs) -> None:
        """As ``keras.Model.compile``; the loss is used per example."""
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, **kwargs)
        output_names = getattr(self.model, "output_names", None)
        try:
            dict_outputs = isinstance(self.model.output, dict)
        except (AttributeError, ValueError):  # subclassed or not yet called
            dict_outputs = False
        self._per_example_loss, self.target_order = compiled_per_example_loss(
            loss, loss_weights, output_names, dict_outputs)
        self.from_logits = loss_from_logits(loss)
        self._per_example = None
        self.accumulation_steps = logical_batches.accumulation_steps(self.optimizer)
        if self.accumulation_steps > 1 and self.aggregator.noisy and self.model.built:
            logical_batches.add_accumulators(self)
        if is_torch() and self.jit_compile:
            # The step reads values on the host (the mixing check, noise keys, the monitor's
            # tables), which torch.compile would split into many graphs.
            warnings.warn("PerExampleModel runs its train step eagerly on PyTorch; "
                          "jit_compile=True (torch.compile) is ignored.", stacklevel=2)
            self.jit_compile = False
        if self.mixing_status is not None:
            self.mixing_status.assign(0)  # a new loss may mix examples: check it again
        if self.mixing_checked is not None:
            self.mixing_checked.assign(False)  # a new loss may mix examples: check it again
            if self.jit_compile:
                # XLA compiles tf.debugging.Assert to nothing, which would skip the check.
                if kwargs.get("jit_compile") is True:
                    warnings.warn("PerExampleModel compiles its train step without XLA while "
                                  "check_example_mixing=True (an XLA assertion cannot stop a "
                                  "step). Check with PerExample.check(x, y) and pass "
                                  "check_example_mixing=False to use XLA.", stacklevel=2)
                self.jit_compile = False

    def compile_from_config(self, config) -> None:
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, *args, **kwargs):
        args, kwargs = self._with_dp_config(args, kwargs)
        if self.logical_sums is not None:
            self._check_whole_logical_batches(args, kwargs)
        args, kwargs = backups_first(self, args, kwargs)
        if is_torch():  # eager: a refused first step raises MixesExamplesError itself
            args, kwargs = self._with_monitor_callback(args, kwargs)
            return super().fit(*args, **kwargs)
        if not is_tensorflow():
            return self._fit_jax(*args, **kwargs)
        if isinstance(self.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy) \
                and self.distribute_strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "Keras's fit does not run under MultiWorkerMirroredStrategy (keras-team/keras "
                "issue 20585). Train with pergrad.keras.fit_distributed(model, x, y, "
                "batch_size=..., epochs=..., checkpoint_dir=...): the same train step, callbacks "
                "and aggregator, under strategy.run.")
        args, kwargs = self._with_monitor_callback(args, kwargs)
        with tf_step.mixing_errors():
            return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        if is_torch():
            return super().train_on_batch(*args, **kwargs)
        if not is_tensorflow():
            return_dict = kwargs.pop("return_dict", False)
            _require_one_process_for_monitor(self.monitor)
            with lost_process_errors(), _values_restored_on_error(self):
                logs = dict(super().train_on_batch(*args, return_dict=True, **kwargs))
            _raise_if_refused(logs)
            return logs if return_dict else self._flatten_metrics_in_order(logs)
        with tf_step.mixing_errors():
            return super().train_on_batch(*args, **kwargs)

    def _check_whole_logical_batches(self, args: tuple, kwargs: dict) -> None:
        """Refuse ``fit`` on arrays whose epoch of micro-batches would end inside a logical
        batch (:mod:`pergrad.keras.logical_batches`)."""
        bound = inspect.signature(keras.Model.fit).bind_partial(self, *args, **kwargs)
        arguments = bound.arguments
        x = arguments.get("x")
        leaves = keras.tree.flatten(x) if x is not None else []
        arrays = bool(leaves) and all(hasattr(leaf, "shape") for leaf in leaves)
        count = int(leaves[0].shape[0]) if arrays else None
        split = arguments.get("validation_split") or 0.0
        if count is not None and split:
            count = int(math.ceil(count * (1.0 - split)))
        batch_size = (arguments.get("batch_size") or 32) if arrays else None
        logical_batches.check_whole_logical_batches(count, batch_size,
                                                    arguments.get("steps_per_epoch"),
                                                    self.accumulation_steps)

    def _with_dp_config(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``fit``'s arguments completed by the :class:`~pergrad.keras.DPConfig` of
        :func:`~pergrad.keras.make_private` (batch size, epochs, privacy callback), if any."""
        config = getattr(self, "dp_config", None)
        if config is None:
            return args, kwargs
        bound = inspect.signature(keras.Model.fit).bind_partial(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        x = arguments.get("x")
        arrays = x is not None and all(hasattr(leaf, "shape") for leaf in keras.tree.flatten(x))
        return (), config.fit_arguments(arguments, given_batches=not arrays,
                                        accumulation_steps=self.accumulation_steps)

    def _with_monitor_callback(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``fit``'s arguments with the monitor added (last) to the callbacks, if it is a
        Keras callback and not there yet."""
        if not isinstance(self.monitor, keras.callbacks.Callback):
            return args, kwargs
        bound = inspect.signature(keras.Model.fit).bind_partial(self, *args, **kwargs)
        callbacks = bound.arguments.get("callbacks") or []
        if isinstance(callbacks, keras.callbacks.CallbackList):
            if not any(c is self.monitor for c in callbacks.callbacks):
                callbacks.append(self.monitor)
                self.monitor.set_model(self)
            return args, kwargs
        callbacks = list(callbacks)
        if not any(c is self.monitor for c in callbacks):
            callbacks.append(self.monitor)
        bound.arguments["callbacks"] = callbacks
        return bound.args[1:], bound.kwargs

    def _fit_jax(self, *args, **kwargs):
        """``fit`` on JAX, with the callback that turns a refused first step into
        :class:`MixesExamplesError` (see :mod:`pergrad.keras.jax_step`) and the monitor's."""
        _require_one_process_for_monitor(self.monitor)
        args, kwargs = self._with_monitor_callback(args, kwargs)
        if self.mixing_status is not None:
            bound = inspect.signature(keras.Model.fit).bind_partial(self, *args, **kwargs)
            callbacks = bound.arguments.get("callbacks") or []
            if isinstance(callbacks, keras.callbacks.CallbackList):
                callbacks.callbacks.insert(0, _MixingRefusal())
                callbacks.callbacks[0].set_model(self)
            else:
                bound.arguments["callbacks"] = [_MixingRefusal(), *callbacks]
            args, kwargs = bound.args[1:], bound.kwargs
        callbacks = inspect.signature(keras.Model.fit).bind_partial(
            self, *args, **kwargs).arguments.get("callbacks")
        with lost_process_errors(callbacks), _values_restored_on_error(self):
            return super().fit(*args, **kwargs)

    def get_config(self) -> dict:
        return {
            "name": self.name,
            "trainable": self.trainable,
            "model": keras.saving.serialize_keras_object(self.model),
            "aggregator": aggregate.serialize(self.aggregator),
            "check_example_mixing": self.check_example_mixing,
            "allow_state_updates": self.allow_state_updates,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        return cls(model, **config)

    # -- training -----------------------------------------------------------------------------------
    def per_example(self) -> PerExample:
        """The engine used by ``train_step`` (built on first use from the compiled loss)."""
        if self._per_example is None:
            if self._per_example_loss is None:
                raise ValueError("Call compile(loss=...) before training a PerExampleModel.")

            self._per_example = PerExample(self.model, self._per_example_loss, training=True)
        return self._per_example

    def train_step(self, *args):
        """One step: ``train_step(data) -> logs`` on TensorFlow and PyTorch
        (:mod:`pergrad.keras.torch_step`); on JAX Keras's functional ``train_step(state, data)
        -> (logs, state)`` (:mod:`pergrad.keras.jax_step`)."""
        return _backend_step().train_step(self, *args)


def _backend_step() -> ModuleType:
    """The train step's parts for the Keras backend (JAX's and PyTorch's import their framework,
    so they are imported on first use)."""
    if is_torch():
        from pergrad.keras import torch_step
        return torch_step
    if is_jax():
        from pergrad.keras import jax_step
        return jax_step
    return tf_step


class _values_restored_on_error:
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


def _require_one_process_for_monitor(monitor) -> None:
    """A monitor keeps its tables in the host memory of one process: on several JAX processes
    each would hold a different part of the batch's statistics."""
    if monitor is None:
        return
    import jax
    if jax.process_count() > 1:
        raise ValueError(
            f"A GradientMonitor keeps its per-example tables in one process; this run has "
            f"{jax.process_count()} JAX processes. Train without a monitor here (several "
            "devices in one process are fine), or monitor a one-process run.")


def _require_shared_seed(aggregator) -> None:
    """On several JAX processes every process must start the same stream: ``seed=None`` would
    draw a different seed in each."""
    import jax
    if aggregator.noise.seed is None and jax.process_count() > 1:
        raise ValueError(
            f"{aggregator.name}(seed=None) on {jax.process_count()} JAX processes would draw a "
            "different noise seed in each process. Draw one seed once (e.g. "
            "pergrad.aggregate.noise.fresh_seed() on process 0, sent to the others with your "
            "launcher) and pass it as seed= on every process.")


def _raise_if_refused(logs: dict) -> None:
    """Pop the JAX step's mixing status from ``logs``; raise if the step was refused."""
    status = logs.pop("example_mixing_status", None)
    if status is not None and int(status) == 2:
        raise MixesExamplesError(step.REFUSED_MESSAGE)


class _MixingRefusal(keras.callbacks.Callback):
    """Raises :class:`MixesExamplesError` after a refused JAX step (and keeps the status out of
    the progress bar and the history)."""

    def on_train_batch_end(self, batch, logs=None) -> None:
        if logs is not None:
            _raise_if_refused(logs)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is not None:
            _raise_if_refused(logs)
