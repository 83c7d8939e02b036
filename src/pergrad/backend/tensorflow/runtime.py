"""What TensorFlow's runtime says about the computation being built: tracing, strategies,
processes, precision."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras import ops


def is_tracing(x: Any) -> bool:
    """Whether a graph is being built (``tf.function``), not eager execution."""
    return not tf.executing_eagerly()


def has_strategy() -> bool:
    """Whether a ``tf.distribute`` strategy scope is active."""
    return tf.distribute.has_strategy()


def process_count() -> int:
    """One: several TensorFlow workers are one ``tf.distribute`` program, not processes pergrad
    coordinates itself."""
    return 1


def tensor_float_32() -> bool:
    """Whether float32 matmuls run as TensorFloat-32: TensorFlow's default on a GPU."""
    return bool(tf.config.experimental.tensor_float_32_execution_enabled()
                and tf.config.list_physical_devices("GPU"))


def layer_rounding(layer: Any, dtype: str) -> str:
    """``dtype``: TensorFlow computes a layer in its compute dtype."""
    return dtype


def wide_scalar(value: float) -> Any:
    """``value`` as a float64 scalar tensor."""
    return ops.convert_to_tensor(value, "float64")

