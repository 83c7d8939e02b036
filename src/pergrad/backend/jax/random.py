"""JAX's noise keys and Gaussian draws (the contract: :mod:`pergrad.aggregate.noise`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtri
from keras import ops

from pergrad._compat import is_keras_variable
from pergrad.backend.keys import INVERSE_CDF_BITS, check_key, initial_state


def check_noise_keys() -> None:
    """Noise keys hold a 62-bit seed and a 64-bit counter; JAX has 64-bit integers only with
    ``jax_enable_x64`` (without it they would be truncated to 32 bits, and two streams could
    share keys)."""
    if not jax.config.jax_enable_x64:
        raise ValueError(
            "DP noise on the JAX backend needs 64-bit integer keys: call "
            "jax.config.update('jax_enable_x64', True) at the start of the program, before any "
            "array or model is made (without it a key's 62-bit seed would be truncated).")


def enable_noise_keys() -> None:
    """Turn on ``jax_enable_x64`` (64-bit integer keys), before any array is made."""
    jax.config.update("jax_enable_x64", True)


def new_key_state(seed: int) -> Any:
    """A host array ``[seed, 0]``."""
    return np.array(initial_state(seed), np.int64)


def take_key(state: Any) -> Any:
    """A host copy of ``state``, never converted here: drawn while tracing it stays a constant
    of the trace, which :func:`gaussian_noise` refuses (it would repeat at every call)."""
    check_noise_keys()
    key = state.copy()
    state[1] += 1
    return key


def next_key(state: Any, step: Any) -> Any:
    """The key is a value and the increment a new value the train step writes back."""
    check_noise_keys()
    key = ops.convert_to_tensor(state.value if is_keras_variable(state) else state)
    state.assign(key + ops.stack([ops.zeros_like(step), step]))
    return key


def gaussian_noise(key: Any, values: list, stddev: float) -> list:
    """A threefry key folded from the 62-bit seed and the 64-bit counter, split per computation
    dtype (float32, float64); one draw for all tensors of a dtype, cut into them (one kernel for
    XLA to compile, not one per tensor shape). Inside a trace the key must be traced too: a key
    that is a constant of the trace would be the same at every call of the compiled function,
    i.e. the same noise at every step."""
    check_noise_keys()
    traced = any(isinstance(v, jax.core.Tracer) for v in values)
    # Test the key as given, before converting it: inside a trace a conversion is a tracer too.
    if traced and not isinstance(key, jax.core.Tracer):
        raise ValueError(
            "The noise key is a constant of this compiled function: every call would draw the "
            "same noise. Pass the key as an argument of the jitted function (draw it outside, "
            "from pergrad.aggregate.NoiseStream(seed).next_key(), once per step), or train with "
            "PerExampleModel, whose train step draws it from the model's saved stream.")
    key = check_key(key)
    seed, counter = key[0], key[1]
    words = [(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF, (counter >> 32) & 0xFFFFFFFF,
             counter & 0xFFFFFFFF]
    words = [jnp.asarray(w).astype(jnp.uint32) for w in words]
    base = jax.random.wrap_key_data(jnp.stack(words[:2]), impl="threefry2x32")
    base = jax.random.fold_in(jax.random.fold_in(base, words[2]), words[3])
    # One draw per computation dtype, cut into the values: XLA's CPU compiles every threefry
    # draw of a new shape into its own large kernel, and a draw per variable made a large part
    # of the benchmark CNN's DP-step compilation (docs/benchmarks.md, "DP noise, dispatch and
    # compilation"). Outside a trace the flat draw and its slices hold the noise twice.
    wides = [jnp.float64 if jnp.dtype(v.dtype) == jnp.float64 else jnp.float32 for v in values]
    groups = list(dict.fromkeys(wides))
    keys = jax.random.split(base, len(groups))
    out: list = [None] * len(values)
    for key_g, wide in zip(keys, groups, strict=True):
        members = [k for k, w in enumerate(wides) if w == wide]
        sizes = [math.prod(values[k].shape) for k in members]
        flat = normal(key_g, (sum(sizes),), wide)
        start = 0
        for k, size in zip(members, sizes, strict=True):
            piece = flat[start:start + size].reshape(values[k].shape)
            out[k] = stddev * piece.astype(values[k].dtype)
            start += size
    return out


def normal(key, shape: tuple, dtype) -> Any:
    """Standard normals by the inverse normal CDF of a fine uniform, one 64-bit word per value
    (``jax_enable_x64`` is on for DP noise).

    The word's top 63 bits ``k`` give ``v = (k + 1/2) 2^-64``, uniform on ``(0, 1/2)`` with
    steps of ``2^-64`` all the way down to its smallest value, and ``|Z| = -ndtri(v)``; the
    word's last bit is the sign. ``v`` is cast to float32 before ``ndtri`` (float64 for
    float64 values): float32 holds ``2^-65`` exactly, so the far tail keeps its resolution
    while the body is computed at float32 speed (float32 ``ndtri`` is within 4e-7 relative
    of float64's on ``(2^-65, 1/2)``). The largest draw is ``-ndtri(2^-65) = 9.16``
    (:data:`INVERSE_CDF_BITS`). On XLA's CPU it is faster than ``jax.random.normal`` (cut at
    5.22) and than the Box-Muller transform TensorFlow uses (XLA's CPU cosine is slow):
    docs/benchmarks.md, "DP noise, dispatch and compilation"."""
    words = jax.random.bits(key, tuple(shape), jnp.uint64)
    v = ((words >> 1).astype(jnp.float64) + 0.5) * 2.0 ** -(INVERSE_CDF_BITS + 1)
    wide = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    lower = ndtri(v.astype(wide))  # <= 0
    return jnp.where((words & 1) == 1, -lower, lower).astype(dtype)
