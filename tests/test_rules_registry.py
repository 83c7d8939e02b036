"""The public rule registry, the ``Form`` protocol and the ghost-vs-materialize cost model."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from oracle import TORCH_FLOAT64_RTOL, keras_loss, loop_gradients

import pergrad
from pergrad.rules import cost, find_rule, register, registered_layer_classes
from pergrad.rules.forms import Factored, Form, Materialized, Rows, Scaled


def test_one_rule_for_several_classes():
    class ScaleA(keras.layers.Layer):
        def call(self, x):
            return x

    class ScaleB(ScaleA):
        def call(self, x):
            return 2 * x

    @register(ScaleA, ScaleB)
    def rule(layer, call, grad):
        return []

    assert {ScaleA, ScaleB} <= set(registered_layer_classes())
    assert find_rule(ScaleA()).fn is rule and find_rule(ScaleB()).fn is rule
    with pytest.raises(TypeError, match="at least one layer class"):
        register()
    with pytest.raises(TypeError, match="takes layer classes"):
        register(ScaleA())


def test_builtin_forms_satisfy_the_form_protocol():
    variable = keras.Variable(np.zeros((3, 2), "float32"))
    a, d = np.ones((4, 5, 1, 3), "float32"), np.ones((4, 5, 1, 2), "float32")
    forms = [Factored(variable, a, d, (3, 1, 2)), Materialized(variable, np.zeros((4, 3, 2))),
             Rows(variable, np.zeros((4, 5), "int32"), np.ones((4, 5, 2), "float32"))]
    forms.append(Scaled(forms[0], 2.0))
    assert all(isinstance(form, Form) for form in forms)
    assert not isinstance(object(), Form)


def test_cost_model_counts_multiply_adds():
    # T = 9, I = O = 64 (a 3x3 convolution, 64 channels): ghost 2 * 81 * 128 = 20,736 against
    # 9 * 64 * 64 + 64 * 64 = 40,960 materialized: ghost.
    assert cost.ghost_cost(9, 64, 64) == 81 * 128
    assert cost.materialized_cost(9, 64, 64) == 9 * 64 * 64 + 64 * 64
    assert cost.prefers_ghost(9, 64, 64)
    # T = 196, I = 64, O = 16 (a first convolution): the T^2 term dominates: materialize.
    assert not cost.prefers_ghost(196, 64, 16)
    # Unknown positions always materialize (the ghost cost grows without bound in T).
    assert not cost.prefers_ghost(None, 64, 64) and not cost.prefers_ghost(-1, 64, 64)
    # Gram matrices over B examples: B^2 T^2 (I + O) against B T I O + B^2 I O.
    assert cost.ghost_cost(9, 64, 64, batch=8, pairs=True) == 64 * 81 * 128
    assert cost.materialized_cost(9, 64, 64, batch=8, pairs=True) == 8 * 9 * 4096 + 64 * 4096
    assert not cost.prefers_ghost(9, 64, 64, batch=8, pairs=True)  # 1.33M vs 557k
    assert cost.prefers_ghost(2, 512, 512, batch=8, pairs=True)


@pytest.mark.parametrize("positions", [2, 30])  # a ghost and a materialized layer
def test_both_routes_give_the_same_norms_and_gram(positions, float64, rng):
    model = keras.Sequential([keras.Input((positions, 24)), keras.layers.Dense(24),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    x = rng.normal(size=(6, positions, 24))
    y = rng.integers(0, 3, size=6)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pex = pergrad.PerExample(model, loss)
    expected, _ = loop_gradients(model, keras_loss(loss), x, y)  # the float64 loop oracle
    flat = np.concatenate([np.reshape(np.asarray(g), (6, -1)) for g in expected], axis=1)
    # Keras's torch backend multiplies float64 tensors in float32 (tests/oracle.py).
    rtol = TORCH_FLOAT64_RTOL if keras.backend.backend() == "torch" else 1e-9
    np.testing.assert_allclose(keras.ops.convert_to_numpy(pex.norms(x, y)),
                               np.linalg.norm(flat, axis=1), rtol=rtol)
    result = pex.compute(x, y)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(result.gram()), flat @ flat.T,
                               rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("positions", [8, cost.ROWS_PAIRWISE_MAX_POSITIONS + 2])
def test_embedding_norms_count_repeated_ids_on_every_route(positions, float64, rng):
    """Rows norms (pairwise on JAX up to ROWS_PAIRWISE_MAX_POSITIONS and on TensorFlow up to
    ROWS_PAIRWISE_MAX_POSITIONS_TENSORFLOW; beyond, sorted on JAX and PyTorch, tf.unique on
    TensorFlow) against the squared materialized rows; ids repeat within examples."""
    variable = keras.Variable(np.zeros((12, 3)))
    ids = rng.integers(0, 12, size=(5, positions)).astype("int32")
    d = rng.normal(size=(5, positions, 3))
    form = Rows(variable, keras.ops.convert_to_tensor(ids), keras.ops.convert_to_tensor(d))
    dense = np.zeros((5, 12, 3))
    for i in range(5):
        np.add.at(dense[i], ids[i], d[i])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(form.squared_norms()),
                               np.sum(dense ** 2, axis=(1, 2)), rtol=1e-5)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(form.materialize()), dense,
                               rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_embedding_weighted_sum_adds_repeated_ids_on_every_route(id_dtype, float64, rng,
                                                                  monkeypatch):
    """``Rows.weighted_sum`` (a clipped or DP sum's embedding table) against NumPy: ids repeat
    within and across examples, and coefficients weigh the examples. It adds the rows with
    ``backend.ops.segment_sum`` on every backend; on TensorFlow a traced sum is one nested XLA
    computation, and under ``jit_compile=True`` plain ops."""
    from pergrad.rules import forms

    calls, segment_sum = [], forms.segment_sum

    def counted(*args):
        calls.append(args)
        return segment_sum(*args)

    monkeypatch.setattr(forms, "segment_sum", counted)
    variable = keras.Variable(np.zeros((12, 3)))
    ids = rng.integers(0, 12, size=(5, 9)).astype(id_dtype)
    ids[:, 1] = ids[:, 0]  # a repeat within every example
    d = rng.normal(size=(5, 9, 3))
    c = rng.normal(size=5)
    expected = np.zeros((12, 3))
    np.add.at(expected, ids.ravel(), (d * c[:, None, None]).reshape(-1, 3))

    def weighted_sum(ids, d, c):
        return Rows(variable, ids, d).weighted_sum(c)

    tensors = [keras.ops.convert_to_tensor(t) for t in (ids, d, c)]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(weighted_sum(*tensors)), expected,
                               rtol=1e-12, atol=1e-12)
    assert len(calls) == 1
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        from test_compat import _must_compile_calls

        plain, compiled = tf.function(weighted_sum), tf.function(weighted_sum, jit_compile=True)
        for route in (plain, compiled):
            np.testing.assert_allclose(route(*tensors).numpy(), expected, rtol=1e-12, atol=1e-12)
        assert _must_compile_calls(plain.get_concrete_function(*tensors).graph) == 1
        assert _must_compile_calls(compiled.get_concrete_function(*tensors).graph) == 0
