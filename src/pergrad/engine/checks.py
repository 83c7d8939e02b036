"""Checks that per-example gradients mean what they say, with tolerances that follow the dtype.

**Example mixing.** Per-example gradients exist only if example ``i``'s loss depends on example
``i`` alone. With ``l_k^B`` example ``k``'s loss computed inside the batch and ``l_k^1`` the same
example's loss computed as a batch of one (both with ``training=False``, so dropout cannot
differ), the mixing of a batch is

    m = max_k |l_k^B - l_k^1| / max(|l_k^B|, |l_k^1|, s),     s = mean_j |l_j^B|

over the first ``min(num_examples, B)`` examples. The floor ``s`` keeps a loss near zero (a
well-fit example) from turning rounding noise into a large *relative* difference: a difference
counts only when it is large against that example's loss *and* against the batch's typical loss.
An example whose loss is non-finite both ways is skipped (a NaN input row); one finite in one
computation and not in the other is infinitely mixed (another example's NaN leaked into it).

**Tolerances** are relative and follow the least precise compute dtype of the model (see
:func:`mixing_tolerance`, :func:`gradient_tolerance`); float32 on a GPU counts as float16 while
TensorFloat-32 is enabled (TensorFlow's default), which rounds matmul inputs to 10 bits.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad._compat import sublayers
from pergrad.rules.normalization import MixesExamplesError

# Unit roundoff u = 2^-p of each floating dtype (p significand bits, the implicit one included).
_ROUNDOFF = {tf.float64: 2.0 ** -53, tf.float32: 2.0 ** -24, tf.float16: 2.0 ** -11,
             tf.bfloat16: 2.0 ** -8}

# Losses of one example in and out of a batch differ only by rounding in a model that does not
# mix: a few units of roundoff u per layer, amplified by the loss's conditioning, and more where a
# kernel's accumulation order depends on the batch size (GPU GEMMs). On the test zoo (CPU, batch
# 5 and 128) the largest difference was 8e-16 (7 u) in float64, 4e-7 (7 u) in float32 and exactly
# 0 in float16 and bfloat16 (rows computed alike). The tolerances are 1e-10 (1e6 u), 1e-4
# (1.7e3 u), 1e-2 (20 u) and 5e-2 (13 u: one ulp of a bfloat16 prediction, 2u, already moves a
# squared error by 4u relative): far above rounding, far below what mixing does (a mean over the
# batch moves losses by O(1)).
_MIXING_RTOL = {tf.float64: 1e-10, tf.float32: 1e-4, tf.float16: 1e-2, tf.bfloat16: 5e-2}

# sum_i g_i against the batch gradient, relative to its largest entry: the engine sums B terms in
# another order, and under mixed precision multiplies half-precision activations and output
# gradients in float32, while the reference tape runs the half-precision backward kernels. On the
# zoo the largest error was 8e-16 (float64), 5e-7 (float32), 3.6e-3 (float16) and 4.4e-2
# (bfloat16, a convolution's filter gradient). A weight used outside its layer errs by O(1).
_GRADIENT_RTOL = {tf.float64: 1e-8, tf.float32: 1e-4, tf.float16: 2e-2, tf.bfloat16: 1e-1}


def _floating(dtype: Any) -> tf.DType:
    dtype = tf.as_dtype(keras.backend.standardize_dtype(dtype))
    if dtype not in _ROUNDOFF:
        raise ValueError(f"Expected a floating dtype (float16, bfloat16, float32, float64), got "
                         f"{dtype.name}.")
    return dtype


def _effective(dtype: Any) -> tf.DType:
    """The dtype whose rounding the computation has: float32 matmuls and convolutions on a GPU
    run as TensorFloat-32 (TensorFlow's default on Ampere and later), whose 10-bit significand is
    float16's, so float32 then gets float16's tolerances."""
    dtype = _floating(dtype)
    if dtype == tf.float32 and tf.config.experimental.tensor_float_32_execution_enabled() \
            and tf.config.list_physical_devices("GPU"):
        return tf.float16
    return dtype


def mixing_tolerance(dtype: Any) -> float:
    """The largest :meth:`PerExample.example_mixing` value that is rounding, not mixing, for a
    model computing in ``dtype`` (``"float32"``, ``tf.float16``, ...): 1e-10 in float64, 1e-4 in
    float32, 1e-2 in float16, 5e-2 in bfloat16 (8 significand bits: 13 units of roundoff).
    float32 on a GPU with TensorFloat-32 enabled (the default) gets float16's."""
    return _MIXING_RTOL[_effective(dtype)]


def gradient_tolerance(dtype: Any) -> float:
    """The relative error (against the largest batch-gradient entry) that
    :meth:`PerExample.check` allows between ``sum_i g_i`` and the batch gradient for a model
    computing in ``dtype``: 1e-8 in float64, 1e-4 in float32, 2e-2 in float16, 1e-1 in
    bfloat16; float32 on a GPU with TensorFloat-32 enabled gets float16's. A weight used
    outside its own layer errs by O(1)."""
    return _GRADIENT_RTOL[_effective(dtype)]


def compute_dtype(model) -> tf.DType:
    """The least precise floating compute dtype among ``model`` and all its layers
    (``float16`` under ``mixed_float16``, even if some layers compute in float32)."""
    dtypes = {tf.as_dtype(keras.backend.standardize_dtype(layer.compute_dtype))
              for layer in sublayers(model, include_self=True)}
    floating = [d for d in dtypes if d in _ROUNDOFF]
    if not floating:
        return tf.as_dtype(keras.config.floatx())
    return max(floating, key=lambda d: _ROUNDOFF[d])


def _take(structure, index: tf.Tensor):
    """Rows ``index`` (shape ``(1,)``) of every tensor of a nested structure."""
    return tf.nest.map_structure(lambda t: None if t is None else tf.gather(t, index), structure)


def _relative(in_batch: tf.Tensor, alone: tf.Tensor, floor: tf.Tensor) -> tf.Tensor:
    """``|a - b| / max(|a|, |b|, floor)``; 0 where both are non-finite, inf where one is."""
    finite_a, finite_b = tf.math.is_finite(in_batch), tf.math.is_finite(alone)
    a = tf.where(finite_a, in_batch, tf.zeros_like(in_batch))
    b = tf.where(finite_b, alone, tf.zeros_like(alone))
    scale = tf.maximum(tf.maximum(tf.abs(a), tf.abs(b)), floor)
    tiny = tf.constant(np.finfo(np.float64).tiny, tf.float64)
    relative = tf.abs(a - b) / tf.maximum(scale, tiny)
    one_sided = tf.not_equal(finite_a, finite_b)
    return tf.where(one_sided, tf.constant(np.inf, tf.float64), relative)


def mixing_differences(model, loss_fn, x, y, num_examples: int) -> tf.Tensor:
    """``(n,)`` float64: the relative difference (module docstring) of example ``k``'s loss in
    and out of the batch for ``k < n = num_examples``; with fewer examples than that, the last
    one is repeated. Traceable (a ``tf.function``, a ``tf.cond`` branch): ``num_examples`` model
    calls on one example each, unrolled, no loop."""
    in_batch = tf.cast(loss_fn(y, model(x, training=False)), tf.float64)
    size = tf.shape(in_batch)[0]
    finite = tf.math.is_finite(in_batch)
    magnitude = tf.where(finite, tf.abs(in_batch), tf.zeros_like(in_batch))
    floor = tf.reduce_sum(magnitude) / tf.maximum(tf.reduce_sum(tf.cast(finite, tf.float64)), 1.0)
    static = in_batch.shape[0]
    count = num_examples if static is None else max(1, min(num_examples, int(static)))
    differences = []
    for k in range(count):
        index = tf.reshape(tf.minimum(k, size - 1), [1])
        alone = tf.cast(loss_fn(_take(y, index), model(_take(x, index), training=False)),
                        tf.float64)
        differences.append(_relative(tf.gather(in_batch, index), alone, floor))
    return tf.concat(differences, axis=0)


def mixing_error(example: int, difference: float) -> MixesExamplesError:
    """The error for a batch whose example ``example``'s loss differs by ``difference``
    (relative) when that example is computed alone."""
    return MixesExamplesError(
        f"Example {example}'s loss differs by {difference:.3g} (relative) when computed alone: a "
        "layer or the loss mixes examples of a batch (e.g. a mean over axis 0, "
        "BatchNormalization in training mode); per-example gradients and DP guarantees would be "
        "wrong. Make every layer and the loss compute each example from that example alone.")
