"""DP noise never repeats by accident, on every public route (issue 9, part 1).

Each route is checked by what a user sees. The models here have a zero gradient (zero inputs, no
bias), so one SGD step with learning rate 1 moves the weights by exactly ``-noise / B``: two
steps drew the same noise exactly when the two weight changes are equal.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
from pergrad import aggregate
from pergrad.aggregate import NoiseStream
from pergrad.backend.lazy import tensorflow as tf  # on first use: TensorFlow may be absent

# The direct-call tests; the PerExampleModel.fit and save/load tests run on every backend.
DIRECT_ON_TF = pytest.mark.tensorflow_only(reason=(
    "dp_mean on tf tensors (tf.constant inputs, tf.int64 keys, a custom tf.function loop), its "
    "results and NoiseStream's keys read with .numpy() (on JAX a key is a NumPy array); noise "
    "statistics on every backend are tests/test_noise_distribution.py"))

B = 4


def _zero_gradient_model() -> keras.Model:
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, use_bias=False)])


def _data():
    return np.zeros((B, 5), "float32"), np.ones((B, 3), "float32")


def _dp_model(aggregator, inner=None) -> pergrad.keras.PerExampleModel:
    model = pergrad.keras.PerExampleModel(inner or _zero_gradient_model(), aggregator=aggregator)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    return model


def _noise_of_one_step(model) -> np.ndarray:
    """The noise that one training step added (``-B * weight change``)."""
    x, y = _data()
    kernel = model.model.trainable_variables[0]
    before = keras.ops.convert_to_numpy(kernel).copy()  # a copy: on PyTorch it may share memory
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    return -B * (keras.ops.convert_to_numpy(kernel) - before)


def _result():
    model = _zero_gradient_model()
    pex = pergrad.PerExample(model, "mse")
    x, y = _data()
    return pex.compute(tf.constant(x), tf.constant(y))


@DIRECT_ON_TF
def test_direct_calls_draw_fresh_noise_every_time():
    agg = aggregate.dp_mean(1.0, 1.0, seed=0)
    result = _result()
    first, second = agg(result)[0].numpy(), agg(result)[0].numpy()
    assert np.std(first) > 0 and not np.allclose(first, second)


@DIRECT_ON_TF
def test_direct_calls_inside_a_custom_tf_function_loop_draw_fresh_noise():
    agg = aggregate.dp_mean(1.0, 1.0)
    model = _zero_gradient_model()
    pex = pergrad.PerExample(model, "mse")

    @tf.function
    def step(x, y):
        return agg(pex.compute(x, y))[0]

    x, y = (tf.constant(a) for a in _data())
    draws = [step(x, y).numpy() for _ in range(3)]
    assert not np.allclose(draws[0], draws[1]) and not np.allclose(draws[1], draws[2])


@DIRECT_ON_TF
def test_finalize_takes_an_explicit_key_and_refuses_a_step_number():
    agg = aggregate.dp_mean(1.0, 1.0)
    result = _result()
    partial = agg.local(result, aggregate.Batch.of(result))
    key = tf.constant([3, 9], tf.int64)
    np.testing.assert_array_equal(agg.finalize(partial, key)[0], agg.finalize(partial, key)[0])
    for bad in (None, 0, tf.constant(5)):
        with pytest.raises(ValueError, match="noise key"):
            agg.finalize(partial, bad)


@DIRECT_ON_TF
def test_noise_stream_keys_advance_and_a_seed_reproduces_them():
    stream = NoiseStream(seed=11)
    keys = [stream.next_key().numpy().tolist() for _ in range(3)]
    assert keys == [[11, 0], [11, 1], [11, 2]]
    assert NoiseStream(seed=11).next_key().numpy().tolist() == [11, 0]
    assert NoiseStream().seed != NoiseStream().seed


def test_fit_draws_fresh_noise_every_step_and_after_recompiling():
    model = _dp_model(aggregate.dp_mean(1.0, 1.0))
    first, second = _noise_of_one_step(model), _noise_of_one_step(model)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")  # iterations restart at 0
    third = _noise_of_one_step(model)
    assert np.std(first) > 0
    for a, b in ((first, second), (first, third), (second, third)):
        assert not np.allclose(a, b)


def test_one_unseeded_aggregator_shared_by_two_models_gives_each_its_own_noise():
    agg = aggregate.dp_mean(1.0, 1.0)
    first, second = _dp_model(agg), _dp_model(agg)
    assert not np.allclose(_noise_of_one_step(first), _noise_of_one_step(second))


@DIRECT_ON_TF
def test_a_seeded_aggregator_feeds_one_model_only():
    agg = aggregate.dp_mean(1.0, 1.0, seed=5)
    _dp_model(agg)
    with pytest.raises(ValueError, match="repeat that noise"):
        _dp_model(agg)
    with pytest.raises(ValueError, match="repeat that noise"):
        agg(_result())  # a direct call would be a second stream from the same seed
    used_directly = aggregate.dp_mean(1.0, 1.0, seed=6)
    used_directly(_result())
    with pytest.raises(ValueError, match="its own direct calls"):
        _dp_model(used_directly)


def test_the_same_seed_reproduces_the_same_noise():
    first = _dp_model(aggregate.dp_mean(1.0, 1.0, seed=21))
    second = _dp_model(aggregate.dp_mean(1.0, 1.0, seed=21))
    steps = [_noise_of_one_step(first), _noise_of_one_step(first)]
    np.testing.assert_allclose(steps[0], _noise_of_one_step(second), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(steps[1], _noise_of_one_step(second), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [31, None])
def test_a_restored_model_resumes_the_noise_stream(tmp_path, seed):
    model = _dp_model(aggregate.dp_mean(1.0, 1.0, seed=seed))
    first = _noise_of_one_step(model)
    path = tmp_path / "dp.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(restored.noise_state),
                                  keras.ops.convert_to_numpy(model.noise_state))
    resumed = _noise_of_one_step(restored)
    assert not np.allclose(first, resumed)
    if seed is not None:  # the uninterrupted run's second step, exactly
        reference = _dp_model(aggregate.dp_mean(1.0, 1.0, seed=seed))
        _noise_of_one_step(reference)
        np.testing.assert_allclose(resumed, _noise_of_one_step(reference), rtol=1e-5, atol=1e-6)
