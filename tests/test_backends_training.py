"""``PerExampleModel`` DP training on every backend: the update against the float64 oracle,
noise of the right size that never repeats, the mixing refusal that changes no state, a noise
stream that survives save and load, and writes from the batch refused under DP."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from oracle import keras_loss, loop_gradients

import pergrad
from pergrad import aggregate
from pergrad.keras import PerExampleModel

MSE = keras.losses.MeanSquaredError()


def _mlp(width=16):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(width, activation="tanh"),
                             keras.layers.Dense(3)])


def _data(rng, n=8):
    return rng.normal(size=(n, 6)), rng.normal(size=(n, 3))


def _clipped_mean(model, x, y, clip):
    grads, _ = loop_gradients(model, keras_loss(MSE), x, y)
    flat = np.concatenate([g.reshape(len(g), -1) for g in grads], axis=1)
    factors = np.minimum(1.0, clip / np.linalg.norm(flat, axis=1))
    return [np.tensordot(factors, g, axes=1) / len(x) for g in grads]


@pytest.mark.parametrize("name", ["clip_mean", "dp_mean_sigma_0"])
def test_one_step_equals_the_oracle(name, float64, rng):
    inner = _mlp()
    x, y = _data(rng)
    clip = 0.3
    before = [w.copy() for w in inner.get_weights()]
    expected = _clipped_mean(inner, x, y, clip)
    agg = aggregate.clip_mean(clip) if name == "clip_mean" else aggregate.dp_mean(clip, 0.0)
    model = PerExampleModel(inner, agg)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=MSE)
    model.train_on_batch(x, y)
    for w0, w1, g in zip(before, inner.get_weights(), expected, strict=True):
        np.testing.assert_allclose(w1, w0 - 0.5 * g, rtol=1e-6, atol=1e-9)


def test_noise_has_the_stated_size_and_never_repeats(float64, rng):
    """update = clipped mean + N(0, (C sigma / B)^2) per coordinate, fresh at every step."""
    inner = _mlp(width=64)
    x, y = _data(rng)
    clip, sigma, lr = 0.5, 2.0, 1.0
    model = PerExampleModel(inner, aggregate.dp_mean(clip, sigma, seed=11))
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=MSE)
    noises = []
    for _ in range(3):
        before = [w.copy() for w in inner.get_weights()]
        expected = _clipped_mean(inner, x, y, clip)
        model.train_on_batch(x, y)
        step = [(w0 - w1) / lr - g
                for w0, w1, g in zip(before, inner.get_weights(), expected, strict=True)]
        noises.append(np.concatenate([s.ravel() for s in step]))
    stddev = clip * sigma / len(x)
    for n in noises:
        assert abs(np.std(n) / stddev - 1.0) < 0.1, np.std(n) / stddev
    for a in range(3):
        for b in range(a + 1, 3):
            assert abs(np.corrcoef(noises[a], noises[b])[0, 1]) < 0.1
    assert np.asarray(model.noise_state).tolist() == [11, 3]


def test_a_loss_that_mixes_examples_is_refused_before_any_state_changes(float64, rng):
    inner = _mlp()
    x, y = _data(rng)

    def centered(y_true, y_pred):
        per_example = keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)
        return per_example - keras.ops.mean(per_example)

    model = PerExampleModel(inner, aggregate.dp_mean(1.0, 1.0, seed=5))
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss=centered)
    before = [w.copy() for w in inner.get_weights()]
    with pytest.raises(pergrad.MixesExamplesError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for a, b in zip(inner.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(np.asarray(model.optimizer.iterations)) == 0
    assert np.asarray(model.noise_state).tolist() == [5, 0]
    with pytest.raises(pergrad.MixesExamplesError):  # and every later step too
        model.train_on_batch(x, y)
    for a, b in zip(inner.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_noise_stream_survives_save_and_load(float64, rng, tmp_path):
    x, y = _data(rng, 16)
    model = PerExampleModel(_mlp(), aggregate.dp_mean(1.0, 1.0, seed=7))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=MSE)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.asarray(model.noise_state).tolist() == [7, 2]
    model.save(tmp_path / "dp.keras")
    loaded = keras.models.load_model(tmp_path / "dp.keras")
    assert np.asarray(loaded.noise_state).tolist() == [7, 2]
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.asarray(loaded.noise_state).tolist() == [7, 4]


class RunningMean(keras.layers.Layer):
    """Writes a statistic of the batch into a non-trainable variable while training."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                    trainable=False, name="running_mean")

    def call(self, x, training=False):
        if training:
            self.mean.assign(keras.ops.mean(x, axis=0))
        return x


def test_a_batch_statistic_written_under_dp_is_refused(float64, rng):
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), RunningMean(),
                              keras.layers.Dense(3)])
    model = PerExampleModel(inner, aggregate.dp_mean(1.0, 1.0), check_example_mixing=False)
    model.compile(optimizer="sgd", loss=MSE)
    x, y = _data(rng)
    with pytest.raises(ValueError, match="running_mean"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.mark.needs_tensorflow  # poisson_batches is a tf.data pipeline
def test_poisson_batches_and_the_privacy_budget(float64, rng):
    """The DP-SGD route end to end: Poisson-sampled, padded batches (tf.data), dp_mean dividing
    by the expected batch size, and PrivacyCallback stopping at the budget, with the epsilon it
    reports equal to the accountant's for the steps that ran."""
    x, y = rng.normal(size=(64, 6)), rng.normal(size=(64, 3))
    model = PerExampleModel(_mlp(), aggregate.dp_mean(1.0, 2.0, seed=2, expected_batch_size=8))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=MSE)
    budget = pergrad.keras.PrivacyCallback(64, 8, 2.0, 1e-5, target_epsilon=2.0, verbose=0)
    data = pergrad.privacy.poisson_batches(x, y, batch_size=8, seed=0, epochs=8)
    model.fit(data, epochs=8, callbacks=[budget], shuffle=False, verbose=0)
    assert budget.budget_exhausted and budget.steps == budget.max_steps
    assert np.asarray(model.noise_state).tolist() == [2, budget.steps]
    assert budget.epsilon <= 2.0
    assert budget.steps < 64  # stopped by the budget, before the data ran out
    assert budget.epsilon == pytest.approx(pergrad.privacy.epsilon_for_steps(
        8 / 64, 2.0, budget.steps, 1e-5))


def test_direct_noisy_calls_never_repeat_their_noise(float64, rng):
    """``agg(result)`` outside any compiled function draws fresh noise at every call; inside a
    compiled function its key must come in as an argument on JAX (a key drawn while tracing
    would be a constant of the trace, the same at every call), so that is refused; TensorFlow's
    stream variable advances inside ``tf.function``, so there each call is fresh."""
    inner = _mlp()
    x, y = _data(rng)
    pex = pergrad.PerExample(inner, MSE)
    agg = aggregate.dp_mean(1.0, 1.0, seed=3)
    result = pex.compute(*pex.prepare(x, y)[:2])
    first, second = agg(result), agg(result)
    assert not np.allclose(np.asarray(first[0]), np.asarray(second[0]))
    stream = aggregate.NoiseStream(seed=4)
    compiled = pex.compiled("noisy", lambda x, y: agg(pex.compute(x, y)))
    with_stream = pex.compiled(
        "noisy_stream", lambda x, y: agg.finalize(
            agg.local(pex.compute(x, y), aggregate.Batch.of(pex.compute(x, y))),
            stream.next_key()))
    xt, yt, _ = pex.prepare(x, y)
    if keras.backend.backend() == "jax":
        for fn in (compiled, with_stream):
            with pytest.raises(ValueError, match="constant of this compiled function"):
                fn(xt, yt)
    else:
        a, b = compiled(xt, yt), compiled(xt, yt)
        assert not np.allclose(np.asarray(a[0]), np.asarray(b[0]))


def test_callback_lists_and_loss_scale_factor(float64, rng):
    x, y = _data(rng)
    model = PerExampleModel(_mlp(), aggregate.clip_mean(1.0))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=MSE)
    history = keras.callbacks.History()
    callbacks = keras.callbacks.CallbackList([history], model=model)
    model.fit(x, y, batch_size=8, epochs=1, callbacks=callbacks, verbose=0)
    # A fixed loss scale (the optimizer's loss_scale_factor) leaves the update unchanged.
    weights = _mlp().get_weights()
    updates = []
    for factor in (None, 128.0):
        inner = _mlp()
        inner.set_weights(weights)
        scaled = PerExampleModel(inner, aggregate.clip_mean(1.0))
        scaled.compile(optimizer=keras.optimizers.SGD(0.1, loss_scale_factor=factor), loss=MSE)
        scaled.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        updates.append(inner.get_weights())
    for a, b in zip(*updates, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_torch_steps_run_eagerly(rng):
    """On PyTorch the step reads values on the host (mixing check, noise keys, the monitor's
    tables): jit_compile=True is refused with a warning and the step still trains."""
    if keras.backend.backend() != "torch":
        pytest.skip("PyTorch behaviour (torch.compile)")
    x, y = _data(rng)
    model = PerExampleModel(_mlp(), aggregate.dp_mean(1.0, 1.0, seed=0, expected_batch_size=4))
    with pytest.warns(UserWarning, match="jit_compile=True .* is ignored"):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=MSE, jit_compile=True)
    assert model.jit_compile is False
    before = model.get_weights()
    model.fit(x.astype("float32"), y.astype("float32"), batch_size=4, epochs=1, verbose=0)
    assert model.noise_state.numpy().tolist()[1] == 2
    assert not np.allclose(before[0], model.get_weights()[0])
