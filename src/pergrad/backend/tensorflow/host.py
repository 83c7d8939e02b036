"""Host (NumPy) state from TensorFlow: ``tf.numpy_function`` inside a graph, a direct call
eagerly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf
from keras import ops


def host_call(fn: Callable[..., Any], results: list | None, *args: Any) -> Any:
    """``fn(*args)`` on the host with NumPy arguments (``tf.numpy_function`` while tracing), its
    results ``[(shape, dtype), ...]`` (``None``: it returns nothing)."""
    if tf.executing_eagerly():
        return fn(*tf.nest.map_structure(ops.convert_to_numpy, args))
    flat = tf.nest.flatten(args)

    def call(*values):
        out = fn(*tf.nest.pack_sequence_as(args, list(values)))
        return [] if results is None else list(out)

    types = [] if results is None else [tf.as_dtype(dtype) for _, dtype in results]
    out = tf.numpy_function(call, flat, types, stateful=True)
    if results is None:
        return None
    for value, (shape, _) in zip(out, results, strict=True):
        value.set_shape(shape)
    return tuple(out)


def branch(predicate: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``tf.cond``: one branch runs."""
    return tf.cond(predicate, true_fn, false_fn)


def wait_for_host_callbacks() -> None:
    """Nothing to wait for: a ``numpy_function`` has run when its op has."""
