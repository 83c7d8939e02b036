"""Gaussian noise drawn on the host by NumPy, keyed by a whole ``[seed, counter]`` noise key
(PyTorch's draw: :mod:`pergrad.backend.torch.random`)."""

from __future__ import annotations

import numpy as np

from pergrad.backend.keys import RADIUS_BITS


def host_generator(key: np.ndarray) -> np.random.Generator:
    """NumPy's counter-based Philox4x64 generator keyed by ``key = [seed, counter]`` (128 bits,
    each ``int64`` word taken as its unsigned bit pattern), at the start of its stream."""
    words = np.asarray(key, np.int64).view(np.uint64)
    return np.random.Generator(np.random.Philox(key=words))


def host_normal(generator: np.random.Generator, shape: tuple, dtype: str,
                stddev: float = 1.0) -> np.ndarray:
    """``stddev`` times standard normals of ``shape`` in ``dtype`` (float32 or float64) by the
    Box-Muller transform: with ``u`` uniform on ``(0, 1]`` and ``a`` uniform on ``[0, 1)``,
    ``r = sqrt(-2 ln u)`` and ``(r cos 2 pi a, r sin 2 pi a)`` are two independent standard
    normals. Radius words with :data:`RADIUS_BITS` random bits (their logarithm in float64, so
    the tail reaches 8.65 standard deviations), angles uniform on ``[0, 1)``; cosine halves
    first, then sine halves."""
    count = int(np.prod(shape, dtype=np.int64))
    pairs = (count + 1) // 2
    words, angles = radius_words_and_angles(generator, pairs, dtype)
    u = (words >> np.uint64(64 - RADIUS_BITS)).astype(np.float64)
    u += 0.5
    u *= 2.0 ** -RADIUS_BITS
    radius = np.log(u, out=u)
    radius *= -2.0 * stddev * stddev
    radius = np.sqrt(radius.astype(dtype), dtype=dtype)
    angles *= np.asarray(2.0 * np.pi, dtype)
    out = np.empty(2 * pairs, dtype)
    np.multiply(radius, np.cos(angles), out=out[:pairs])
    np.multiply(radius, np.sin(angles, out=angles), out=out[pairs:])
    return out[:count].reshape(shape)


def radius_words_and_angles(generator: np.random.Generator, pairs: int,
                            dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``pairs`` raw 64-bit words and ``pairs`` uniforms on ``[0, 1)`` in ``dtype``, in this
    order from ``generator``."""
    return (generator.bit_generator.random_raw(pairs),
            generator.random(pairs, dtype=np.dtype(dtype)))
