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

import numpy as np
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

#: The largest clipping norm and noise standard deviation ``C * sigma`` accepted: float32's
#: largest finite number, 3.4028235e38. Both become tensors of the variables' dtype (float32 in
#: most models, and under mixed precision, whose variables stay float32): a larger value would
#: fail to convert (TensorFlow) or turn into ``inf`` and an update of infinities (JAX, PyTorch).
LARGEST_CLIP_OR_STDDEV = float(np.finfo(np.float32).max)


def _check_positive(name: str, value) -> float:
    return real(value, name, minimum=0.0, strict=True)


def _check_clip(value) -> float:
    """``l2_norm_clip`` as a float in ``(0, LARGEST_CLIP_OR_STDDEV]``."""
    clip = _check_positive("l2_norm_clip", value)
    if clip > LARGEST_CLIP_OR_STDDEV:
        raise ValueError(f"l2_norm_clip must be at most float32's largest number "
                         f"({LARGEST_CLIP_OR_STDDEV:.8g}), got {value!r}: the clipping is computed "
                         "in the variables' dtype. Use a clipping norm on the scale of the "
                         "gradient norms (printed by pergrad.PerExample(model, loss).norms).")
    return clip


def _check_noise(clip: float, noise_multiplier) -> float:
    """``noise_multiplier`` as a finite float ``>= 0`` whose noise standard deviation
    ``clip * noise_multiplier`` is at most ``LARGEST_CLIP_OR_STDDEV``."""
    sigma = real(noise_multiplier, "noise_multiplier", minimum=0.0)
    if clip * sigma > LARGEST_CLIP_OR_STDDEV:
        raise ValueError(f"l2_norm_clip * noise_multiplier (the noise's standard deviation, "
                         f"{clip:g} * {sigma:g}) must be at most float32's largest number "
                         f"({LARGEST_CLIP_OR_STDDEV:.8g}): the noise is drawn in the variables' "
                         "dtype. Lower the clipping norm or the noise multiplier.")
    return sigma


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
    clip = _check_clip(l2_norm_clip)
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

    Both arguments are checked here, once: ``C`` finite and ``> 0``, ``sigma`` finite and
    ``>= 0``, and ``C`` and ``C sigma`` at most float32's largest number
    (:data:`LARGEST_CLIP_OR_STDDEV`), whatever the model's dtype, since the clipping and the
    noise are computed in the variables' dtype; a ``ValueError`` names the argument otherwise.
    """
    clip = _check_clip(l2_norm_clip)
    sigma = _check_noise(clip, noise_multiplier)
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
