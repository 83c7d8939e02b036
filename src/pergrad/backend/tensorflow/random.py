"""TensorFlow's noise keys and Gaussian draws (the contract: :mod:`pergrad.aggregate.noise`)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad.backend.keys import KEY_DTYPE, RADIUS_BITS, check_key, initial_state


def check_noise_keys() -> None:
    """Nothing to check: TensorFlow has 64-bit integers."""


def enable_noise_keys() -> None:
    """Nothing to enable: TensorFlow has 64-bit integers."""


def new_key_state(seed: int) -> Any:
    """A ``tf.Variable`` ``[seed, 0]``, made outside any function graph (so a stream first used
    inside a ``tf.function`` works)."""
    with tf.init_scope():
        return tf.Variable(initial_state(seed), dtype=KEY_DTYPE, trainable=False,
                           name="noise_state")


def take_key(state: Any) -> Any:
    return next_key(state, tf.constant(1, KEY_DTYPE))


def next_key(state: Any, step: Any) -> Any:
    """Read ``state`` before adding ``[0, step]`` to it: automatic control dependencies order
    the two in a ``tf.function``."""
    key = tf.identity(tf.convert_to_tensor(state))
    with tf.control_dependencies([key]):
        state.assign_add(tf.stack([tf.zeros_like(step), step]))
    return key


def gaussian_noise(key: Any, values: list, stddev: float) -> list:
    """One Box-Muller draw per tensor, each from its own key of ``stateless_split``."""
    keys = tf.random.experimental.stateless_split(check_key(key), num=len(values))
    return [stddev * _normal(v.shape if v.shape.is_fully_defined() else tf.shape(v), keys[k],
                             keras.backend.standardize_dtype(v.dtype))
            for k, v in enumerate(values)]


def _normal(shape, key, dtype: str) -> Any:
    """Standard normals of ``shape`` from ``key`` by the Box-Muller transform (faster than
    ``stateless_normal`` on the project's CPU: docs/benchmarks.md, "DP noise, dispatch and
    compilation"). Radius words with :data:`RADIUS_BITS` random bits, their logarithm in
    float64; angles and products in float32 (float64 for float64 values); half precision is
    cast from float32."""
    if not isinstance(shape, tf.Tensor):  # int32 even when empty: a scalar variable's noise
        shape = tf.constant(tf.TensorShape(shape).as_list(), tf.int32)
    count = tf.reduce_prod(shape)
    pairs = (count + 1) // 2
    radius_key, angle_key = tf.unstack(tf.random.experimental.stateless_split(key, num=2))
    words = tf.random.stateless_uniform([pairs], radius_key, minval=None, maxval=None,
                                        dtype=tf.uint64)
    k = tf.cast(tf.bitwise.right_shift(words, 64 - RADIUS_BITS), tf.float64)
    u = (k + 0.5) * 2.0 ** -RADIUS_BITS  # in (0, 1]
    wide = tf.float64 if dtype == "float64" else tf.float32
    radius = tf.cast(tf.sqrt(-2.0 * tf.math.log(u)), wide)
    angle = (2.0 * np.pi) * tf.random.stateless_uniform([pairs], angle_key, dtype=wide)
    normals = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], axis=0)[:count]
    return tf.cast(tf.reshape(normals, shape), dtype)
