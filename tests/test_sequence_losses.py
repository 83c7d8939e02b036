"""Per-example losses of sequence outputs ``(B, T, F)``: per-token MSE, token-level
cross-entropy with padding (``Embedding(mask_zero=True)``) and ignored labels
(``ignore_class``), in ``PerExample`` (summed over an example's valid positions) and
``PerExampleModel`` (averaged over them), against the float64 loop oracle and Keras itself."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from oracle import assert_close, keras_loss, loop_gradients

import pergrad
from pergrad import aggregate

B, T = 6, 5


def _sequence_regressor():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((T, 3)), keras.layers.LSTM(4, return_sequences=True),
                             keras.layers.Dense(2)])


def _token_classifier(vocabulary: int = 7):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 4, mask_zero=True)(tokens)
    h = keras.layers.SimpleRNN(5, return_sequences=True)(h)
    return keras.Model(tokens, keras.layers.Dense(vocabulary)(h))


def _padded_tokens(rng, vocabulary: int = 7):
    """Token rows with 0-padding at the end (lengths 1..T) and next-token labels."""
    lengths = rng.integers(1, T + 1, size=B)
    x = rng.integers(1, vocabulary, size=(B, T)).astype("int32")
    for i, n in enumerate(lengths):
        x[i, n:] = 0
    y = np.roll(x, -1, axis=1).astype("int32")
    return x, y, lengths


def test_per_token_mse_gradients_match_the_float64_oracle(float64, rng):
    model = _sequence_regressor()
    x, y = rng.normal(size=(B, T, 3)), rng.normal(size=(B, T, 2))
    loss = keras.losses.MeanSquaredError()
    pex = pergrad.PerExample(model, loss)
    expected, losses = loop_gradients(model, keras_loss(loss), x, y)
    assert_close(pex.losses(x, y), losses, what="losses")
    for got, want in zip(pex.gradients(x, y), expected, strict=True):
        assert_close(got, want, what="gradients")
    assert_close(pex.norms(x, y), np.sqrt(sum((g.reshape(B, -1) ** 2).sum(1) for g in expected)),
                 what="norms")


def test_sequence_model_trains_with_clip_mean_and_mean_equals_keras(rng):
    """The crash the issue reports (``Dimensions must be equal, but are 5 and 8`` under
    ``clip_mean``), and the mean aggregator's step equal to Keras's own."""
    x = rng.normal(size=(B, T, 3)).astype("float32")
    y = rng.normal(size=(B, T, 2)).astype("float32")
    clipped = pergrad.keras.PerExampleModel(_sequence_regressor(), aggregate.clip_mean(0.1))
    clipped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = clipped.fit(x, y, batch_size=B, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()

    ours = pergrad.keras.PerExampleModel(_sequence_regressor(), aggregate.mean())
    ours.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    plain = _sequence_regressor()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    logs = ours.train_on_batch(x, y, return_dict=True)
    expected = plain.train_on_batch(x, y, return_dict=True)
    for got, want in zip(ours.model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert logs["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert logs["mae"] == pytest.approx(expected["mae"], rel=1e-5)


def test_padded_tokens_count_each_examples_valid_positions_only(float64, rng):
    model = _token_classifier()
    x, y, lengths = _padded_tokens(rng)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pex = pergrad.PerExample(model, loss)
    expected, losses = loop_gradients(model, keras_loss(loss), x, y)
    # Keras's own loss of each example alone, summed over its valid positions, is the oracle.
    assert_close(pex.losses(x, y), losses, what="losses")
    for got, want in zip(pex.gradients(x, y), expected, strict=True):
        assert_close(got, want, what="gradients")
    # Changing a padded position's label or token changes nothing.
    y_changed = y.copy()
    y_changed[lengths < T, -1] = 3
    assert_close(pex.losses(x, y_changed), losses, what="padding ignored")


def test_ignored_labels_leave_positions_out(float64, rng):
    keras.utils.set_random_seed(1)
    head = keras.Sequential([keras.Input((T, 3)), keras.layers.Dense(4)])
    x = rng.normal(size=(B, T, 3))
    y = rng.integers(0, 4, size=(B, T))
    y[:, -2:] = -1  # e.g. the padding of a causal language model's labels
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    pex = pergrad.PerExample(head, loss)
    expected, losses = loop_gradients(head, keras_loss(loss), x, y)
    assert_close(pex.losses(x, y), losses, what="losses")
    for got, want in zip(pex.gradients(x, y), expected, strict=True):
        assert_close(got, want, what="gradients")


def test_per_example_model_averages_over_each_examples_valid_positions(rng):
    """``PerExampleModel``'s per-example loss is the mean over the example's own valid
    positions; with the mean aggregator the update is the mean of those examples' gradients,
    each computed alone by Keras (where a lone example's mean is exactly that)."""
    x, y, _ = _padded_tokens(rng)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours = pergrad.keras.PerExampleModel(_token_classifier(), aggregate.mean())
    ours.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    ours.train_on_batch(x, y)
    expected = [np.zeros_like(w) for w in _token_classifier().get_weights()]
    for i in range(B):
        alone = _token_classifier()
        start = [w.copy() for w in alone.get_weights()]
        alone.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
        alone.train_on_batch(x[i:i + 1], y[i:i + 1])
        for k, (after, before) in enumerate(zip(alone.get_weights(), start, strict=True)):
            expected[k] += (after - before) / B
    start = _token_classifier().get_weights()
    for got, before, step in zip(ours.model.get_weights(), start, expected, strict=True):
        np.testing.assert_allclose(got - before, step, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("strategy", ["auto", "jacobian", "vmap", "loop"])
def test_predictions_keep_the_padding_mask_on_every_route(rng, strategy):
    """The engine's predictions carry the model output's Keras mask on every route (a detached
    copy, or an output through ``jax.vjp``'s or ``jacrev``'s auxiliary values, would drop it):
    the train step's reported loss and metrics read it. NumPy inputs and targets run on every
    route (PyTorch's ``vmap`` maps over tensors only: they are converted first)."""
    x, y, _ = _padded_tokens(rng)
    tokens = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(7, 4, mask_zero=True)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(7)(h))
    pex = pergrad.PerExample(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             strategy=strategy)
    result = pex.compute(x, y)
    mask = pergrad._compat.keras_mask(result.predictions)
    assert mask is not None
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(mask), x != 0)
