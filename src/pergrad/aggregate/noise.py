"""Noise keys that never repeat: a ``[seed, counter]`` state that advances with every draw.

DP-SGD's guarantee needs *fresh* Gaussian noise at every release: two updates noised with the
same numbers can be subtracted and the noise cancels (epsilon becomes infinite). pergrad
therefore never derives a noise key from something that can restart (an optimizer's
``iterations``, a default ``step=0``). Every noisy draw takes a **key**, an ``int64`` tensor
``[seed, counter]``, from a **stream**: a variable holding the next key, whose counter is
incremented by the same draw that reads it (as ``keras.random.SeedGenerator`` does).

* ``PerExampleModel`` owns one stream (a non-trainable weight ``noise_state``, saved in the
  ``.keras`` file, so a restored model *resumes* the stream instead of restarting it).
* A noisy aggregator called directly (``agg(result)``) draws from its own stream, which also
  advances on every call, eagerly or inside a ``tf.function``.
* A pure function (``Aggregator.finalize(partial, key)``) takes the key explicitly.

``seed=None`` draws a new seed from the operating system for every stream, so two models (or a
model and a direct call) never share noise. An explicit ``seed`` makes a run reproducible: the
same seed and the same sequence of steps give the same noise, so one seeded aggregator may feed
only one stream (:meth:`NoiseSource.claim` refuses a second).
"""

from __future__ import annotations

import math
import random
import weakref
from typing import Any

import keras
import numpy as np
from keras import ops

from pergrad import backend

#: Shape and dtype of a noise key and of a stream's state.
KEY_SHAPE = (2,)
KEY_DTYPE = "int64"


def fresh_seed() -> int:
    """A 62-bit seed from the operating system's entropy source (never Python's ``random``,
    which ``keras.utils.set_random_seed`` resets)."""
    return random.SystemRandom().getrandbits(62)


def initial_state(seed: int) -> list[int]:
    """The state a new stream starts from: ``[seed, 0]``."""
    return [int(seed), 0]


def next_key(state, advance: Any = True) -> Any:
    """Read the key ``[seed, counter]`` held by ``state`` and advance its counter by one.

    ``state`` is a ``tf.Variable`` or Keras variable of shape ``(2,)`` and dtype ``int64``. The
    read happens before the increment (automatic control dependencies order them in a
    ``tf.function``; on JAX the read is a value and the increment a new value the train step
    writes back; on PyTorch the read is a host copy), so consecutive calls return ``[s, c]``, ``[s, c + 1]``, ...

    ``advance`` (a Python or tensor boolean) advances the counter only where true: a logical
    batch's micro-steps read the key of the release to come and advance it once, at the
    release (:mod:`pergrad.keras.logical_batches`).
    """
    step = ops.cast(ops.convert_to_tensor(advance), KEY_DTYPE)
    if backend.is_jax():
        require_64_bit_keys()
        key = ops.convert_to_tensor(state.value if isinstance(state, keras.Variable) else state)
        state.assign(key + ops.stack([ops.zeros_like(step), step]))
        return key
    if backend.is_torch():
        # A host copy first: a torch variable is assigned in place, under any view of it.
        key = np.array(ops.convert_to_numpy(state.value if isinstance(state, keras.Variable)
                                            else state), np.int64)
        state.assign(key + np.array([0, int(ops.convert_to_numpy(step))], np.int64))
        return ops.convert_to_tensor(key)
    import tensorflow as tf
    key = tf.identity(tf.convert_to_tensor(state))
    with tf.control_dependencies([key]):
        state.assign_add(tf.stack([tf.zeros_like(step), step]))
    return key


def split(key, num: int) -> Any:
    """``num`` independent keys derived from ``key`` (``tf.random.experimental.stateless_split``),
    one per variable of an update (TensorFlow)."""
    import tensorflow as tf
    return tf.random.experimental.stateless_split(check_key(key), num=num)


def require_64_bit_keys() -> None:
    """Noise keys hold a 62-bit seed and a 64-bit counter; JAX has 64-bit integers only with
    ``jax_enable_x64`` (without it they would be truncated to 32 bits, and two streams could
    share keys)."""
    import jax
    if not jax.config.jax_enable_x64:
        raise ValueError(
            "DP noise on the JAX backend needs 64-bit integer keys: call "
            "jax.config.update('jax_enable_x64', True) at the start of the program, before any "
            "array or model is made (without it a key's 62-bit seed would be truncated).")


#: Bits of the uniform behind each Box-Muller radius: ``u = (k + 1/2) 2^-53`` for a 53-bit
#: integer ``k``, so ``r = sqrt(-2 ln u) <= sqrt(2 * 54 ln 2) = 8.65`` standard deviations.
RADIUS_BITS = 53

#: Bits of the uniform under JAX's inverse-CDF draw: ``v = (k + 1/2) 2^-64`` for a 63-bit
#: integer ``k`` (the word's 64th bit is the sign), so ``|Z| = -ndtri(v) <= -ndtri(2^-65) = 9.16``.
INVERSE_CDF_BITS = 63


def gaussian_noise(key, values: list, stddev: float) -> list:
    """``N(0, stddev^2 I)`` shaped like each of ``values``, one independent draw per tensor,
    all derived from the one ``key`` (stateless: the same key gives the same numbers).

    TensorFlow and PyTorch use the Box-Muller transform (TensorFlow from a key per tensor,
    PyTorch from NumPy's Philox stream keyed by the whole key: :func:`_torch_gaussian_noise`);
    with ``u`` uniform on ``(0, 1]`` and ``a`` uniform on ``[0, 1)``,
    ``r = sqrt(-2 ln u)`` and ``(r cos 2 pi a, r sin 2 pi a)`` are two independent standard
    normals. ``u`` has :data:`RADIUS_BITS` random bits and its logarithm is taken in float64,
    so a draw reaches 8.65 standard deviations (its tail is cut where
    ``P(|Z| > 8.65) = 5e-18``). JAX inverts the normal CDF at a uniform with 63 random bits
    (:func:`_jax_normal`; cut at 9.16, ``P(|Z| > 9.16) = 5e-20``), the faster route under
    XLA. The samplers of the frameworks stop much earlier: TensorFlow's ``stateless_normal`` clamps
    its uniform at ``1e-7`` (no draw beyond 5.68, in float32 and float64 alike), JAX's
    float32 ``normal`` inverts a 23-bit uniform (+5.22, -5.42). Beyond that cut the Gaussian
    mechanism's privacy loss is unbounded: with clipping norm ``C`` and noise ``sigma C``, an
    example that moves one coordinate by ``C`` is revealed with probability
    ``P(Z > cut - 1/sigma)`` per release (at ``sigma = 1.1``: ``9e-7`` for
    ``stateless_normal``'s cut, ``5e-15`` for the Box-Muller draw, ``8e-17`` for JAX's
    inverse-CDF draw), which the accountant does not count in ``delta``.

    TensorFlow: ``stateless_uniform`` keys from ``stateless_split``. JAX: a threefry key
    folded from the 62-bit seed and the 64-bit counter, split per computation dtype (float32,
    float64); one draw for all tensors of a dtype, cut into them (one kernel for XLA to
    compile, not one per tensor shape). Inside a JAX trace the key must be traced too: a key
    that is a constant of the trace would be the same at every call of the compiled function,
    i.e. the same noise at every step."""
    if backend.is_jax():
        return _jax_gaussian_noise(key, values, stddev)
    if backend.is_torch():
        return _torch_gaussian_noise(key, values, stddev)
    import tensorflow as tf

    keys = split(key, len(values))
    return [stddev * _tensorflow_normal(v.shape if v.shape.is_fully_defined() else tf.shape(v),
                                        keys[k], keras.backend.standardize_dtype(v.dtype))
            for k, v in enumerate(values)]


def _tensorflow_normal(shape, key, dtype: str) -> Any:
    """Standard normals of ``shape`` from ``key`` by :func:`gaussian_noise`'s Box-Muller
    transform (faster than ``stateless_normal`` on the project's CPU: docs/benchmarks.md, "DP
    noise, dispatch and compilation"). Angles and products in float32 (float64 for float64 values); half
    precision is cast from float32."""
    import tensorflow as tf

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


def _jax_gaussian_noise(key, values: list, stddev: float) -> list:
    import jax
    import jax.numpy as jnp

    require_64_bit_keys()
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
        flat = _jax_normal(key_g, (sum(sizes),), wide)
        start = 0
        for k, size in zip(members, sizes, strict=True):
            piece = flat[start:start + size].reshape(values[k].shape)
            out[k] = stddev * piece.astype(values[k].dtype)
            start += size
    return out


def _jax_normal(key, shape: tuple, dtype) -> Any:
    """JAX's draw of :func:`gaussian_noise`: the inverse normal CDF of a fine uniform, one
    64-bit word per value (``jax_enable_x64`` is on for DP noise).

    The word's top 63 bits ``k`` give ``v = (k + 1/2) 2^-64``, uniform on ``(0, 1/2)`` with
    steps of ``2^-64`` all the way down to its smallest value, and ``|Z| = -ndtri(v)``; the
    word's last bit is the sign. ``v`` is cast to float32 before ``ndtri`` (float64 for
    float64 values): float32 holds ``2^-65`` exactly, so the far tail keeps its resolution
    while the body is computed at float32 speed (float32 ``ndtri`` is within 4e-7 relative
    of float64's on ``(2^-65, 1/2)``). The largest draw is ``-ndtri(2^-65) = 9.16``
    (:data:`INVERSE_CDF_BITS`). On XLA's CPU it is faster than ``jax.random.normal`` (cut at
    5.22) and than the Box-Muller transform TensorFlow uses (XLA's CPU cosine is slow):
    docs/benchmarks.md, "DP noise, dispatch and compilation"."""
    import jax
    import jax.numpy as jnp
    from jax.scipy.special import ndtri

    words = jax.random.bits(key, tuple(shape), jnp.uint64)
    v = ((words >> 1).astype(jnp.float64) + 0.5) * 2.0 ** -(INVERSE_CDF_BITS + 1)
    wide = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    lower = ndtri(v.astype(wide))  # <= 0
    return jnp.where((words & 1) == 1, -lower, lower).astype(dtype)


def _torch_gaussian_noise(key, values: list, stddev: float) -> list:
    """PyTorch: :func:`gaussian_noise`'s Box-Muller draw made on the host by NumPy's Philox
    generator keyed by the whole 128-bit ``[seed, counter]`` (:func:`host_generator`), the values
    drawn one after another from that stream and copied to each value's device; no TensorFlow.

    Not ``torch.Generator``: its CPU generator (MT19937) keeps only the low 32 bits of a seed
    (``manual_seed(5)``, ``manual_seed(5 + 2**32)`` and ``manual_seed(5 + 2**40)`` draw the same
    numbers in torch 2.13), so any folding of a 62-bit seed and a 64-bit counter into its seed
    would repeat noise across steps or streams. Philox4x64 takes the key as it is: two keys
    never share a stream, the same key gives the same numbers."""
    import torch

    generator = host_generator(np.asarray(check_key(key).detach().cpu()))
    out = []
    for v in values:
        dtype = keras.backend.standardize_dtype(v.dtype)
        # NumPy has no bfloat16 torch can read: half precision is drawn in float32 and cast.
        wide = "float64" if dtype == "float64" else "float32"
        draw = host_normal(generator, tuple(int(n) for n in v.shape), wide, stddev)
        out.append(torch.from_numpy(draw).to(device=v.device, dtype=v.dtype))
    return out


def host_generator(key: np.ndarray) -> np.random.Generator:
    """NumPy's counter-based Philox4x64 generator keyed by ``key = [seed, counter]`` (128 bits,
    each ``int64`` word taken as its unsigned bit pattern), at the start of its stream."""
    words = np.asarray(key, np.int64).view(np.uint64)
    return np.random.Generator(np.random.Philox(key=words))


def host_normal(generator: np.random.Generator, shape: tuple, dtype: str,
                stddev: float = 1.0) -> np.ndarray:
    """``stddev`` times standard normals of ``shape`` in ``dtype`` (float32 or float64) by
    :func:`gaussian_noise`'s Box-Muller transform on NumPy: radius words with
    :data:`RADIUS_BITS` random bits (their logarithm in float64, so the tail reaches 8.65
    standard deviations), angles uniform on ``[0, 1)``; cosine halves first, then sine halves."""
    count = int(np.prod(shape, dtype=np.int64))
    pairs = (count + 1) // 2
    words, angles = _radius_words_and_angles(generator, pairs, dtype)
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


def _radius_words_and_angles(generator: np.random.Generator, pairs: int,
                             dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``pairs`` raw 64-bit words and ``pairs`` uniforms on ``[0, 1)`` in ``dtype``, in this
    order from ``generator``."""
    return (generator.bit_generator.random_raw(pairs),
            generator.random(pairs, dtype=np.dtype(dtype)))


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


class NoiseStream:
    """A stream of noise keys held in a variable, created on first use.

    Args:
        seed: the stream's seed; ``None`` draws one from the operating system.

    TensorFlow: ``next_key()`` works eagerly and inside ``tf.function`` (the variable is
    created outside any function graph on first use). Not for ``tf.distribute`` replica
    functions: there the model's own stream (a mirrored variable) is used. PyTorch: a
    host-side counter (everything runs eagerly). JAX: the state is a host-side counter; call ``next_key()`` outside ``jax.jit`` and pass the key into the
    compiled step as an argument (a key drawn while tracing would be a constant of the trace,
    which :func:`gaussian_noise` refuses).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = fresh_seed() if seed is None else int(seed)
        self._state: Any = None

    @property
    def state(self) -> Any:
        """The ``[seed, counter]`` state: a ``tf.Variable`` on TensorFlow, a NumPy array on
        JAX and PyTorch (created on first access)."""
        if self._state is None:
            if backend.is_jax() or backend.is_torch():
                self._state = np.array(initial_state(self.seed), np.int64)
            else:
                import tensorflow as tf
                with tf.init_scope():
                    self._state = tf.Variable(initial_state(self.seed), dtype=KEY_DTYPE,
                                              trainable=False, name="noise_state")
        return self._state

    def next_key(self) -> Any:
        """The next key ``[seed, counter]``; the counter advances."""
        if backend.is_jax():
            # A host array, never converted here: drawn while tracing it stays a constant of
            # the trace, which gaussian_noise refuses (it would repeat at every call).
            require_64_bit_keys()
            state = self.state
            key = state.copy()
            state[1] += 1
            return key
        if backend.is_torch():
            state = self.state
            key = state.copy()
            state[1] += 1
            return key
        return next_key(self.state)


class NoiseSource:
    """The noise of one noisy aggregator: which streams draw from it, so that a seed feeds one.

    With ``seed=None`` every owner (a model, or the aggregator's direct calls) gets its own fresh
    seed and any number may claim one. With an explicit seed a second, different owner would
    start a second stream at the same key ``[seed, 0]``, i.e. repeat the first one's noise:
    :meth:`claim` refuses it.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._owner: weakref.ref | None = None  # the one owner of a seeded stream
        self._owner_name = ""
        self._direct: NoiseStream | None = None

    def claim(self, owner, aggregator_name: str) -> int:
        """Register ``owner`` and return the seed its stream starts from.

        A seeded source stays claimed even after its owner is garbage-collected: that owner's
        results may have been released, and a new stream would repeat their noise.
        """
        if self.seed is None:
            return fresh_seed()
        if self._owner is not None and self._owner() is not owner:
            raise ValueError(
                f"This {aggregator_name}(seed={self.seed}) aggregator already drew the noise of "
                f"{self._owner_name}; a second stream from the same seed would repeat that "
                "noise exactly, and anyone who sees both results could subtract it. Build one "
                "aggregator per model (seed=None gives each its own fresh seed; the same explicit "
                "seed reproduces the same noise on purpose).")
        self._owner, self._owner_name = weakref.ref(owner), _describe(owner)
        return self.seed

    def direct_stream(self, aggregator_name: str) -> NoiseStream:
        """The stream that direct calls ``agg(result)`` draw from (claimed on first use)."""
        if self._direct is None:
            self._direct = NoiseStream(self.claim(self, aggregator_name))
        return self._direct


def _describe(owner) -> str:
    if isinstance(owner, NoiseSource):
        return "its own direct calls (agg(result))"
    name = getattr(owner, "name", None)
    return f"{type(owner).__name__} {name!r}" if name else type(owner).__name__
