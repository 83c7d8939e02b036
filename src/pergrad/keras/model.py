"""``PerExampleModel``: ``model.fit`` whose update aggregates per-example gradients.

The train step, for a batch ``(x_i, y_i, w_i)`` of ``B`` rows:

1. one forward and one backward pass of ``S * sum_i w_i l_i`` through the engine
   (``l_i`` the compiled loss of example ``i``, ``S`` the optimizer's loss scale, 1 without);
2. the aggregator's ``local`` on the unscaled per-example gradients, ``cross_replica`` under
   ``tf.distribute``, ``finalize`` (DP noise is drawn here, once per global step, with the next
   key of the model's own noise stream, the weight ``noise_state``);
3. plus the gradient of the weight-regularization losses (they belong to no example);
4. ``optimizer.apply``; loss and compiled metrics are updated as Keras does.

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
from typing import Any

import keras
from keras import ops

from pergrad import aggregate
from pergrad._compat import compiled_loss, held_value, loss_tracker
from pergrad.aggregate import noise
from pergrad.backend import ENGINE_SUPPORTED, is_jax, is_tensorflow, is_torch, require_supported
from pergrad.backend.lazy import tensorflow as tf
from pergrad.engine import PerExample, compute_dtype, mixing_tolerance
from pergrad.engine.losses import leaf_loss
from pergrad.keras import logical_batches, step
from pergrad.keras.faults import backups_first, lost_process_errors
from pergrad.rules.normalization import MixesExamplesError
from pergrad.stats.scores import loss_from_logits

INDEX_KEY = "example_index"
"""Key of an ``x`` dict entry holding each example's dataset index (int, ``(B,)``).

It is removed from ``x`` before the model is called and handed to the monitor as ``indices``.
"""

def _weighted_leaf(loss, weight):
    leaf = None if loss is None else leaf_loss(loss, like_compile=True)
    if leaf is None:  # no loss for this output
        return lambda y_true, y_pred: ops.zeros([ops.shape(y_pred)[0]], keras.config.floatx())
    if weight is None or float(weight) == 1.0:
        return leaf
    return lambda y_true, y_pred: leaf(y_true, y_pred) * float(weight)


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


def _split_indices(x):
    if isinstance(x, dict) and INDEX_KEY in x:
        x = dict(x)
        indices = x.pop(INDEX_KEY)
        if len(x) == 1:
            (x,) = x.values()
        return x, indices
    return x, None


def _rows_finite(structure, batch) -> tf.Tensor:
    keep = tf.ones([batch], tf.bool)
    for t in tf.nest.flatten(structure):
        if t is None or not t.dtype.is_floating:
            continue
        flat = tf.reshape(t, [batch, -1])
        keep = tf.logical_and(keep, tf.reduce_all(tf.math.is_finite(flat), axis=1))
    return keep


def _keep_rows(structure, keep):
    """Only the rows where ``keep`` is true (a dynamic number of them)."""
    return tf.nest.map_structure(lambda t: None if t is None else tf.boolean_mask(t, keep),
                                 structure)


def _is_seed_state(variable) -> bool:
    """A ``keras.random.SeedGenerator``'s state (dropout's): it advances every training call,
    independently of the data, and is not a statistic of the batch."""
    return variable.name == "seed_generator_state"


class _RecordingScope(keras.StatelessScope):
    """A ``keras.StatelessScope`` that also remembers *which* variables were written, so that
    every write (the model's, a custom loss's, Keras's global seed generator's) is applied or
    refused after the forward pass, never silently dropped."""

    def __init__(self, state_mapping=None) -> None:
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.written: dict[int, Any] = {}

    def add_update(self, update) -> None:
        super().add_update(update)
        self.written[id(update[0])] = update[0]


_MIXING_MARKER = "pergrad: examples mix"


def _mixing_message(tolerance: float) -> str:
    return (f"{_MIXING_MARKER}. On the first batch an example's loss differs (relative "
            f"difference at the end of this message, tolerance {tolerance:.1g}) between being "
            "computed inside the batch and alone: a layer or the loss mixes examples (a mean over the batch axis, "
            "BatchNormalization in training mode, a batch-dependent loss). Clipping and DP "
            "noise would not bound one example's influence. Remove the mixing, or pass "
            "check_example_mixing=False to PerExampleModel if you have accounted for it.")


def _zero_rows(structure, keep):
    def zero(t):
        if t is None or not t.dtype.is_floating:
            return t
        mask = tf.reshape(keep, [-1] + [1] * (t.shape.rank - 1))
        return tf.where(mask, t, tf.zeros_like(t))
    return tf.nest.map_structure(zero, structure)


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
        self._from_logits: bool | None = None
        self.check_example_mixing = bool(check_example_mixing)
        self.allow_state_updates = bool(allow_state_updates)
        self.dropped_examples = keras.metrics.Sum(name="dropped_examples")
        self._per_example: PerExample | None = None
        self._per_example_loss = None
        self._target_order = None
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
        self._mixing_checked = None
        self.mixing_status = None  # JAX: 0 unchecked, 1 checked, 2 refused (see jax_step)
        if self.check_example_mixing and self.aggregator.clips:
            if is_tensorflow():
                self._mixing_checked = tf.Variable(
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
    def call(self, inputs, training=None):
        inputs, _ = _split_indices(inputs)
        return self.model(inputs, training=training)

    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, **kwargs) -> None:
        """As ``keras.Model.compile``; the loss is used per example."""
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, **kwargs)
        output_names = getattr(self.model, "output_names", None)
        try:
            dict_outputs = isinstance(self.model.output, dict)
        except (AttributeError, ValueError):  # subclassed or not yet called
            dict_outputs = False
        self._per_example_loss, self._target_order = compiled_per_example_loss(
            loss, loss_weights, output_names, dict_outputs)
        self._from_logits = loss_from_logits(loss)
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
        if self._mixing_checked is not None:
            self._mixing_checked.assign(False)  # a new loss may mix examples: check it again
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
        with _mixing_errors():
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
        with _mixing_errors():
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

    def _current_loss_scale(self):
        """``S`` such that ``optimizer.apply`` divides gradients by ``S`` (or ``None``)."""
        optimizer = self.optimizer
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) \
            or getattr(optimizer, "loss_scale_factor", None) is not None
        if not scaled:
            return None
        return ops.cast(optimizer.scale_loss(ops.convert_to_tensor(1.0, "float32")), "float32")

    @staticmethod
    def _check_no_call_losses(scope) -> None:
        """Refuse losses added during the forward pass (collected by the stateless scope)."""
        if scope.losses:
            raise ValueError(
                "The model adds losses in call() (add_loss or an activity_regularizer). They are "
                "computed from the whole batch, so PerExampleModel cannot split them into "
                "per-example gradients; remove them or fold them into the per-example loss.")

    def train_step(self, *args):
        """One step: ``train_step(data) -> logs`` on TensorFlow and PyTorch
        (:mod:`pergrad.keras.torch_step`); on JAX Keras's functional ``train_step(state, data)
        -> (logs, state)`` (:mod:`pergrad.keras.jax_step`)."""
        if is_torch():
            from pergrad.keras import torch_step
            return torch_step.train_step(self, *args)
        if not is_tensorflow():
            from pergrad.keras import jax_step
            return jax_step.train_step(self, *args)
        return self._tensorflow_train_step(*args)

    def _tensorflow_train_step(self, data):
        x, y, sample_weight, indices = step.unpack(self, data)
        engine = self.per_example()
        checks = self._check_example_mixing(engine, x, y, sample_weight)
        scale = self._current_loss_scale()
        with tf.control_dependencies(checks), _RecordingScope() as scope:
            # A loss scaled by S is the loss with every example's weight multiplied by S.
            result = engine.compute(x, y, _scaled_weights(sample_weight, scale, x))
        with tf.control_dependencies(checks):  # a refused first step changes no state at all
            self._apply_state_updates(scope)
        variables = result.variables
        self._check_no_call_losses(scope)
        if scale is not None:
            result = result.scaled(1.0 / scale)  # unscaled gradients, float32 norms

        # Under a DP aggregator an overflowing example is dropped like a NaN one (no skipped
        # step that one example could decide); otherwise it reaches the loss-scale optimizer,
        # which skips the step and lowers the scale, as in Keras.
        loss_scaled = scale is not None and not self.aggregator.noisy
        batch = aggregate.Batch.of(result, sample_weight, loss_scaled=loss_scaled)
        stats = None
        if hasattr(self.monitor, "compute_alongside"):
            # Statistics first, then the aggregator on the same per-example data: on a monitored
            # step its sums read the matrices the statistics' norms built (one weight pass less).
            extras = {"labels": y, "learning_rate": tf.identity(self.optimizer.learning_rate),
                      "from_logits": self._from_logits}
            stats, local = self.monitor.compute_alongside(
                result, lambda r: self.aggregator.local(r, batch), indices=indices,
                sample_weight=sample_weight, **extras)
        else:
            local = self.aggregator.local(result, batch)
        total = aggregate.cross_replica(local, self.aggregator.gathers)
        if self.logical_sums is not None:  # noise once per logical batch
            with tf.control_dependencies(checks):
                grads = logical_batches.release_update(self, total, self.accumulation_steps)
        else:
            with tf.control_dependencies(checks):
                key = noise.next_key(self.noise_state) if self.aggregator.noisy else None
            grads = self.aggregator.finalize(total, key)
        self._check_shapes(grads, variables)
        regularization = step.regularization_gradients(variables)
        if regularization is not None:
            grads = [g + tf.cast(r, g.dtype) for g, r in zip(grads, regularization, strict=True)]
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:  # the optimizer sums over replicas what is already global
            grads = [g / tf.cast(replicas, g.dtype) for g in grads]
        if scale is not None:  # the optimizer divides by the loss scale
            grads = [g * tf.cast(scale, g.dtype) for g in grads]
        # Report before the update: Keras's loss includes the regularization of the old weights.
        logs = self._report(x, y, result, sample_weight, local.dropped, replicas)
        learning_rate = tf.identity(self.optimizer.learning_rate)  # this step's, for TracIn
        with tf.control_dependencies(checks):
            self.optimizer.apply(grads, variables)
        if self.aggregator.noisy and replicas == 1 \
                and isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            # DP steps are never skipped, so the scale would only grow, on a schedule, until every
            # example overflows: hold it at its initial value (data-independent).
            self.optimizer.step_counter.assign(0)
        if self.monitor is not None and stats is None:  # a monitor with compute() only
            extras = {"labels": y, "learning_rate": learning_rate,
                      "from_logits": self._from_logits}
            stats = self.monitor.compute(result, indices=indices, sample_weight=sample_weight,
                                         **_accepted(self.monitor.compute, extras))
        if stats is not None:
            logs = {**logs, **dict(stats)}
        return logs

    def _check_example_mixing(self, engine: PerExample, x, y, sample_weight) -> list:
        """On the first batch only: assert that no example's loss depends on another example.

        Returns the assertion to run before the step (``[]`` when the check is off or not needed).
        The check itself (:meth:`PerExample.example_mixing`) runs inside a ``tf.cond``, so later
        steps cost nothing.
        """
        if self._mixing_checked is None:
            return []
        tolerance = mixing_tolerance(compute_dtype(self.model))

        def check():
            error = engine.example_mixing(x, y, sample_weight)
            assertion = tf.debugging.Assert(
                error <= tolerance, [_mixing_message(tolerance), error], name="example_mixing")
            with tf.control_dependencies([assertion]):
                return tf.identity(error)

        done = tf.convert_to_tensor(self._mixing_checked)
        error = tf.cond(done, lambda: tf.zeros([], tf.float64), check)
        with tf.control_dependencies([error]):
            mark = self._mixing_checked.assign(True)
        return [error, mark]

    def _apply_state_updates(self, scope) -> None:
        """Apply the variable writes recorded during the forward pass, or refuse them.

        Seed-generator states (dropout) advance as usual. Any other non-trainable variable
        written from the batch is, under a noisy aggregator, released without noise: refused
        unless ``allow_state_updates``.
        """
        written = list(scope.written.values())
        leaking = [v for v in written if not _is_seed_state(v)]
        if leaking and self.aggregator.noisy and not self.allow_state_updates:
            names = ", ".join(getattr(v, "path", v.name) for v in leaking)
            raise ValueError(
                f"The model writes the non-trainable variable(s) {names} from the batch during "
                f"training. Under the DP aggregator {self.aggregator.name!r} they would be "
                "released without noise, breaking the privacy guarantee. Freeze them (e.g. "
                "call the layer with training=False, or make the statistic trainable=False and "
                "fixed), or pass allow_state_updates=True to PerExampleModel if you account for "
                "their release yourself.")
        for v in written:
            v.assign(scope.get_current_value(v))

    def _check_shapes(self, grads: list, variables: list) -> None:
        if len(grads) != len(variables):
            raise ValueError(f"The aggregator {self.aggregator.name!r} returned {len(grads)} "
                             f"gradients for {len(variables)} trainable variables.")
        for g, v in zip(grads, variables, strict=True):
            if tuple(g.shape) != tuple(v.shape):
                raise ValueError(f"The aggregator {self.aggregator.name!r} returned shape "
                                 f"{tuple(g.shape)} for variable {v.path!r} of shape "
                                 f"{tuple(v.shape)}.")

    def _report(self, x, y, result, sample_weight, dropped, replicas) -> dict:
        """Keras's loss and metrics, on predictions whose non-finite rows are zeroed and
        weighted 0 (so a dropped example does not turn the reported loss into NaN).

        Rows of weight 0 (Poisson padding, dropped examples) are left out of every compiled
        metric, the unweighted ``metrics=`` included (Keras would count them there)."""
        batch = result.batch_size
        keep = tf.logical_and(tf.math.is_finite(result.losses),
                              _rows_finite(result.predictions, batch))
        keep = tf.logical_and(keep, _rows_finite(y, batch))
        y_pred = _zero_rows(result.predictions, keep)
        y = _zero_rows(y, keep)
        weight = tf.cast(keep, tf.float32)
        if sample_weight is not None:
            sw = tf.convert_to_tensor(sample_weight)
            weight = tf.reshape(tf.cast(weight, sw.dtype), [-1] + [1] * (sw.shape.rank - 1))
            weight = _zero_rows(sw, keep) * weight
        counted = tf.reduce_any(tf.reshape(tf.not_equal(weight, 0), [batch, -1]), axis=1)
        weight = step.loss_weights(weight, y_pred)
        loss = compiled_loss(self, x, y, y_pred, weight)
        # Keras scales the per-replica loss by 1 / replicas; its tracker undoes that.
        loss_tracker(self).update_state(loss * tf.cast(replicas, loss.dtype),
                                        sample_weight=batch)
        self.dropped_examples.update_state(dropped)
        return self.compute_metrics(x, _keep_rows(y, counted), _keep_rows(y_pred, counted),
                                    sample_weight=_keep_rows(weight, counted))


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


def _scaled_weights(sample_weight, scale, x):
    """``S w_i`` (``S`` for every example without weights): the weights under which the
    engine's per-example losses are the loss-scaled ones, ``S w_i l_i``."""
    if scale is None:
        return sample_weight
    if sample_weight is None:
        return ops.full([ops.shape(keras.tree.flatten(x)[0])[0]], scale, dtype="float32")
    return ops.cast(sample_weight, "float32") * ops.cast(scale, "float32")


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


class _mixing_errors:
    """Turn the first-batch mixing assertion (a TF runtime error) into MixesExamplesError."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, tf.errors.InvalidArgumentError) and _MIXING_MARKER in str(error):
            raise MixesExamplesError(_mixing_detail(str(error))) from None
        return False


def _accepted(function, keywords: dict) -> dict:
    """The entries of ``keywords`` that ``function`` accepts (all with ``**kwargs``), so a custom
    monitor with the documented ``compute(result, indices=, sample_weight=)`` keeps working."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return keywords
    return {k: v for k, v in keywords.items() if k in parameters}


def _mixing_detail(text: str) -> str:
    """The assertion's message and the relative difference it printed after it."""
    detail = text[text.index(_MIXING_MARKER):].split("\n")[0]
    return detail.replace("] [", " Relative difference: ").strip(" []")
