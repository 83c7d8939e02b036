"""Poisson-sampled, padded batches: the sampling DP-SGD's accounting assumes.

Privacy amplification by sampling, which every DP-SGD accountant relies on, is proved for
*Poisson* sampling: at each step every example joins the batch independently with probability
``q``. The batch size is then random, ``Binomial(N, q)``. :func:`poisson_batches` samples exactly
that and pads each batch with zero-weight rows to one fixed size so that shapes stay static and a
compiled train step is traced once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import stats

from pergrad.backend.lazy import tensorflow as tf
from pergrad.privacy.accounting import _as_epochs, _as_int, dp_sgd_steps

# Probability that *any* batch of one pass over the returned dataset overflows the default
# padded size. Spread over the steps with a union bound: per step it is this / steps.
_DEFAULT_OVERFLOW_PROBABILITY = 1e-6


def default_max_batch_size(num_examples: int, sampling_probability: float, steps: int = 1) -> int:
    """Padded batch size that ``steps`` Poisson batches overflow with probability below 1e-6.

    The number of examples in one Poisson batch is ``K ~ Binomial(N, q)``. This returns the
    smallest ``m`` with ``P(K > m) <= 1e-6 / steps`` (``scipy.stats.binom.isf``), so by a union
    bound the chance that any of ``steps`` batches exceeds ``m`` is below ``1e-6``. For ``N =
    60000``, ``q = 0.0025`` (expected batch 150, standard deviation 12.2) and 400 steps this is
    227.
    """
    per_step = _DEFAULT_OVERFLOW_PROBABILITY / max(int(steps), 1)
    m = int(stats.binom.isf(per_step, int(num_examples), float(sampling_probability)))
    return max(1, min(m, int(num_examples)))


def _as_tensor(array: Any, name: str) -> tf.Tensor:
    try:
        return tf.convert_to_tensor(np.asarray(array) if not tf.is_tensor(array) else array)
    except (ValueError, TypeError) as err:
        raise TypeError(
            f"poisson_batches: could not convert {name} to a tensor ({err}). Pass numpy arrays, "
            "tensors, or dicts/tuples/lists of them with the examples along the first axis."
        ) from err


def _leading_dim(t: tf.Tensor, name: str) -> int:
    if t.shape.rank is None or t.shape.rank == 0:
        raise ValueError(
            f"poisson_batches: {name} has shape {t.shape}; every array needs a leading "
            "examples axis."
        )
    return int(t.shape[0])


def poisson_batches(
    x: Any,
    y: Any = None,
    *,
    batch_size: int,
    num_examples: int | None = None,
    sample_weight: Any = None,
    seed: int | None = None,
    epochs: float = 1,
    max_batch_size: int | None = None,
    with_indices: bool = False,
    micro_batches: int = 1,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of Poisson-sampled batches, padded to a static size.

    At every step each of the ``N`` examples is included independently with probability ``q =
    batch_size / N``, so the number of real examples in a batch is ``Binomial(N, q)`` with mean
    ``batch_size``. This is the sampling under which :func:`pergrad.privacy.epsilon` (and every
    DP-SGD accountant) proves amplification by sampling. One pass over the dataset yields exactly

        steps = dp_sgd_steps(N, batch_size, epochs)
              = floor(epochs) * ceil(N / batch_size) + ceil(frac(epochs) * N / batch_size)

    batches (``ceil(N / batch_size)`` per whole epoch), the step count
    :func:`pergrad.privacy.epsilon` charges for. So ``fit(poisson_batches(..., epochs=E))`` and
    ``fit(poisson_batches(...), epochs=E)`` (whole ``E``) both run the steps ``epsilon(N, B,
    sigma, E, delta)`` accounts for, and :class:`pergrad.keras.PrivacyCallback` agrees with it.

    Every batch is padded to ``max_batch_size`` rows so shapes never change and a compiled train
    step is traced once. Padding rows are all-zero inputs and targets with ``sample_weight`` 0,
    placed after the real rows; with a weighted loss they contribute nothing to the gradient.
    Whatever consumes the batch must therefore apply the weights *before* anything that treats
    rows alike: a padding row's unweighted per-example gradient is not zero, and clipping and
    summing it would add a gradient that belongs to no example. Note that Keras's default
    ``"sum_over_batch_size"`` loss reduction divides by the padded size, not by the number of
    real examples; DP-SGD divides the noisy sum by the *expected* batch size ``batch_size``
    anyway (dividing by the realised size is not what the standard analysis covers).

    Overflow: if a batch samples more than ``max_batch_size`` examples, iteration raises
    ``tf.errors.InvalidArgumentError``; truncating would change the sampling and void the
    guarantee. The default ``max_batch_size`` makes this a less-than-1e-6 event per pass over the
    dataset (see :func:`default_max_batch_size`: for ``N = 60000``, ``batch_size = 150`` and one
    epoch it is 227).

    Iterating the dataset again (as ``Model.fit`` does every epoch) draws fresh, independent
    batches; with a ``seed`` the whole sequence of passes is reproducible.

    Why ``tf.data`` rather than ``keras.utils.PyDataset``: sampling, gathering and padding run as
    TensorFlow ops in the input pipeline (no Python per batch, no GIL contention with training),
    the element shapes are static by construction, and a dataset feeds both ``Model.fit`` and a
    custom loop.

    Fixed-size shuffled batches (plain ``fit(x, y, batch_size=B, shuffle=True)``) are the common
    shortcut. Each example then appears exactly once per epoch, which is *not* Poisson sampling:
    the accountant's amplification-by-sampling assumption does not hold, and the epsilon it reports
    is a heuristic (as in TensorFlow Privacy's tutorials), not a proof. Use this function when the
    guarantee must hold as stated.

    Args:
      x: inputs: an array or tensor, or a dict/tuple/list of them, examples on axis 0.
      y: targets, same form as ``x``, or ``None``.
      batch_size: expected batch size ``B``, ``1 <= B <= N``.
      num_examples: ``N``. Inferred from ``x``; if given, it must equal the number of rows, so
        that the ``N`` passed to the accountant is the one sampled from.
      sample_weight: optional per-example weights, shape ``(N,)``; real rows carry these weights,
        padding rows 0. Default: 1 for real rows.
      seed: integer seed; ``None`` for nondeterministic sampling.
      epochs: passes per iteration of the dataset (may be fractional; a fractional last pass is
        ``ceil(frac(epochs) * N / batch_size)`` steps). Keep ``1`` with ``fit(epochs=E)``, which
        re-iterates the dataset each epoch.
      max_batch_size: static padded batch size; default :func:`default_max_batch_size`.
      micro_batches: ``k``, for logical batches larger than memory holds: every Poisson batch
        (a *logical* batch) is yielded as ``k`` consecutive micro-batches of
        ``max_batch_size / k`` rows (real rows first, then padding), to train with an optimizer
        whose ``gradient_accumulation_steps`` is ``k`` and ``dp_mean(expected_batch_size=
        batch_size)``: ``PerExampleModel`` sums the ``k`` micro-batches' clipped gradients and
        draws the noise once per logical batch (:mod:`pergrad.keras.logical_batches`), and the
        accountant counts the ``steps`` logical batches. The default ``max_batch_size`` is
        rounded up to a multiple of ``k``; a given one must be a multiple of ``k``.
      with_indices: also yield an ``int64`` tensor of shape ``(max_batch_size,)`` holding each
        row's example index into ``x`` (``-1`` for padding), for per-example statistics. Elements
        then have four components, which ``Model.fit`` does not accept; drop it with
        ``ds.map(lambda x, y, w, i: (x, y, w))``.

    Returns:
      A dataset of ``(x_batch, y_batch, sample_weight_batch)`` (plus ``indices`` with
      ``with_indices=True``), each with leading dimension ``max_batch_size``; ``y_batch`` is
      ``None`` when ``y`` is. Its cardinality is ``steps`` (``k steps`` micro-batches of
      ``max_batch_size / k`` rows with ``micro_batches=k``).
    """
    batch_size = _as_int(batch_size, "poisson_batches: batch_size", 1)
    _as_epochs(epochs, "poisson_batches: epochs")
    if num_examples is not None:
        num_examples = _as_int(num_examples, "poisson_batches: num_examples", 1)
    if x is None:
        raise ValueError("poisson_batches: x must not be None.")

    xs = tf.nest.map_structure(lambda a: _as_tensor(a, "x"), x)
    ys = None if y is None else tf.nest.map_structure(lambda a: _as_tensor(a, "y"), y)
    sizes = {_leading_dim(t, "x") for t in tf.nest.flatten(xs)}
    if ys is not None:
        sizes |= {_leading_dim(t, "y") for t in tf.nest.flatten(ys)}
    if len(sizes) != 1:
        raise ValueError(
            f"poisson_batches: x and y must all have the same number of examples on axis 0; got "
            f"sizes {sorted(sizes)}."
        )
    (n,) = sizes
    if num_examples is not None and num_examples != n:
        raise ValueError(
            f"poisson_batches: num_examples={num_examples} but x has {n} examples. The sampling "
            "rate is batch_size / (number of rows of x); pass all examples, or omit num_examples."
        )
    if n == 0:
        raise ValueError("poisson_batches: x has no examples.")
    if batch_size > n:
        raise ValueError(
            f"poisson_batches: batch_size ({batch_size}) exceeds the number of examples ({n})."
        )

    if sample_weight is None:
        weights = tf.ones([n], tf.float32)
    else:
        weights = _as_tensor(sample_weight, "sample_weight")
        if not weights.dtype.is_floating:
            weights = tf.cast(weights, tf.float32)
        if weights.shape != (n,):
            raise ValueError(
                f"poisson_batches: sample_weight must have shape ({n},); got {weights.shape}."
            )

    q = batch_size / n
    steps_per_epoch = math.ceil(n / batch_size)
    steps = dp_sgd_steps(n, batch_size, epochs)
    parts = _as_int(micro_batches, "poisson_batches: micro_batches", 1)
    if max_batch_size is None:
        max_batch_size = -(-default_max_batch_size(n, q, steps) // parts) * parts
    m = _as_int(max_batch_size, "poisson_batches: max_batch_size", 1)
    if m % parts:
        raise ValueError(
            f"poisson_batches: max_batch_size={m} is not a multiple of micro_batches={parts}: "
            "every logical batch is split into micro-batches of equal size.")
    overflow_message = (
        f"poisson_batches: a Poisson batch sampled more than max_batch_size={m} examples "
        f"(N={n}, q={q:.6g}, expected {batch_size}, {steps_per_epoch} steps per epoch). "
        "Truncating it would void the privacy guarantee; pass a larger max_batch_size."
    )

    def pad(t: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
        paddings = tf.concat([[[0, m - k]], tf.zeros([t.shape.rank - 1, 2], tf.int32)], axis=0)
        out = tf.pad(t, paddings)
        return tf.ensure_shape(out, [m, *t.shape[1:]])

    def sample(key: tf.Tensor) -> tuple:
        seed_pair = tf.stack([key, tf.constant(0, tf.int64)])
        uniform = tf.random.stateless_uniform([n], seed=seed_pair, dtype=tf.float64)
        idx = tf.cast(tf.reshape(tf.where(uniform < q), [-1]), tf.int32)
        k = tf.size(idx)
        with tf.control_dependencies(
            [tf.debugging.assert_less_equal(k, m, message=overflow_message)]
        ):
            k = tf.identity(k)

        def take(t: tf.Tensor) -> tf.Tensor:
            return pad(tf.gather(t, idx), k)

        xb = tf.nest.map_structure(take, xs)
        yb = None if ys is None else tf.nest.map_structure(take, ys)
        wb = take(weights)
        if not with_indices:
            return xb, yb, wb
        ib = tf.pad(tf.cast(idx, tf.int64), [[0, m - k]], constant_values=-1)
        return xb, yb, wb, tf.ensure_shape(ib, [m])

    # One random int64 key per step. ``rerandomize_each_iteration`` makes every new pass over
    # the dataset (every Keras epoch) draw fresh keys, reproducibly for a given seed.
    keys = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(steps)
    batches = keys.map(sample, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if parts > 1:
        size = m // parts

        def split(*batch):
            def rows(t, j):  # micro-batch j of one component, its static shape kept
                return None if t is None else tf.reshape(t, [parts, size, *t.shape[1:]])[j]

            return tf.data.Dataset.range(parts).map(
                lambda j: tf.nest.map_structure(lambda t: rows(t, j), batch))

        batches = batches.flat_map(split).apply(
            tf.data.experimental.assert_cardinality(steps * parts))
    return batches.prefetch(tf.data.AUTOTUNE)
