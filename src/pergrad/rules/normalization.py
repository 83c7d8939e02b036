"""LayerNormalization, RMSNormalization, GroupNormalization, BatchNormalization (inference).

All three end in an affine map ``z = xhat * gamma + beta`` over their parameter axes, where
``xhat`` is the normalized input. So

    dL_i/dgamma = sum_{other axes} dL/dz_i * xhat_i        dL_i/dbeta = sum_{other axes} dL/dz_i

materialized (these variables are small). ``xhat`` is recomputed by the layer itself with
``gamma = 1`` and ``beta = 0`` (``stateless_call``), so epsilon, RMS scaling and moving statistics
follow whatever the installed Keras does.

BatchNormalization in training mode normalizes with the batch's own statistics: every example's
output depends on every other example, per-example gradients do not exist, and the engine refuses it
(:func:`pergrad.keras.replace_batch_normalization` swaps it for GroupNormalization). So is a
LayerNormalization, RMSNormalization or GroupNormalization whose ``axis`` includes the batch axis 0:
its statistics are taken across examples.
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad._compat import sublayers
from pergrad.backend.ops import batch_size, rank
from pergrad.rules import LayerCall, register
from pergrad.rules.forms import Materialized

_RMS = (keras.layers.RMSNormalization,) if hasattr(keras.layers, "RMSNormalization") else ()
# The normalizations whose statistics are each example's own, as long as axis excludes 0.
_PER_EXAMPLE_NORMALIZATIONS = (keras.layers.LayerNormalization, keras.layers.GroupNormalization,
                               *_RMS)


class MixesExamplesError(ValueError):
    """A layer couples the examples of a batch, so per-example gradients are not defined."""


def _scale_and_offset(layer):
    """The layer's ``gamma`` (``scale`` for RMSNormalization) and ``beta`` variables, or None."""
    gamma = getattr(layer, "scale", None) if _is_rms(layer) else getattr(layer, "gamma", None)
    return gamma, getattr(layer, "beta", None)


def _is_rms(layer) -> bool:
    return bool(_RMS) and isinstance(layer, _RMS)


def _normalized(layer, call: LayerCall):
    gamma, beta = _scale_and_offset(layer)
    trainable = []
    for v in layer.trainable_variables:
        if v is gamma:
            trainable.append(ops.ones(v.shape, v.dtype))
        elif v is beta:
            trainable.append(ops.zeros(v.shape, v.dtype))
        else:
            trainable.append(v.value)
    non_trainable = [v.value for v in layer.non_trainable_variables]
    out, _ = layer.stateless_call(trainable, non_trainable, *call.args, **call.kwargs)
    return out


def _param_axes(layer, rank: int) -> list[int]:
    if isinstance(layer, (keras.layers.LayerNormalization, *_RMS)):
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    else:
        axes = [layer.axis]
    return [a % rank for a in axes]


def _per_example(layer, values, variable):
    ndim = rank(values)
    axes = _param_axes(layer, ndim)
    summed = [a for a in range(1, ndim) if a not in axes]
    reduced = ops.sum(values, axis=summed) if summed else values
    order = sorted(axes)
    if order != axes:
        reduced = ops.transpose(reduced, [0, *[1 + order.index(a) for a in axes]])
    return ops.reshape(ops.cast(reduced, variable.dtype), [batch_size(values), *variable.shape])


def normalization_rule(layer, call: LayerCall, grad) -> list:
    forms = []
    d = ops.cast(grad, layer.variable_dtype)
    gamma, beta = _scale_and_offset(layer)
    if gamma is not None and gamma.trainable:
        xhat = ops.cast(_normalized(layer, call), layer.variable_dtype)
        forms.append(Materialized(gamma, _per_example(layer, d * xhat, gamma)))
    if beta is not None and beta.trainable and not getattr(layer, "rms_scaling", False):
        forms.append(Materialized(beta, _per_example(layer, d, beta)))
    return forms


def _refuse_training_mode(layer, call: LayerCall) -> None:
    if call.kwargs.get("training") and layer.trainable:
        raise MixesExamplesError(
            f"Layer {layer.name!r} is BatchNormalization in training mode: it normalizes each "
            "example with statistics of the whole batch, so per-example gradients do not exist. "
            "Training from scratch: replace every BatchNormalization with GroupNormalization by "
            "`model = pergrad.keras.replace_batch_normalization(model)`. Fine-tuning: freeze it "
            f"(`model.get_layer({layer.name!r}).trainable = False`, which also runs it in "
            "inference mode), or call the model with training=False."
        )


def _statistics_axes(layer) -> list[int]:
    """The axes a LayerNormalization, RMSNormalization or GroupNormalization takes its
    statistics within (its parameter axes; negative axes as given)."""
    return list(layer.axis) if isinstance(layer.axis, (list, tuple)) else [layer.axis]


def _refuse_batch_axis(layer, rank_of_input: int | None) -> None:
    """Raise :class:`MixesExamplesError` naming ``layer`` if one of its axes is the batch axis 0
    of an input of rank ``rank_of_input`` (negative axes need the rank; unknown: not checked)."""
    axes = _statistics_axes(layer)
    if any(a == 0 or (rank_of_input is not None and a == -rank_of_input) for a in axes):
        raise MixesExamplesError(
            f"Layer {layer.name!r} ({type(layer).__name__}) has axis={layer.axis!r}, which "
            "includes the batch axis 0: it normalizes with statistics across the examples of a "
            "batch, so per-example gradients do not exist. Normalize over the feature axes "
            "only (axis=-1, the default).")


def _refuse_batch_axis_call(layer, call: LayerCall) -> None:
    inputs = call.args[0] if call.args else None
    shape = getattr(inputs, "shape", None)
    _refuse_batch_axis(layer, None if shape is None else len(shape))


def refuse_statistics_over_the_batch(model) -> None:
    """Refuse ``model`` if one of its LayerNormalization, RMSNormalization or
    GroupNormalization layers normalizes over the batch axis (see :func:`_refuse_batch_axis`).
    Static: reads each layer's ``axis`` and built input rank (``get_build_config``), so it runs
    before any call, where a one-example call of such a layer would end in a shape error."""
    for layer in sublayers(model, include_self=True):
        if isinstance(layer, _PER_EXAMPLE_NORMALIZATIONS):
            shape = (layer.get_build_config() or {}).get("input_shape") if layer.built else None
            rank = len(shape) if isinstance(shape, (list, tuple)) else None
            _refuse_batch_axis(layer, rank)


register(*_PER_EXAMPLE_NORMALIZATIONS, check_call=_refuse_batch_axis_call)(normalization_rule)
register(keras.layers.BatchNormalization, check_call=_refuse_training_mode)(normalization_rule)
