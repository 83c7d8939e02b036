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

import random
import weakref
from typing import Any

from keras import ops

from pergrad.backend import native
from pergrad.backend.host_random import host_generator, host_normal
from pergrad.backend.keys import (
    INVERSE_CDF_BITS,
    KEY_DTYPE,
    KEY_SHAPE,
    RADIUS_BITS,
    check_key,
    initial_state,
)


def fresh_seed() -> int:
    """A 62-bit seed from the operating system's entropy source (never Python's ``random``,
    which ``keras.utils.set_random_seed`` resets)."""
    return random.SystemRandom().getrandbits(62)


def next_key(state, advance: Any = True) -> Any:
    """Read the key ``[seed, counter]`` held by ``state`` and advance its counter by one.

    ``state`` is a ``tf.Variable`` or Keras variable of shape ``(2,)`` and dtype ``int64``. The
    read happens before the increment (automatic control dependencies order them in a
    ``tf.function``; on JAX the read is a value and the increment a new value the train step
    writes back; on PyTorch the read is a host copy), so consecutive calls return ``[s, c]``,
    ``[s, c + 1]``, ...

    ``advance`` (a Python or tensor boolean) advances the counter only where true: a logical
    batch's micro-steps read the key of the release to come and advance it once, at the
    release (:mod:`pergrad.keras.logical_batches`).
    """
    step = ops.cast(ops.convert_to_tensor(advance), KEY_DTYPE)
    return native().next_key(state, step)


def require_64_bit_keys() -> None:
    """A ``ValueError`` where noise keys cannot be held now: on JAX without ``jax_enable_x64``
    (a key's 62-bit seed would be truncated to 32 bits, and two streams could share keys)."""
    native().check_noise_keys()


def gaussian_noise(key, values: list, stddev: float) -> list:
    """``N(0, stddev^2 I)`` shaped like each of ``values``, one independent draw per tensor,
    all derived from the one ``key`` (stateless: the same key gives the same numbers).

    TensorFlow and PyTorch use the Box-Muller transform (TensorFlow from a key per tensor,
    PyTorch from NumPy's Philox stream keyed by the whole key:
    :func:`pergrad.backend.torch.random.gaussian_noise`);
    with ``u`` uniform on ``(0, 1]`` and ``a`` uniform on ``[0, 1)``,
    ``r = sqrt(-2 ln u)`` and ``(r cos 2 pi a, r sin 2 pi a)`` are two independent standard
    normals. ``u`` has :data:`RADIUS_BITS` random bits and its logarithm is taken in float64,
    so a draw reaches 8.65 standard deviations (its tail is cut where
    ``P(|Z| > 8.65) = 5e-18``). JAX inverts the normal CDF at a uniform with 63 random bits
    (:func:`pergrad.backend.jax.random.normal`; cut at 9.16, ``P(|Z| > 9.16) = 5e-20``), the faster route under
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
    return native().gaussian_noise(key, values, stddev)


class NoiseStream:
    """A stream of noise keys held in a variable, created on first use.

    Args:
        seed: the stream's seed; ``None`` draws one from the operating system.

    TensorFlow: ``next_key()`` works eagerly and inside ``tf.function`` (the variable is
    created outside any function graph on first use). Not for ``tf.distribute`` replica
    functions: there the model's own stream (a mirrored variable) is used. PyTorch: a
    host-side counter (everything runs eagerly). JAX: the state is a host-side counter; call
    ``next_key()`` outside ``jax.jit`` and pass the key into the
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
            self._state = native().new_key_state(self.seed)
        return self._state

    def next_key(self) -> Any:
        """The next key ``[seed, counter]``; the counter advances. On JAX the key is a host
        array, never converted here: drawn while tracing it would stay a constant of the trace,
        which :func:`gaussian_noise` refuses (it would repeat at every call)."""
        return native().take_key(self.state)


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


__all__ = ["INVERSE_CDF_BITS", "KEY_DTYPE", "KEY_SHAPE", "RADIUS_BITS", "NoiseSource",
           "NoiseStream", "check_key", "fresh_seed", "gaussian_noise", "host_generator",
           "host_normal", "initial_state", "next_key", "require_64_bit_keys"]
