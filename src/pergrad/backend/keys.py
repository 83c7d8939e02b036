"""The noise key every backend draws from: an ``int64`` tensor ``[seed, counter]``.

Why keys never repeat, and who owns the streams they come from: :mod:`pergrad.aggregate.noise`.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

#: Shape and dtype of a noise key and of a stream's state.
KEY_SHAPE = (2,)
KEY_DTYPE = "int64"

#: Bits of the uniform behind each Box-Muller radius (TensorFlow, PyTorch):
#: ``u = (k + 1/2) 2^-53`` for a 53-bit integer ``k``, so
#: ``r = sqrt(-2 ln u) <= sqrt(2 * 54 ln 2) = 8.65`` standard deviations.
RADIUS_BITS = 53

#: Bits of the uniform under JAX's inverse-CDF draw: ``v = (k + 1/2) 2^-64`` for a 63-bit
#: integer ``k`` (the word's 64th bit is the sign), so ``|Z| = -ndtri(v) <= -ndtri(2^-65) = 9.16``.
INVERSE_CDF_BITS = 63


def initial_state(seed: int) -> list[int]:
    """The state a new stream starts from: ``[seed, 0]``."""
    return [int(seed), 0]


def check_key(key) -> Any:
    """``key`` as an ``int64`` tensor of shape ``(2,)``, or a ``ValueError`` saying what a key is."""
    if key is None:
        raise ValueError(
            "A noisy aggregator's finalize(partial, key) needs a noise key: an int64 tensor "
            "[seed, counter] that is never reused. Call the aggregator itself (agg(result)), "
            "which draws from its own stream, or draw keys with "
            "pergrad.aggregate.NoiseStream(seed).next_key().")
    if isinstance(key, (bool, int, float)) or (hasattr(key, "shape") and len(key.shape) == 0):
        raise ValueError(
            f"A noise key is an int64 tensor [seed, counter], not a step number ({key!r}): "
            "a step count restarts (a new optimizer, a new model) and would repeat the noise. "
            "Draw keys with pergrad.aggregate.NoiseStream(seed).next_key().")
    key = ops.convert_to_tensor(key)
    dtype = keras.backend.standardize_dtype(key.dtype)
    if not dtype.startswith(("int", "uint")) or tuple(key.shape) != KEY_SHAPE:
        raise ValueError(f"A noise key is an integer tensor of shape (2,), got {key!r}.")
    return ops.cast(key, KEY_DTYPE)
