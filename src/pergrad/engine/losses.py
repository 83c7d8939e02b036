"""Turn whatever the user passes as ``loss`` into a per-example loss ``(y_true, y_pred) -> (B,)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

PerExampleLoss = Callable[[Any, Any], tf.Tensor]

_SCALAR_LOSS_HELP = (
    "The loss returned a scalar, but pergrad needs one loss per example, shape (batch,). Pass a "
    "Keras loss object or name (pergrad turns its reduction off), or write the function without "
    "the final reduction, e.g. `lambda y, p: keras.ops.mean(keras.ops.square(y - p), axis=-1)` "
    "instead of `... keras.ops.mean(...)` over everything."
)


def _unreduced(loss: Any) -> Callable:
    if isinstance(loss, str):
        fn = keras.losses.get(loss)
    elif isinstance(loss, keras.losses.Loss):
        # Loss.__call__ = call (elementwise) + reduction; call alone is per example.
        fn = loss.call
    elif callable(loss):
        fn = loss
    else:
        raise TypeError(f"loss must be a Keras loss, a loss name, or a callable; got {loss!r}")

    def in_float32(*args):
        # As Keras's Loss.__call__ does: half-precision predictions (mixed precision) are
        # compared in float32.
        return fn(*[_at_least_float32(a) for a in args])

    return in_float32


def _at_least_float32(values):
    def cast(t):
        if isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype in (tf.float16, tf.bfloat16):
            return tf.cast(t, tf.float32)
        return t
    return tf.nest.map_structure(cast, values) if values is not None else None


def _per_example(values: tf.Tensor) -> tf.Tensor:
    values = tf.convert_to_tensor(values)
    if values.shape.rank == 0:
        raise ValueError(_SCALAR_LOSS_HELP)
    if values.shape.rank > 1:
        values = tf.reduce_sum(values, axis=list(range(1, values.shape.rank)))
    if not values.dtype.is_floating or values.dtype.size < 4:
        values = tf.cast(values, tf.float32)
    return values


def per_example_loss(loss: Any) -> PerExampleLoss:
    """Return ``fn(y_true, y_pred) -> (B,)``.

    * a Keras loss object, a loss name or a callable ``(y_true, y_pred)``: applied as is, to every
      output of a multi-output model (summed);
    * a list or dict of those: one per model output, matched like ``model.compile`` does;
    * ``None``: the model's output already is the per-example loss.

    A result of shape ``(B, ...)`` is summed over its non-batch axes; a scalar is an error.
    With ``y_true=None`` the loss is called with ``y_pred`` alone.
    """
    if loss is None:
        return lambda y_true, y_pred: sum(_per_example(p) for p in tf.nest.flatten(y_pred))
    if isinstance(loss, (list, tuple, dict)):
        fns = tf.nest.map_structure(_unreduced, loss)

        def structured(y_true, y_pred):
            pred_flat = _flatten_like(loss, y_pred, "outputs")
            true_flat = _flatten_like(loss, y_true, "targets") if y_true is not None else None
            terms = []
            for k, fn in enumerate(tf.nest.flatten(fns)):
                args = (pred_flat[k],) if true_flat is None else (true_flat[k], pred_flat[k])
                terms.append(_per_example(fn(*args)))
            return tf.add_n(terms)

        return structured
    fn = _unreduced(loss)

    def single(y_true, y_pred):
        preds = tf.nest.flatten(y_pred)
        trues = [None] * len(preds) if y_true is None else tf.nest.flatten(y_true)
        if len(trues) != len(preds):
            raise ValueError(f"The model has {len(preds)} outputs but y has {len(trues)} parts; "
                             "pass one target per output.")
        terms = [_per_example(fn(p) if t is None else fn(t, p))
                 for t, p in zip(trues, preds, strict=True)]
        return tf.add_n(terms) if len(terms) > 1 else terms[0]

    return single


def _flatten_like(structure, values, what: str) -> list:
    if isinstance(structure, dict) and isinstance(values, dict):
        missing = set(structure) - set(values)
        if missing:
            raise ValueError(f"No model {what} named {sorted(missing)} for the loss dict.")
        return [values[k] for k in sorted(structure)]
    flat = tf.nest.flatten(values)
    if len(flat) != len(tf.nest.flatten(structure)):
        raise ValueError(f"{len(tf.nest.flatten(structure))} losses for {len(flat)} {what}.")
    return flat
