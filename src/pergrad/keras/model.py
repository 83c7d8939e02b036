"""``PerExampleModel``: ``model.fit`` whose update aggregates per-example gradients.

The train step is :func:`pergrad.keras.step.train_step`, written once, with the parts of the
backend (:mod:`~pergrad.backend.tensorflow.trainer`, :mod:`~pergrad.backend.jax.trainer`,
:mod:`~pergrad.backend.torch.trainer`); this module is the Keras model around it: compiling the loss
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
from pergrad.aggregate import noise
from pergrad.backend import ENGINE_SUPPORTED, SUPPORTED, require_supported
from pergrad.backend import name as backend_name
from pergrad.backend import part as backend_part
from pergrad.engine import PerExample
from pergrad.engine.losses import leaf_loss
from pergrad.keras import fit_parts, logical_batches, step
from pergrad.keras.faults import backups_first
from pergrad.keras.step import INDEX_KEY
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


def _backend_step() -> ModuleType:
    """The train step's parts for the Keras backend: its ``pergrad.backend.<name>.trainer``."""
    return backend_part("trainer")


class _Unsupported:
    """The trainer part on a backend pergrad does not run on (``PerExampleModel`` refuses to
    be built there)."""


def _trainer() -> type:
    """The backend's trainer part, a base class of :class:`PerExampleModel` as Keras composes
    ``Model`` from its backend's trainer (``Trainer`` of :mod:`pergrad.backend.tensorflow.trainer`,
    :mod:`~pergrad.backend.jax.trainer` or :mod:`~pergrad.backend.torch.trainer`): the mixing state,
    what ``compile`` resets, ``fit`` and ``train_on_batch``."""
    if backend_name() not in SUPPORTED:
        return _Unsupported
    return _backend_step().Trainer


@keras.saving.register_keras_serializable(package="pergrad")
class PerExampleModel(_trainer(), keras.Model):
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
            noise.require_64_bit_keys()
            fit_parts.require_shared_seed(self.aggregator)
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
        self.mixing_status = None  # JAX, PyTorch: 0 unchecked, 1 checked, 2 refused
        if self.check_example_mixing and self.aggregator.clips:
            self._add_mixing_state()  # the backend trainer's (Trainer)
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
        self._compiled_for_backend(kwargs)  # the backend trainer's (Trainer)

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
        return super().fit(*args, **kwargs)  # the backend trainer's fit, then Keras's

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
        (:mod:`pergrad.backend.torch.trainer`); on JAX Keras's functional ``train_step(state, data)
        -> (logs, state)`` (:mod:`pergrad.backend.jax.trainer`)."""
        return _backend_step().train_step(self, *args)
