"""SimpleRNN, GRU and LSTM rules: the recomputed forward equals Keras's layer, and the per-example
quantities equal the float64 loop oracle's."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import zoo
from oracle import assert_close, keras_loss, loop_gradients
from rule_check import assert_rule_matches_oracle

import pergrad
from pergrad.engine.intercept import record_calls
from pergrad.rules import find_rule
from pergrad.rules.recurrent import recurrent_forward, recurrent_rule

L = keras.layers
B, T, FEATURES, UNITS, VOCABULARY = 4, 5, 2, 3, 7
LENGTHS = (5, 3, 1, 4)  # of the padded sequences: every example masks a different tail


def _randomize(layer, seed: int) -> None:
    """Random weights and biases (Keras's zero biases would hide a wrong bias gradient)."""
    rng = np.random.default_rng(seed)
    for v in layer.weights:
        v.assign(rng.normal(size=v.shape) * 0.6)


def _padded_ids(rng) -> np.ndarray:
    ids = rng.integers(1, VOCABULARY, size=(B, T))
    for i, n in enumerate(LENGTHS):
        ids[i, n:] = 0
    return ids


def _model(cls, masking: str | None, **kwargs):
    """``masking``: None (float inputs), "embedding" (ids, mask_zero) or "masking" (zero rows)."""
    rng = np.random.default_rng(3)
    if masking == "embedding":
        inputs = keras.Input((T,), dtype="int32")
        h = L.Embedding(VOCABULARY, FEATURES, mask_zero=True)(inputs)
        x = _padded_ids(rng)
    else:
        inputs = keras.Input((T, FEATURES))
        h = L.Masking(0.0)(inputs) if masking == "masking" else inputs
        x = rng.normal(size=(B, T, FEATURES))
        if masking == "masking":
            x[_padded_ids(rng) == 0] = 0.0
    layer = cls(UNITS, **kwargs)
    out = layer(h)
    if kwargs.get("return_state"):
        out = L.Concatenate()([L.Flatten()(out[0]) if kwargs.get("return_sequences") else out[0],
                               *out[1:]])
    elif kwargs.get("return_sequences"):
        out = L.Flatten()(out)  # drops the mask: masked steps' outputs reach the loss too
    model = keras.Model(inputs, L.Dense(3)(out))
    _randomize(layer, 5)
    return model, layer, recurrent_rule, x, rng.integers(0, 3, size=B)


CASES = [
    (L.SimpleRNN, None, {}),
    (L.SimpleRNN, "embedding", dict(return_sequences=True, activation="relu", use_bias=False)),
    (L.SimpleRNN, "masking", dict(return_sequences=True, zero_output_for_mask=True)),
    (L.LSTM, None, {}),
    (L.LSTM, None, dict(return_sequences=True, return_state=True, go_backwards=True)),
    (L.LSTM, "embedding", dict(use_bias=False, recurrent_activation="hard_sigmoid")),
    (L.LSTM, "masking", dict(go_backwards=True, return_state=True)),
    (L.GRU, None, dict(return_sequences=True)),
    (L.GRU, None, dict(reset_after=False, go_backwards=True)),
    (L.GRU, "embedding", dict(reset_after=False, use_bias=False, return_sequences=True)),
    (L.GRU, "masking", dict(go_backwards=True, return_state=True, activation="relu")),
    (L.GRU, "embedding", dict(use_bias=False)),
]


def _id(case) -> str:
    cls, masking, kwargs = case
    return "-".join([cls.__name__, masking or "plain", *(f"{k}={v}" for k, v in kwargs.items())])


@pytest.mark.filterwarnings("ignore:Layer 'flatten.*does not support masking:UserWarning")
@pytest.mark.parametrize(("cls", "masking", "kwargs"), CASES, ids=[_id(c) for c in CASES])
def test_rule_matches_loop_oracle(cls, masking, kwargs, float64):
    if keras.backend.backend() == "jax" and cls is L.SimpleRNN and masking is None:
        pytest.skip("Keras's own unmasked float64 SimpleRNN fails on JAX (its scan carry changes "
                    "dtype): no float64 loop oracle; test_forward_equals_keras checks float32")
    model, layer, rule, x, y = _model(cls, masking, **kwargs)
    if keras.backend.backend() == "jax" and kwargs.get("go_backwards"):
        # Keras's JAX loop returns go_backwards outputs in another order: the generic rule.
        pex = pergrad.PerExample(model, zoo.SCCE)
        assert layer in pex.plan.generic, pex.plan.describe()
        expected, _ = loop_gradients(model, keras_loss(zoo.SCCE), x, y)
        for g, e in zip(pex.gradients(x, y), expected, strict=True):
            assert_close(g, e)
        return
    assert_rule_matches_oracle(model, layer, rule, x, y)


def test_shared_layer_called_twice(float64):
    """Two calls of one layer: the sums over steps of both calls add up."""
    inputs = keras.Input((T, FEATURES))
    layer = L.GRU(UNITS)
    out = L.Concatenate()([layer(inputs), layer(L.Dense(FEATURES)(inputs))])
    model = keras.Model(inputs, L.Dense(3)(out))
    _randomize(layer, 6)
    rng = np.random.default_rng(4)
    assert_rule_matches_oracle(model, layer, recurrent_rule, rng.normal(size=(B, T, FEATURES)),
                               rng.integers(0, 3, size=B))


FORWARD_CASES = [(cls, kwargs) for cls in (L.SimpleRNN, L.GRU, L.LSTM) for kwargs in (
    {}, dict(return_sequences=True, go_backwards=True, return_state=True),
    dict(return_sequences=True, zero_output_for_mask=True), dict(reset_after=False))
    if "reset_after" not in kwargs or cls is L.GRU]


@pytest.mark.parametrize(("cls", "kwargs"), FORWARD_CASES)
def test_forward_equals_keras(cls, kwargs):
    """In float32, with pre- and post-padding masks and a given initial state: the recomputed
    outputs and states are Keras's own, and they are what the model computes while recorded."""
    rng = np.random.default_rng(8)
    layer = cls(UNITS, **kwargs)
    x = keras.ops.convert_to_tensor(rng.normal(size=(B, T, FEATURES)).astype("float32"))
    layer(x)
    if keras.backend.backend() == "jax" and kwargs.get("go_backwards"):
        assert find_rule(layer) is None  # the generic rule there: see recurrent._exact
        return
    _randomize(layer, 9)
    mask = np.ones((B, T), bool)
    mask[1, 3:], mask[2, :2], mask[3, 1:4] = False, False, False
    states = [keras.ops.convert_to_tensor(rng.normal(size=(B, UNITS)).astype("float32"))
              for _ in layer.state_size]
    as_mask = keras.ops.convert_to_tensor(mask)
    for call_kwargs in ({}, {"mask": as_mask}, {"mask": as_mask, "initial_state": states}):
        expected = layer(x, **call_kwargs)
        got, tapped, _ = recurrent_forward(layer, (x,), dict(call_kwargs))
        assert tapped.shape == (B, T, layer.cell.kernel.shape[1])
        for g, e in zip(keras.tree.flatten(got), keras.tree.flatten(expected), strict=True):
            assert_close(keras.ops.convert_to_numpy(g), keras.ops.convert_to_numpy(e),
                         rtol=1e-6, what=f"{call_kwargs.keys()}")

    inputs = keras.Input((T, FEATURES))
    model = keras.Model(inputs, layer(L.Masking(0.0)(inputs)))
    padded = np.array(keras.ops.convert_to_numpy(x))
    padded[~mask] = 0.0
    plan = pergrad.PerExample(model, "mse").plan
    with record_calls(plan) as calls:
        recorded = model(padded)
    assert calls[id(layer)][0].saved is not None  # the rule's forward ran
    for g, e in zip(keras.tree.flatten(recorded), keras.tree.flatten(model(padded)), strict=True):
        assert_close(keras.ops.convert_to_numpy(g), keras.ops.convert_to_numpy(e), rtol=1e-6)


class _OwnLoop(L.LSTM):
    def inner_loop(self, sequences, initial_state, mask, training=False):
        return super().inner_loop(sequences * 2.0, initial_state, mask, training)


GENERIC = {
    "dropout": lambda: L.LSTM(UNITS, dropout=0.2),
    "recurrent_dropout": lambda: L.GRU(UNITS, recurrent_dropout=0.2),
    "unroll": lambda: L.SimpleRNN(UNITS, unroll=True),
    "stateful": lambda: L.GRU(UNITS, stateful=True),
    "own_inner_loop": lambda: _OwnLoop(UNITS),
}


@pytest.mark.parametrize("name", sorted(GENERIC))
def test_layers_the_rule_cannot_reproduce_stay_generic(name):
    layer = GENERIC[name]()
    inputs = keras.Input(batch_shape=(B, T, FEATURES))
    model = keras.Model(inputs, L.Dense(3)(layer(inputs)))
    assert find_rule(layer) is None
    assert pergrad.PerExample(model, zoo.SCCE).plan.generic == [layer]


def test_frozen_input_kernel_stays_generic():
    layer = L.GRU(UNITS)
    layer(np.zeros((B, T, FEATURES), "float32"))
    assert find_rule(layer) is not None
    layer.cell.kernel.trainable = False
    assert find_rule(layer) is None


def test_mixed_float16_matches_the_float64_oracle():
    """Under mixed_float16 the rule's gradients are float32 and match a float64 twin within
    float16's precision."""
    previous, floatx = keras.config.dtype_policy(), keras.config.floatx()
    try:
        keras.config.set_dtype_policy("mixed_float16")
        model, _, _, x, y = _model(L.GRU, "masking", reset_after=False, return_state=True)
        pex = pergrad.PerExample(model, zoo.SCCE)
        assert not pex.plan.generic, pex.plan.describe()
        grads, norms = pex.gradients(x, y), pex.norms(x, y)
        keras.config.set_floatx("float64")
        keras.config.set_dtype_policy("float64")
        twin, _, _, _, _ = _model(L.GRU, "masking", reset_after=False, return_state=True)
        twin.set_weights([w.astype("float64") for w in model.get_weights()])
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(previous)
    expected, _ = loop_gradients(twin, keras_loss(zoo.SCCE), x, y)
    scale = max(np.max(np.abs(e)) for e in expected)
    for g, e, v in zip(grads, expected, model.trainable_variables, strict=True):
        assert keras.backend.standardize_dtype(g.dtype) == "float32"
        assert_close(g, e, atol=1e-2 * scale, what=v.path)
    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    assert_close(norms, np.linalg.norm(flat, axis=1), rtol=1e-2)
