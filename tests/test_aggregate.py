"""Every aggregator against a numpy reference on float64 per-example gradients from the loop oracle."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from oracle import assert_close, loop_gradients
from scipy import stats

import pergrad
from pergrad import aggregate

tf = pytest.importorskip("tensorflow", reason="needs tensorflow (pip install pergrad[tensorflow])")
pytestmark = pytest.mark.tensorflow_only(reason=(
    "the aggregators inside a tf.function (the TensorFlow train step's graph route) on tf "
    "tensors, with tf.int64 noise keys and custom functions written with tf ops; their math on "
    "every backend is tests/test_aggregate_backends.py"))
# A test's own marker below says more than the module's.
NOT_YET_EAGER = pytest.mark.tensorflow_only(reason=(
    "not yet run on JAX/PyTorch: eager aggregator and PerExampleResult calls, TensorFlow only in "
    "tf.constant inputs and .numpy() reads; would need keras.ops inputs and np.asarray"))

B = 8


def _model():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(3)])


def _data(rng, batch=B):
    x = rng.normal(size=(batch, 5))
    y = rng.normal(size=(batch, 3))
    return x, y


def _loss(y, p):
    return keras.ops.mean(keras.ops.square(y - p), axis=-1)


def _reference(model, x, y, sample_weight=None):
    grads, _ = loop_gradients(model, _loss, x, y, sample_weight)
    flat = np.concatenate([g.reshape(len(x), -1) for g in grads], axis=1)
    return grads, np.sqrt(np.sum(flat ** 2, axis=1))


def _key(counter: int, seed: int = 7) -> tf.Tensor:
    return tf.constant([seed, counter], tf.int64)


def _run(agg, model, x, y, sample_weight=None, key=None):
    pex = pergrad.PerExample(model, _loss)

    @tf.function
    def fn(x, y, w):
        return agg(pex.compute(x, y, w), w, key=key)

    w = None if sample_weight is None else tf.constant(sample_weight)
    return [g.numpy() for g in fn(tf.constant(x), tf.constant(y), w)]


def _check(actual, expected, what):
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_close(a, e, rtol=1e-6, what=f"{what} variable {k}")


def test_mean_and_sum(float64, rng):
    model = _model()
    x, y = _data(rng)
    grads, _ = _reference(model, x, y)
    _check(_run(aggregate.mean(), model, x, y), [g.mean(0) for g in grads], "mean")
    _check(_run(aggregate.sum(), model, x, y), [g.sum(0) for g in grads], "sum")


@pytest.mark.parametrize("per_layer", [False, True])
def test_clip_mean(float64, rng, per_layer):
    model = _model()
    x, y = _data(rng)
    grads, norms = _reference(model, x, y)
    clip = float(np.median(norms))  # some examples clipped, some not
    if per_layer:
        clip_k = clip / np.sqrt(len(grads))
        expected = []
        for g in grads:
            n = np.sqrt(np.sum(g.reshape(B, -1) ** 2, axis=1))
            c = np.minimum(1, clip_k / n)
            expected.append(np.tensordot(c, g, axes=1) / B)
    else:
        c = np.minimum(1, clip / norms)
        expected = [np.tensordot(c, g, axes=1) / B for g in grads]
    _check(_run(aggregate.clip_mean(clip, per_layer=per_layer), model, x, y), expected,
           "clip_mean")


def test_dp_mean_without_noise_is_clipped_sum_over_expected_batch(float64, rng):
    model = _model()
    x, y = _data(rng)
    grads, norms = _reference(model, x, y)
    clip = float(np.median(norms))
    c = np.minimum(1, clip / norms)
    expected = [np.tensordot(c, g, axes=1) / 5 for g in grads]
    agg = aggregate.dp_mean(clip, 0.0, expected_batch_size=5)
    _check(_run(agg, model, x, y), expected, "dp_mean sigma=0")


def test_dp_mean_noise_stddev(rng):
    """Noise on a 1000-weight layer: stddev C * sigma / B within 10%, mean 0, seeded."""
    model = keras.Sequential([keras.Input((1000,)), keras.layers.Dense(1, use_bias=False)])
    x = rng.normal(size=(4, 1000)).astype("float32")
    y = rng.normal(size=(4, 1)).astype("float32")
    clip, sigma = 0.5, 3.0
    clean = _run(aggregate.clip_mean(clip), model, x, y)[0]
    agg = aggregate.dp_mean(clip, sigma, seed=7)
    noise = np.concatenate([(_run(agg, model, x, y, key=_key(s))[0] - clean).ravel()
                            for s in range(3)])
    expected = clip * sigma / 4
    assert abs(noise.std() / expected - 1) < 0.1, (noise.std(), expected)
    assert abs(noise.mean()) < 4 * expected / np.sqrt(noise.size)
    again = _run(aggregate.dp_mean(clip, sigma), model, x, y, key=_key(1))[0]
    np.testing.assert_array_equal(again, _run(agg, model, x, y, key=_key(1))[0])
    assert not np.array_equal(_run(agg, model, x, y, key=_key(0))[0], again)


def test_normalized_mean(float64, rng):
    model = _model()
    x, y = _data(rng)
    grads, norms = _reference(model, x, y)
    c = 1 / (norms + 0.05)
    expected = [np.tensordot(c, g, axes=1) / B for g in grads]
    _check(_run(aggregate.normalized_mean(0.05), model, x, y), expected, "normalized_mean")


def test_median_and_trimmed_mean(float64, rng):
    model = _model()
    x, y = _data(rng, batch=9)
    grads, _ = _reference(model, x, y)
    _check(_run(aggregate.median(), model, x, y), [np.median(g, 0) for g in grads], "median")
    for fraction in (0.0, 0.2, 0.4):
        _check(_run(aggregate.trimmed_mean(fraction), model, x, y),
               [stats.trim_mean(g, fraction, axis=0) for g in grads], f"trimmed {fraction}")


def test_order_statistics_leave_out_zero_weight_rows(float64, rng):
    model = _model()
    x, y = _data(rng)
    w = np.array([1.0, 2.0, 0.0, 1.0, 0.5, 0.0, 1.0, 3.0])
    grads, _ = _reference(model, x, y, w)
    real = w != 0
    _check(_run(aggregate.median(), model, x, y, w), [np.median(g[real], 0) for g in grads],
           "weighted median")
    _check(_run(aggregate.trimmed_mean(0.2), model, x, y, w),
           [stats.trim_mean(g[real], 0.2, axis=0) for g in grads], "weighted trimmed mean")
    # Linear aggregators: the weights are inside g_i, and zero-weight rows add nothing.
    _check(_run(aggregate.mean(), model, x, y, w), [g.sum(0) / B for g in grads], "weighted mean")


def test_custom(float64, rng):
    model = _model()
    x, y = _data(rng)
    grads, norms = _reference(model, x, y)

    def weight_by_norm(per_example, n):
        return [tf.tensordot(n, g, axes=1) for g in per_example]

    _check(_run(aggregate.custom(weight_by_norm), model, x, y),
           [np.tensordot(norms, g, axes=1) for g in grads], "custom")


def test_custom_wrong_shapes_is_a_clear_error(rng):
    model = _model()
    x, y = _data(rng)
    x, y = x.astype("float32"), y.astype("float32")
    with pytest.raises(ValueError, match=r"returned shape \(4, 5\) for variable 0, expected"):
        _run(aggregate.custom(lambda g, n: [tf.zeros((4, 5))] + [v[0] for v in g[1:]]),
             model, x, y)
    with pytest.raises(ValueError, match="returned 1 tensors for 4 trainable variables"):
        _run(aggregate.custom(lambda g, n: [g[0][0]]), model, x, y)


@pytest.mark.parametrize("agg", [aggregate.mean(), aggregate.clip_mean(1.0),
                                 aggregate.dp_mean(1.0, 0.0), aggregate.normalized_mean(),
                                 aggregate.median(), aggregate.trimmed_mean(0.25)],
                         ids=lambda a: a.name)
def test_non_finite_examples_are_dropped(float64, rng, agg):
    model = _model()
    x, y = _data(rng)
    x[3, 1] = np.nan
    y[5, 0] = np.inf
    good = np.ones(B, bool)
    good[[3, 5]] = False
    grads, norms = _reference(model, x[good], y[good])
    # Reference on the finite examples alone, with the divisor counting every row.
    if agg.name in ("mean", "dp_mean"):
        expected = [g.sum(0) / B for g in grads] if agg.name == "mean" else \
            [np.tensordot(np.minimum(1, 1 / norms), g, axes=1) / B for g in grads]
    elif agg.name == "clip_mean":
        expected = [np.tensordot(np.minimum(1, 1 / norms), g, axes=1) / B for g in grads]
    elif agg.name == "normalized_mean":
        expected = [np.tensordot(1 / (norms + 0.01), g, axes=1) / B for g in grads]
    elif agg.name == "median":
        expected = [np.median(g, 0) for g in grads]
    else:
        expected = [stats.trim_mean(g, 0.25, axis=0) for g in grads]
    actual = _run(agg, model, x, y)
    _check(actual, expected, f"{agg.name} with NaN/inf examples")

    pex = pergrad.PerExample(model, _loss)
    result = pex.compute(tf.constant(x), tf.constant(y))
    partial = agg.local(result, aggregate.Batch.of(result))
    assert float(partial.dropped) == 2.0


@NOT_YET_EAGER
def test_dropped_examples_under_loss_scaling_keep_overflow(rng):
    """With loss scaling an infinite gradient of a finite loss is overflow: kept, so the
    optimizer sees it and skips the step; a non-finite loss is dropped."""
    model = _model()
    x, y = _data(rng)
    x, y = x.astype("float32"), y.astype("float32")
    x[2, 0] = np.nan
    result = pergrad.PerExample(model, _loss).compute(tf.constant(x), tf.constant(y))
    partial = aggregate.clip_mean(1.0).local(result, aggregate.Batch.of(result, loss_scaled=True))
    assert float(partial.dropped) == 1.0
    assert all(np.isfinite(v.numpy()).all() for v in partial.values)


@NOT_YET_EAGER
def test_scaled_view_unscales_every_quantity(float64, rng):
    model = _model()
    x, y = _data(rng)
    result = pergrad.PerExample(model, _loss).compute(tf.constant(x), tf.constant(y))
    view = result.scaled(0.25)
    assert_close(view.norms(), 0.25 * result.norms().numpy())
    for a, e in zip(view.weighted_sum(tf.ones([B], tf.float64)),
                    result.weighted_sum(tf.ones([B], tf.float64)), strict=True):
        assert_close(a, 0.25 * e.numpy())
    assert_close(view.gradients()[0], 0.25 * result.gradients()[0].numpy())


@NOT_YET_EAGER
def test_norm_only_aggregators_never_materialize(rng, monkeypatch):
    """mean, sum, clip_mean, dp_mean, normalized_mean use squared norms and weighted sums only."""
    model = _model()
    x, y = _data(rng)
    x, y = x.astype("float32"), y.astype("float32")
    x[0, 0] = np.nan  # also through the dropping path
    result = pergrad.PerExample(model, _loss).compute(tf.constant(x), tf.constant(y))

    def refuse(self):
        raise AssertionError("materialized per-example gradients")

    monkeypatch.setattr(pergrad.PerExampleResult, "gradients", refuse)
    from pergrad.rules.forms import Factored
    monkeypatch.setattr(Factored, "materialize", refuse)
    for agg in (aggregate.mean(), aggregate.sum(), aggregate.clip_mean(1.0),
                aggregate.clip_mean(1.0, per_layer=True), aggregate.dp_mean(1.0, 1.0, seed=0),
                aggregate.normalized_mean()):
        assert all(np.isfinite(g.numpy()).all() for g in agg(result))


@pytest.mark.tensorflow_only(
    reason="aggregate.cross_replica outside any tf.distribute strategy, on tf tensors")
def test_cross_replica_is_identity_without_strategy(rng):
    partial = aggregate.Partial([tf.ones(3)], tf.constant(2.0), None, tf.constant(0.0))
    assert aggregate.cross_replica(partial, gathers=False) is partial


def test_custom_sees_each_examples_loss_and_predictions(float64, rng):
    """``fn(grads, norms, losses, predictions)``: weights from the losses and the predictions,
    checked against the loop oracle's gradients and Keras's own predictions."""
    model = _model()
    x, y = _data(rng)
    w = rng.uniform(0.5, 1.5, size=B)
    grads, _ = loop_gradients(model, _loss, x, y, w)
    predictions = model(x).numpy()
    losses = w * np.mean((y - predictions) ** 2, axis=-1)
    seen = {}

    def by_loss_and_output(grads, norms, losses, predictions):
        seen["names"] = True
        weights = tf.exp(-losses) * tf.reduce_sum(tf.square(predictions), axis=-1)
        return [tf.tensordot(weights, g, axes=1) for g in grads]

    weights = np.exp(-losses) * np.sum(predictions ** 2, axis=-1)
    expected = [np.tensordot(weights, g, axes=1) for g in grads]
    _check(_run(aggregate.custom(by_loss_and_output), model, x, y, w), expected, "custom+extras")

    def with_kwargs(grads, norms, **extra):
        seen["kwargs"] = sorted(extra)
        return [tf.reduce_sum(g, axis=0) for g in grads]

    _run(aggregate.custom(with_kwargs), model, x, y)
    assert seen == {"names": True, "kwargs": ["losses", "predictions"]}
