"""Turn whatever the user passes as ``loss`` into a per-example loss ``(y_true, y_pred) -> (B,)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from pergrad._compat import keras_mask
from pergrad.backend.ops import add_n, dtype_of, is_floating, rank

PerExampleLoss = Callable[[Any, Any], Any]

#: Reductions whose batch mean ``PerExampleModel`` reproduces (Keras's default and its aliases).
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "none", None)


def scalar_loss_error(name: str) -> ValueError:
    return ValueError(
        f"The loss {name!r} returned a scalar, but pergrad needs one loss per example, shape "
        "(batch,). Pass a Keras loss object or name (pergrad turns its reduction off), or write "
        "the function without the final reduction, e.g. `lambda y, p: "
        "keras.ops.mean(keras.ops.square(y - p), axis=-1)` instead of `... keras.ops.mean(...)` "
        "over everything.")


def _combined_mask(padding: Any, ignored: Any, values: Any) -> Any:
    """The valid entries of ``values``: the predictions' padding mask and the loss's own mask
    (ignored labels), both where both exist; ``None`` when neither does, or when ``values``
    has fewer axes than the mask (a loss that already reduced over the masked positions, as
    the per-example losses ``PerExampleModel`` hands the engine)."""
    masks = [ops.cast(m, "bool") for m in (padding, ignored)
             if m is not None and rank(m) <= rank(values)]
    if not masks:
        return None
    mask = masks[0] if len(masks) == 1 else ops.logical_and(masks[0], masks[1])
    while rank(mask) < rank(values):
        mask = ops.expand_dims(mask, -1)
    return ops.logical_and(mask, ops.ones_like(values, "bool"))


def _masked_per_example(values: Any, mask: Any, average: bool) -> Any:
    """``l_i = sum_t m_it v_it``, divided by ``sum_t m_it`` when ``average`` (an example with no
    valid entry has loss 0): every example's loss over its own valid entries."""
    weights = ops.cast(mask, values.dtype)
    values = ops.where(mask, values, ops.zeros_like(values))  # padding may hold inf or NaN
    axes = list(range(1, rank(values)))
    total = ops.sum(values * weights, axis=axes) if axes else values * weights
    if not average:
        return total
    count = ops.sum(weights, axis=axes) if axes else weights
    return ops.divide_no_nan(total, count)


def leaf_loss(loss: Any, like_compile: bool = False) -> PerExampleLoss:
    """``fn(y_true, y_pred) -> (B,)`` for one model output: the one per-example loss adapter.

    ``l_i`` is the loss's unreduced value for example ``i`` reduced over its non-batch axes:

    * ``like_compile=False`` (``PerExample``): **summed** over them, so that ``sum_i l_i`` is
      the loss of the whole batch; only half-precision arguments (predictions or labels) are
      cast, to float32, as Keras's ``Loss.__call__`` does under mixed precision; integer labels
      reach the function as given.
    * ``like_compile=True`` (``PerExampleModel``, matching ``model.compile``'s loss):
      **averaged** over them, as Keras's ``sum_over_batch_size`` does, so that
      ``mean_i l_i`` equals Keras's compiled loss; ``y_true`` and ``y_pred`` are both cast to
      the loss's dtype first, as ``Loss.__call__`` does. A loss with another reduction, and the
      ambiguous names ``"crossentropy"``/``"ce"``, are refused.

    ``loss``: a Keras loss object, a loss name or a callable ``(y_true, y_pred)``; called with
    ``y_pred`` alone when ``y_true`` is ``None``. A scalar result is an error.

    Masks (``Embedding(mask_zero=True)`` padding carried by ``y_pred``, labels ignored by
    ``SparseCategoricalCrossentropy(ignore_class=...)``) leave out the invalid entries:
    ``l_i = sum_t m_it v_it`` (summed) or ``sum_t m_it v_it / sum_t m_it`` (averaged, 0 for an
    example with no valid entry). Each example's loss is then its own: Keras's compiled loss
    instead divides by the valid entries of the whole batch, a batch statistic that would let
    one example change another's gradient, so with masks ``mean_i l_i`` equals Keras's loss only
    when every example has the same number of valid entries.

    The returned function's attribute ``masked`` turns ``True`` once a call has applied a mask
    (read by the train step, which then reports Keras's own batch-wide masked loss).
    """
    if isinstance(loss, str):
        if like_compile and loss.lower() in ("crossentropy", "ce"):
            raise ValueError(f"loss={loss!r} is ambiguous for PerExampleModel; name it: "
                             "'binary_crossentropy', 'categorical_crossentropy' or "
                             "'sparse_categorical_crossentropy'.")
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        if like_compile and loss.reduction not in MEAN_REDUCTIONS:
            raise ValueError(f"Loss {loss.name!r} has reduction={loss.reduction!r}; "
                             "PerExampleModel averages per-example losses over the batch like "
                             "'sum_over_batch_size' does. Use that reduction (the default).")
        # Loss.__call__ = call (elementwise) + reduction; call alone is per example.
        fn, dtype, name = loss.call, loss.dtype, loss.name
    elif callable(loss):
        fn, dtype, name = loss, None, getattr(loss, "__name__", repr(loss))
    else:
        raise TypeError(f"loss must be a Keras loss, a loss name, or a callable; got {loss!r}")
    dtype = keras.backend.standardize_dtype(dtype or keras.config.floatx())

    def per_example(y_true, y_pred):
        padding = keras_mask(y_pred)  # read before a cast drops it
        if like_compile:
            y_pred = keras.tree.map_structure(lambda t: ops.cast(t, dtype), y_pred)
            if y_true is not None:
                y_true = keras.tree.map_structure(lambda t: ops.cast(t, dtype), y_true)
        else:
            y_true, y_pred = _at_least_float32(y_true), _at_least_float32(y_pred)
        values = ops.convert_to_tensor(fn(y_pred) if y_true is None else fn(y_true, y_pred))
        if rank(values) == 0:
            raise scalar_loss_error(name)
        mask = _combined_mask(padding, keras_mask(values), values)
        if mask is not None:
            per_example.masked = True
            values = _masked_per_example(values, mask, like_compile)
        elif rank(values) > 1:
            axes = list(range(1, rank(values)))
            values = ops.mean(values, axis=axes) if like_compile else ops.sum(values, axis=axes)
        if not is_floating(values.dtype) or dtype_of(values) in ("float16", "bfloat16"):
            values = ops.cast(values, "float32")
        return values

    per_example.masked = False
    return per_example


def _at_least_float32(values):
    def cast(t):
        if ops.is_tensor(t) and dtype_of(t) in ("float16", "bfloat16"):
            return ops.cast(t, "float32")
        return t
    return keras.tree.map_structure(cast, values) if values is not None else None


def _per_example(values):
    """A model output that already is the per-example loss, summed over non-batch axes."""
    values = ops.convert_to_tensor(values)
    if rank(values) == 0:
        raise scalar_loss_error("model output")
    if rank(values) > 1:
        values = ops.sum(values, axis=list(range(1, rank(values))))
    if not is_floating(values.dtype) or dtype_of(values) in ("float16", "bfloat16"):
        values = ops.cast(values, "float32")
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
        return lambda y_true, y_pred: add_n([_per_example(p) for p in keras.tree.flatten(y_pred)])
    if isinstance(loss, (list, tuple, dict)):
        fns = keras.tree.map_structure(leaf_loss, loss)

        def structured(y_true, y_pred):
            pred_flat = _flatten_like(loss, y_pred, "outputs")
            true_flat = _flatten_like(loss, y_true, "targets") if y_true is not None else None
            terms = [fn(None if true_flat is None else true_flat[k], pred_flat[k])
                     for k, fn in enumerate(keras.tree.flatten(fns))]
            return add_n(terms)

        return structured
    fn = leaf_loss(loss)

    def single(y_true, y_pred):
        preds = keras.tree.flatten(y_pred)
        trues = [None] * len(preds) if y_true is None else keras.tree.flatten(y_true)
        if len(trues) != len(preds):
            raise ValueError(f"The model has {len(preds)} outputs but y has {len(trues)} parts; "
                             "pass one target per output.")
        terms = [fn(t, p) for t, p in zip(trues, preds, strict=True)]
        return add_n(terms) if len(terms) > 1 else terms[0]

    return single


def _flatten_like(structure, values, what: str) -> list:
    if isinstance(structure, dict) and isinstance(values, dict):
        missing = set(structure) - set(values)
        if missing:
            raise ValueError(f"No model {what} named {sorted(missing)} for the loss dict.")
        return [values[k] for k in sorted(structure)]
    flat = keras.tree.flatten(values)
    if len(flat) != len(keras.tree.flatten(structure)):
        raise ValueError(f"{len(keras.tree.flatten(structure))} losses for {len(flat)} {what}.")
    return flat


def weighted_losses(losses, sample_weight):
    """``w_i l_i``; ``sample_weight`` is ``None``, ``(B,)`` or ``(B, 1)``."""
    if sample_weight is None:
        return losses
    w = ops.cast(sample_weight, dtype_of(losses))
    if rank(w) > 1:
        if any(n != 1 for n in w.shape[1:]):
            raise ValueError(f"sample_weight must have one weight per example, shape (batch,) "
                             f"or (batch, 1); got shape {tuple(w.shape)}. Per-timestep weights "
                             "are not supported: fold them into the loss function instead.")
        w = ops.reshape(w, [-1])
    return losses * w
