"""Aggregators that are weighted sums of per-example gradients: they need only the norms.

Each is ``update = (1 / D) * (sum_i c_i g_i + noise)``, with ``c_i`` a function of the
per-example norms ``||g_i||`` and ``D`` the number of rows ``B`` of the (global) batch. ``sum_i
c_i g_i`` comes from ``PerExampleResult.weighted_sum``: no ``(B, *var.shape)`` tensor is built for
layers with rules. Dropped (non-finite) examples have ``c_i = 0``.

The sample weights ``w_i`` are inside ``g_i`` already (``g_i`` is the gradient of ``w_i l_i``),
and ``D = B`` counts every row, so ``mean()`` is exactly Keras's ``sum_over_batch_size`` loss.
"""

from __future__ import annotations

import math

from keras import ops

from pergrad.aggregate.base import (
    Aggregator,
    Partial,
    linear_local,
    register,
    require_rows,
)
from pergrad.aggregate.noise import NoiseSource, gaussian_noise
from pergrad.backend.ops import add_n, dtype_of
from pergrad.engine import clip_factors
from pergrad.engine.arguments import integer, real


def _check_positive(name: str, value) -> float:
    return real(value, name, minimum=0.0, strict=True)


def _divide(partial: Partial, divisor=None, name: str = "mean") -> list:
    """``values / D``; ``D`` defaults to the number of rows, which must not be 0."""
    values = partial.values
    d = require_rows(partial.rows, name) if divisor is None else divisor
    return [v / ops.cast(d, dtype_of(v)) for v in values]


def _clip_coefficients(l2_norm_clip: float, per_layer: bool):
    def coefficients(squared, batch):
        if per_layer:
            clip = l2_norm_clip / math.sqrt(len(squared))
            return [_clip(s, clip) for s in squared]
        return _clip(add_n(squared), l2_norm_clip)
    return coefficients


def _clip(squared, clip: float):
    """``min(1, C / ||g_i||)`` (1 for a zero gradient)."""
    return clip_factors(ops.sqrt(squared), clip)


@register
def mean() -> Aggregator:
    """``(1/B) sum_i g_i``: the ordinary batch gradient (Keras's ``sum_over_batch_size``)."""
    return Aggregator("mean", {}, linear_local(lambda s, b: 1.0, needs_norms=False),
                      lambda p, key: _divide(p, name="mean"))


@register
def sum() -> Aggregator:  # noqa: A001 - the name users expect, as in ``optax``/``keras.ops``
    """``sum_i g_i``."""
    return Aggregator("sum", {}, linear_local(lambda s, b: 1.0, needs_norms=False),
                      lambda p, key: list(p.values))


@register
def clip_mean(l2_norm_clip: float, per_layer: bool = False) -> Aggregator:
    """``(1/B) sum_i min(1, C / ||g_i||) g_i`` with ``C = l2_norm_clip``.

    With ``per_layer=True`` each variable ``k`` (of ``K``) is clipped on its own to
    ``C_k = C / sqrt(K)``: ``(1/B) sum_i min(1, C_k / ||g_i[k]||) g_i[k]``, so that the whole
    clipped gradient still has norm at most ``C``.
    """
    clip = _check_positive("l2_norm_clip", l2_norm_clip)
    return Aggregator("clip_mean", {"l2_norm_clip": clip, "per_layer": bool(per_layer)},
                      linear_local(_clip_coefficients(clip, bool(per_layer)), needs_norms=True),
                      lambda p, key: _divide(p, name="clip_mean"), clips=True)


@register
def dp_mean(l2_norm_clip: float, noise_multiplier: float, seed: int | None = None,
            expected_batch_size: int | None = None) -> Aggregator:
    """DP-SGD (Abadi et al. 2016): ``(1/D) (sum_i min(1, C/||g_i||) g_i + N(0, (C sigma)^2 I))``.

    ``C = l2_norm_clip``, ``sigma = noise_multiplier``. The divisor ``D`` is
    ``expected_batch_size`` when given (the convention of TF Privacy and Opacus for Poisson
    sampling, where the real batch size is random and must not leak: pass the ``batch_size``
    you gave :func:`pergrad.privacy.poisson_batches`), else the number of rows ``B`` of the
    global batch (fixed-size batches, as TF Privacy's DP optimizers). Padding rows (weight 0)
    have ``g_i = 0`` and add nothing.

    The noise is one draw per global step, from a stateless generator keyed by a noise key
    ``[seed, counter]`` that is never reused (:mod:`pergrad.aggregate.noise`): ``PerExampleModel``
    draws it from its own saved stream, a direct call ``agg(result)`` from the aggregator's
    stream, and ``finalize(partial, key)`` takes it explicitly. With ``seed=None`` every stream
    gets its own seed from the operating system; an explicit ``seed`` reproduces the same noise
    for the same sequence of steps, so it may feed only one model. Under ``tf.distribute`` every
    replica draws the same numbers, so the noise is added once.
    """
    clip = _check_positive("l2_norm_clip", l2_norm_clip)
    sigma = real(noise_multiplier, "noise_multiplier", minimum=0.0)
    if expected_batch_size is not None:
        expected_batch_size = integer(expected_batch_size, "expected_batch_size")
    if seed is not None:
        seed = integer(seed, "seed", minimum=0)
    stddev = clip * sigma

    def finalize(partial: Partial, key) -> list:
        values = list(partial.values)
        if stddev > 0:
            noises = gaussian_noise(key, values, stddev)
            values = [v + n for v, n in zip(values, noises, strict=True)]
        return _divide(partial._replace(values=values), expected_batch_size, name="dp_mean")

    config = {"l2_norm_clip": clip, "noise_multiplier": sigma, "seed": seed,
              "expected_batch_size": expected_batch_size}
    return Aggregator("dp_mean", config,
                      linear_local(_clip_coefficients(clip, False), needs_norms=True), finalize,
                      clips=True, noise=NoiseSource(seed))


@register
def normalized_mean(gamma: float = 0.01) -> Aggregator:
    """Automatic clipping (Bu et al. 2023): ``(1/B) sum_i g_i / (||g_i|| + gamma)``."""
    gamma = _check_positive("gamma", gamma)

    def coefficients(squared, batch):
        return 1.0 / (ops.sqrt(add_n(squared)) + gamma)

    return Aggregator("normalized_mean", {"gamma": gamma},
                      linear_local(coefficients, needs_norms=True),
                      lambda p, key: _divide(p, name="normalized_mean"), clips=True)
