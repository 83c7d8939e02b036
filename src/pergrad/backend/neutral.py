"""Array helpers written once on :mod:`keras.ops`, the same on every backend (the backend
packages build on them too; everything above ``backend/`` reaches them via
:mod:`pergrad.backend.ops`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import keras
from keras import ops


def batch_size(t: Any) -> Any:
    """The leading dimension of ``t``: an int, or a scalar tensor while TensorFlow traces a
    dynamic batch (``reduce_retracing``). The static size is read without a ``keras.ops`` call
    (one costs about 10 us of dispatch on eager PyTorch, and the train step asks often)."""
    static = t.shape[0]
    return ops.shape(t)[0] if static is None else static


def rank(t: Any) -> int:
    return len(t.shape)


def dtype_of(t: Any) -> str:
    """``t``'s dtype as Keras names it (``"float32"``), for tensors and variables alike."""
    return keras.backend.standardize_dtype(t.dtype)


def concatenate_over_range(fn: Callable[[Any], Any], count: int) -> Any:
    """``concatenate([fn(k) for k in range(count)])``, unrolled: ``count`` calls of ``fn`` with
    a Python ``int`` (a TensorFlow graph, a ``tf.cond`` branch, eager PyTorch)."""
    return ops.concatenate([fn(k) for k in range(count)], axis=0)


def add_n(terms: list) -> Any:
    """``sum(terms)`` without a leading zero."""
    return functools.reduce(ops.add, terms)


def broadcast_outer_products(a: Any, d: Any) -> Any:
    """``(B, I, G, O)``: ``m[b, i, g, o] = a[b, i, g] d[b, g, o]``, one outer product per
    example and group (a one-position layer's per-example kernel gradients), as one
    broadcasting multiplication."""
    return a[:, :, :, None] * d[:, None, :, :]


def static_or_none(dim: Any) -> int | None:
    """A static dimension as an int, ``None`` when it is dynamic (a tensor or ``None``)."""
    return dim if isinstance(dim, int) else None


def zero_rows(t: Any, keep: Any) -> Any:
    """``t`` with the rows (first axis) where ``keep`` is false replaced by zeros (not
    multiplied: NaN and inf rows become 0 too); ``t`` itself when ``keep`` is ``None``."""
    if keep is None:
        return t
    mask = ops.reshape(keep, [-1] + [1] * (rank(t) - 1))
    return ops.where(mask, t, ops.zeros_like(t))


def is_floating(dtype: Any) -> bool:
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))


def maximum(a: Any, b: Any) -> Any:
    """``max(a, b)`` elementwise, in the floating ``a``'s dtype, NaN where either is NaN (as
    ``ops.maximum``, whose PyTorch version in Keras 3.15 computes two float64 tensors in
    float32: its ``result_type`` does not read torch dtypes)."""
    a = ops.convert_to_tensor(a)
    b = ops.cast(b, a.dtype)
    return ops.where(ops.logical_or(ops.isnan(a), a >= b), a, b)


def minimum(a: Any, b: Any) -> Any:
    """``min(a, b)`` elementwise, in the floating ``a``'s dtype, NaN where either is NaN
    (see :func:`maximum`)."""
    a = ops.convert_to_tensor(a)
    b = ops.cast(b, a.dtype)
    return ops.where(ops.logical_or(ops.isnan(a), a <= b), a, b)


def divide_no_nan(numerator: Any, denominator: Any) -> Any:
    """``numerator / denominator``, 0 where the denominator is 0 (``tf.math.divide_no_nan``)."""
    zero = ops.equal(denominator, 0)
    safe = ops.where(zero, ops.ones_like(denominator), denominator)
    return ops.where(zero, ops.zeros_like(numerator * safe), numerator / safe)


def scan_recurrence(body: Callable, extras: int, elems: tuple, zero: Any, states: tuple,
                    sequences: bool) -> tuple:
    """:func:`pergrad.rules.recurrent._recur`'s loop as one ``keras.ops.scan`` over time:
    the stacked outputs (``None`` unless ``sequences``), the last output, the final states,
    ``h_{t-1}`` and the extras (JAX's and PyTorch's ``recurrence``)."""
    (last, final_states), (outputs, previous, extra_steps) = ops.scan(
        body, (zero, tuple(states)), elems)
    return outputs if sequences else None, last, tuple(final_states), previous, extra_steps


def generator_state() -> Any:
    """``None``: on TensorFlow and JAX, Keras's random layers draw from their seed states,
    which the layer's non-trainable values hold (PyTorch has its own)."""
    return None


def replaying_generators(state: Any) -> contextlib.AbstractContextManager:
    """Nothing to replay where :func:`generator_state` is ``None``."""
    del state
    return contextlib.nullcontext()
