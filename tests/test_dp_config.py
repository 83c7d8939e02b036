"""Budget-first DP-SGD: ``DPConfig`` calibrates the noise from the privacy target and
``make_private``'s ``fit`` trains with it, at the calibrated batch size, and stops at the
budget."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
from pergrad.keras import DPConfig, PrivacyCallback, make_private

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n: int = 64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(2)])


def test_config_calibrates_the_noise_to_the_budget():
    config = DPConfig(target_epsilon=2.0, delta=1e-5, num_examples=60000, batch_size=256,
                      epochs=3, l2_norm_clip=0.5, seed=0)
    expected = pergrad.privacy.noise_multiplier_for(2.0, 60000, 256, 3, 1e-5)
    assert config.noise_multiplier == expected
    assert 1.95 < config.epsilon <= 2.0
    aggregator = config.aggregator()
    assert aggregator.noisy and aggregator.config["noise_multiplier"] == expected
    assert aggregator.config["l2_norm_clip"] == 0.5
    assert aggregator.config["expected_batch_size"] is None
    poisson = DPConfig(2.0, 1e-5, 60000, 256, 3, poisson=True, seed=0)
    assert poisson.aggregator().config["expected_batch_size"] == 256
    callback = config.privacy_callback()
    assert isinstance(callback, PrivacyCallback) and callback.target_epsilon == 2.0
    assert callback.max_steps == pergrad.privacy.dp_sgd_steps(60000, 256, 3)


def test_bad_configurations_are_refused_at_construction():
    with pytest.raises(ValueError, match="target_epsilon"):
        DPConfig(target_epsilon=-1.0, delta=1e-5, num_examples=100, batch_size=10, epochs=1)
    with pytest.raises(ValueError, match="batch_size"):
        DPConfig(target_epsilon=1.0, delta=1e-5, num_examples=100, batch_size=1000, epochs=1)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        DPConfig(1.0, 1e-5, 100, 10, 1, l2_norm_clip=float("inf"))
    with pytest.raises(TypeError, match="DPConfig"):
        make_private(_model(), {"target_epsilon": 1.0})


def test_make_private_fit_follows_the_config_and_stops_at_the_budget():
    x, y = _data()
    config = DPConfig(target_epsilon=8.0, delta=1e-5, num_examples=len(x), batch_size=16,
                      epochs=2, seed=3)
    private = make_private(_model(), config)
    private.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    before = [np.array(w) for w in private.model.get_weights()]
    history = private.fit(x, y, verbose=0)  # batch size 16 and 2 epochs from the config
    assert len(history.history["epsilon"]) == 2
    assert history.history["epsilon"][-1] == pytest.approx(config.epsilon, rel=1e-6)
    assert history.history["epsilon"][-1] <= 8.0
    assert any(not np.allclose(a, b) for a, b in zip(private.model.get_weights(), before,
                                                     strict=True))
    # More epochs than planned: the callback stops training at the budget.
    again = make_private(_model(), config)
    again.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    callback = config.privacy_callback(verbose=0)
    again.fit(x, y, epochs=10, callbacks=[callback], verbose=0)
    assert callback.budget_exhausted and callback.steps == callback.max_steps
    assert callback.epsilon <= 8.0


def test_make_private_refuses_another_batch_size():
    x, y = _data()
    config = DPConfig(8.0, 1e-5, len(x), 16, 1, seed=0)
    private = make_private(_model(), config)
    private.compile(optimizer="sgd", loss=LOSS)
    with pytest.raises(ValueError, match="differs from the DPConfig's batch_size=16"):
        private.fit(x, y, batch_size=32, verbose=0)


def test_make_private_with_logical_batches():
    """``batch_size`` is the logical batch: ``fit`` runs micro-batches of ``B / k`` and the
    callback counts logical steps."""
    x, y = _data()
    config = DPConfig(8.0, 1e-5, len(x), 32, 2, seed=1)
    private = make_private(_model(), config)
    private.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), loss=LOSS)
    history = private.fit(x, y, verbose=0)  # 2 epochs of 2 logical batches of 4 x 8
    assert int(keras.ops.convert_to_numpy(private.noise_state.value)[1]) == 4
    assert history.history["epsilon"][-1] == pytest.approx(config.epsilon, rel=1e-9)
    with pytest.raises(ValueError, match="in 4 micro-batches of 8"):
        private.fit(x, y, batch_size=32, verbose=0)
