"""Logical batches: ``gradient_accumulation_steps=k`` (Keras's optimizer argument) with
``PerExampleModel``: the update after ``k`` micro-batches equals one step on the whole logical
batch, the DP noise is drawn once per logical step with std ``C sigma / B_logical``, and the
noise stream and ``PrivacyCallback`` count logical steps."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
from pergrad import aggregate

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(width: int = 5, bias: bool = True):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((width,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(3, use_bias=bias)])


def _data(n: int = 32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, rng.integers(0, 3, n)


def test_clip_mean_over_micro_batches_equals_one_logical_step():
    x, y = _data()
    logical = pergrad.keras.PerExampleModel(_model(), aggregate.clip_mean(0.05))
    logical.compile(optimizer=keras.optimizers.SGD(0.5), loss=LOSS)
    logical.train_on_batch(x, y)
    micro = pergrad.keras.PerExampleModel(_model(), aggregate.clip_mean(0.05))
    micro.compile(optimizer=keras.optimizers.SGD(0.5, gradient_accumulation_steps=4), loss=LOSS)
    start = [w.copy() for w in micro.model.get_weights()]
    for j in range(4):
        micro.train_on_batch(x[8 * j:8 * (j + 1)], y[8 * j:8 * (j + 1)])
        if j < 3:  # Keras moves the weights on the 4th micro-step only
            for now, then in zip(micro.model.get_weights(), start, strict=True):
                np.testing.assert_array_equal(now, then)
    for a, b in zip(micro.model.get_weights(), logical.model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _dp_micro_steps(steps: int, micro: int, sigma: float, clip: float):
    """A model whose per-example gradients are all zero (zero inputs, no bias): its update is
    the DP noise alone, ``-(w_after - w_before)`` with SGD(1)."""
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, use_bias=False)])
    private = pergrad.keras.PerExampleModel(
        model, aggregate.dp_mean(clip, sigma, seed=7))
    private.compile(optimizer=keras.optimizers.SGD(1.0, gradient_accumulation_steps=steps),
                    loss="mse")
    x = np.zeros((micro, 64), "float32")
    y = np.zeros((micro, 64), "float32")
    before = np.array(model.get_weights()[0])
    counters = []
    for _ in range(steps):
        private.train_on_batch(x, y)
        counters.append(int(keras.ops.convert_to_numpy(private.noise_state.value)[1]))
    return before - np.array(model.get_weights()[0]), counters


def test_dp_noise_once_per_logical_step_with_std_c_sigma_over_b_logical():
    update, counters = _dp_micro_steps(steps=4, micro=8, sigma=2.0, clip=1.5)
    assert counters == [0, 0, 0, 1]  # the key advances at the release only
    expected = 1.5 * 2.0 / 32  # C sigma / B_logical
    # 4,096 normal draws: the sample std is within 5% of the truth with overwhelming
    # probability; averaging four micro-batch releases would give C sigma / 16, twice as much.
    assert np.std(update) == pytest.approx(expected, rel=0.05)
    assert abs(np.mean(update)) < 4 * expected / 64


def test_privacy_callback_counts_logical_steps():
    x, y = _data(64)
    private = pergrad.keras.PerExampleModel(_model(), aggregate.dp_mean(1.0, 1.1, seed=3))
    private.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=4),
                    loss=LOSS)
    callback = pergrad.keras.PrivacyCallback(64, 32, 1.1, 1e-5)  # the logical batch size
    history = private.fit(x, y, batch_size=8, epochs=2, callbacks=[callback], shuffle=False,
                          verbose=0)
    assert callback.steps == 4  # 2 epochs of 64 / 32
    assert int(keras.ops.convert_to_numpy(private.noise_state.value)[1]) == 4
    expected = pergrad.privacy.epsilon(64, 32, 1.1, 2, 1e-5)
    assert history.history["epsilon"][-1] == pytest.approx(expected, rel=1e-9)


def test_a_logical_batch_never_spans_two_epochs():
    x, y = _data(64)
    private = pergrad.keras.PerExampleModel(_model(), aggregate.dp_mean(1.0, 1.1, seed=3))
    private.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=3),
                    loss=LOSS)
    with pytest.raises(ValueError, match="8 micro-batches, which gradient_accumulation_steps=3"):
        private.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.mark.needs_tensorflow  # poisson_batches is a tf.data pipeline
def test_poisson_logical_batches_in_micro_batches():
    """``poisson_batches(micro_batches=k)``: each Poisson-sampled logical batch comes as ``k``
    micro-batches that together are the batch sampled without the split (same seed); trained
    with ``gradient_accumulation_steps=k`` and ``dp_mean(expected_batch_size=B)``, the noise
    stream and ``PrivacyCallback`` count the logical batches, and the epsilon is the
    accountant's for ``B``."""
    from pergrad.privacy import poisson_batches

    x, y = _data(64)
    whole = list(poisson_batches(x, y, batch_size=16, seed=5, max_batch_size=32))
    parts = poisson_batches(x, y, batch_size=16, seed=5, max_batch_size=32, micro_batches=4)
    assert int(parts.cardinality()) == 4 * len(whole) == 16
    micro = list(parts)
    assert all(tuple(b[0].shape) == (8, 5) for b in micro)
    for i, (xb, yb, wb) in enumerate(whole):
        for got, want in zip(zip(*micro[4 * i:4 * i + 4], strict=True), (xb, yb, wb),
                             strict=True):
            np.testing.assert_array_equal(np.concatenate([np.asarray(g) for g in got]),
                                          np.asarray(want))
    with pytest.raises(ValueError, match="not a multiple of micro_batches=4"):
        poisson_batches(x, y, batch_size=16, max_batch_size=30, micro_batches=4)

    private = pergrad.keras.PerExampleModel(
        _model(), aggregate.dp_mean(1.0, 1.1, seed=3, expected_batch_size=16))
    private.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=4),
                    loss=LOSS)
    callback = pergrad.keras.PrivacyCallback(64, 16, 1.1, 1e-5)
    history = private.fit(parts, epochs=2, callbacks=[callback], verbose=0)
    assert callback.steps == 8  # 2 epochs of 4 logical batches
    assert int(keras.ops.convert_to_numpy(private.noise_state.value)[1]) == 8
    expected = pergrad.privacy.epsilon(64, 16, 1.1, 2, 1e-5)
    assert history.history["epsilon"][-1] == pytest.approx(expected, rel=1e-9)
