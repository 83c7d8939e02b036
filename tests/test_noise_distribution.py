"""The DP noise is ``N(0, stddev^2)`` out to its far tail, on every backend.

The Gaussian mechanism's accounting assumes untruncated noise; a sampler that cannot go beyond
``cut`` standard deviations reveals an example whose clipped gradient moves one coordinate by
``C`` with probability ``P(Z > cut - 1/sigma)`` per release, which no accountant counts.
TensorFlow's ``stateless_normal`` stops at 5.68 (it clamps its uniform at 1e-7), JAX's float32
``normal`` at +5.22 and -5.42; pergrad's Box-Muller draw (:func:`pergrad.aggregate.noise.gaussian_noise`)
reaches ``sqrt(2 * 54 ln 2) = 8.65``.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from scipy import stats

from pergrad import backend
from pergrad.aggregate import noise

pytestmark = pytest.mark.all_backends

CUT = math.sqrt(2 * (noise.RADIUS_BITS + 1) * math.log(2))


def _key(counter: int):
    return keras.ops.convert_to_tensor(np.array([12345, counter], np.int64))


def _draw(values, stddev, counter=0) -> list[np.ndarray]:
    tensors = [keras.ops.convert_to_tensor(v) for v in values]
    return [keras.ops.convert_to_numpy(n) for n in noise.gaussian_noise(_key(counter), tensors,
                                                                          stddev)]


def test_noise_is_normal_with_the_given_stddev():
    big, small = _draw([np.zeros((300, 1001), "float32"), np.zeros((7,), "float32")], 2.0)
    assert big.shape == (300, 1001) and small.shape == (7,)
    assert big.dtype == np.float32 and np.all(np.isfinite(big))
    z = big.ravel().astype(np.float64) / 2.0
    assert abs(z.mean()) < 4 / math.sqrt(z.size)
    assert abs(z.std() - 1) < 0.01
    assert stats.kstest(z, "norm").pvalue > 1e-4
    # The cosine and sine halves of the pairs are independent normals too.
    half = z.size // 2
    assert abs(np.corrcoef(z[:half], z[half:2 * half])[0, 1]) < 4 / math.sqrt(half)
    again = _draw([np.zeros((300, 1001), "float32")], 2.0)[0]
    other = _draw([np.zeros((300, 1001), "float32")], 2.0, counter=1)[0]
    np.testing.assert_array_equal(big, again)  # stateless: the same key, the same numbers
    assert abs(np.corrcoef(big.ravel(), other.ravel())[0, 1]) < 4 / math.sqrt(z.size)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_noise_has_the_value_dtype(dtype):
    (drawn,) = _draw([np.zeros((50, 40), dtype)], 1.0)
    assert drawn.dtype == np.dtype(dtype) and np.all(np.isfinite(drawn))
    assert 0.9 < float(np.std(drawn.astype(np.float64))) < 1.1


def test_the_radius_reaches_the_far_tail(monkeypatch):
    """Every radius word 0 (the smallest uniform) and every angle 0: the cosine half is the
    largest value the sampler can draw, the sine half 0."""
    if backend.is_jax():
        import jax
        import jax.numpy as jnp

        monkeypatch.setattr(jax.random, "bits",
                            lambda key, shape, dtype: jnp.zeros(shape, dtype))
        monkeypatch.setattr(jax.random, "uniform",
                            lambda key, shape, dtype: jnp.zeros(shape, dtype))
    else:  # TensorFlow, and PyTorch, which draws TensorFlow's numbers
        import tensorflow as tf

        monkeypatch.setattr(tf.random, "stateless_uniform",
                            lambda shape, seed, minval=0, maxval=None, dtype=tf.float32:
                            tf.zeros(shape, dtype))
    (drawn,) = _draw([np.zeros((4, 3), "float64")], 1.0)
    flat = drawn.ravel()
    np.testing.assert_allclose(flat[:6], CUT, rtol=1e-12)
    np.testing.assert_allclose(flat[6:], 0.0, atol=1e-12)
    assert CUT > 8.6
