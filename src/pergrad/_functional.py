"""Shortcuts over :class:`pergrad.PerExample` and ``vmap_grad`` for raw TensorFlow functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pergrad.backend.lazy import tensorflow as tf
from pergrad.engine import PerExample


def per_example_gradients(model, loss, x, y=None, sample_weight=None, **kwargs) -> list[tf.Tensor]:
    """``PerExample(model, loss, **kwargs).gradients(x, y, sample_weight)``."""
    return PerExample(model, loss, **kwargs).gradients(x, y, sample_weight)


def per_example_norms(model, loss, x, y=None, sample_weight=None, **kwargs) -> tf.Tensor:
    """``PerExample(model, loss, **kwargs).norms(x, y, sample_weight)``."""
    return PerExample(model, loss, **kwargs).norms(x, y, sample_weight)


def vmap_grad(fn: Callable[..., Any], *, jit_compile: bool = False) -> Callable[..., Any]:
    """Like ``jax.vmap(jax.grad(fn), in_axes=(None, 0, ...))``, compiled once.

    ``fn(params, *example) -> scalar`` is the loss of ONE example (no batch axis). The result
    ``f(params, *batch)`` returns, nested like ``params``, ``d fn(params, *example_i) / d params``
    with a leading batch axis, vectorized with ``tf.vectorized_map``.
    """

    def per_example(params, *batch):
        params = tf.nest.map_structure(tf.convert_to_tensor, params)

        def one(example):
            with tf.GradientTape() as tape:
                tape.watch(params)
                value = fn(params, *example)
            if value.shape.rank != 0:
                raise ValueError(f"vmap_grad: fn must return a scalar for one example, got "
                                 f"shape {value.shape}.")
            return tape.gradient(value, params,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)

        return tf.vectorized_map(one, batch)

    return tf.function(per_example, jit_compile=jit_compile, reduce_retracing=True)
