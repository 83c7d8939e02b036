"""The DP noise is ``N(0, stddev^2)`` out to its far tail, on every backend.

The Gaussian mechanism's accounting assumes untruncated noise; a sampler that cannot go beyond
``cut`` standard deviations reveals an example whose clipped gradient moves one coordinate by
``C`` with probability ``P(Z > cut - 1/sigma)`` per release, which no accountant counts.
TensorFlow's ``stateless_normal`` stops at 5.68 (it clamps its uniform at 1e-7), JAX's float32
``normal`` at +5.22 and -5.42. pergrad's draw (:func:`pergrad.aggregate.noise.gaussian_noise`)
reaches ``sqrt(2 * 54 ln 2) = 8.65`` by the Box-Muller transform (TensorFlow; PyTorch on
NumPy's Philox) and
``-ndtri(2^-65) = 9.16`` by the inverse CDF (JAX).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from scipy import special, stats

from pergrad import backend
from pergrad.aggregate import noise
from pergrad.backend import host_random

BOX_MULLER_CUT = math.sqrt(2 * (noise.RADIUS_BITS + 1) * math.log(2))
INVERSE_CDF_CUT = -float(special.ndtri(2.0 ** -(noise.INVERSE_CDF_BITS + 2)))


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
    # The two halves are independent normals too (Box-Muller's cosine and sine halves).
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


def test_the_draw_reaches_the_far_tail(monkeypatch):
    """The smallest uniform the sampler can draw gives its largest value.

    Box-Muller (TensorFlow, PyTorch): every radius word 0 and every angle 0, so the cosine
    half is the largest value and the sine half 0. Inverse CDF (JAX): every word 0 (``v``
    smallest, sign bit 0) gives the most negative value, every word 1 (sign bit 1) the most
    positive one, every word all ones ``v`` nearest 1/2, i.e. 0."""
    if backend.is_jax():
        import jax
        import jax.numpy as jnp

        for word, expected in [(0, -INVERSE_CDF_CUT), (1, INVERSE_CDF_CUT), (2**64 - 1, 0.0)]:
            monkeypatch.setattr(jax.random, "bits",
                                lambda key, shape, dtype, word=word: jnp.full(shape, word, dtype))
            for dtype, rtol in [("float64", 1e-12), ("float32", 1e-6)]:
                (drawn,) = _draw([np.zeros((4, 3), dtype)], 1.0)
                np.testing.assert_allclose(drawn, expected, rtol=rtol, atol=1e-7)
        assert INVERSE_CDF_CUT > 9.1
        return
    if backend.is_torch():  # NumPy's Philox words and angles, all zero
        monkeypatch.setattr(host_random, "radius_words_and_angles", lambda generator, pairs, dtype: (
            np.zeros(pairs, np.uint64), np.zeros(pairs, dtype)))
        (drawn,) = _draw([np.zeros((4, 3), "float64")], 1.0)
    else:
        import tensorflow as tf

        monkeypatch.setattr(tf.random, "stateless_uniform",
                            lambda shape, seed, minval=0, maxval=None, dtype=tf.float32:
                            tf.zeros(shape, dtype))
        (drawn,) = _draw([np.zeros((4, 3), "float64")], 1.0)
    flat = drawn.ravel()
    np.testing.assert_allclose(flat[:6], BOX_MULLER_CUT, rtol=1e-12)
    np.testing.assert_allclose(flat[6:], 0.0, atol=1e-12)
    assert BOX_MULLER_CUT > 8.6


def test_pytorch_draws_from_the_whole_128_bit_key_without_tensorflow():
    """PyTorch's draw is :func:`noise.host_normal` from NumPy's Philox stream keyed by the whole
    ``[seed, counter]``, the values one after another, in each value's dtype (half precision
    drawn in float32). Keys that differ only above bit 32 of the seed or of the counter draw
    different numbers: ``torch.Generator`` keeps 32 bits of a seed, and keys folded into it
    would repeat noise."""
    if not backend.is_torch():
        pytest.skip("the PyTorch draw; TensorFlow and JAX draw on the device")

    values = [np.zeros((3, 5), "float32"), np.zeros((7,), "float64"), np.zeros((), "float32"),
              np.zeros((2, 2), "float16")]
    drawn = _draw(values, 1.7)
    generator = noise.host_generator(np.array([12345, 0], np.int64))
    for d, v in zip(drawn, values, strict=True):
        wide = "float64" if v.dtype == np.float64 else "float32"
        expected = noise.host_normal(generator, v.shape, wide, 1.7)
        assert d.dtype == v.dtype and d.shape == v.shape
        np.testing.assert_array_equal(d, expected.astype(v.dtype))
    first = _draw([np.zeros((64,), "float32")], 1.0)[0]
    for seed, counter in [(12345 + 2**32, 0), (12345 + 2**40, 0), (12345, 2**32),
                          (12345, 2**40), (12345, 1)]:
        key = keras.ops.convert_to_tensor(np.array([seed, counter], np.int64))
        (other,) = noise.gaussian_noise(key, [keras.ops.zeros((64,))], 1.0)
        assert not np.allclose(keras.ops.convert_to_numpy(other), first), (seed, counter)
