"""Each private Keras/TensorFlow name behind ``pergrad._compat`` still means what pergrad needs,
on the installed Keras and TensorFlow."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from pergrad import _compat

L = keras.layers


def _nested():
    inner = keras.Sequential([keras.Input((3,)), L.Dense(4, name="inner_dense"),
                              L.Dropout(0.5, name="drop")], name="inner")
    inputs = keras.Input((3,))
    return keras.Model(inputs, L.Dense(2, name="head")(inner(inputs)), name="outer")


def test_layers_and_their_own_variables():
    model = _nested()
    names = [layer.name for layer in _compat.sublayers(model)]
    assert {"inner", "inner_dense", "drop", "head"} <= set(names) and "outer" not in names
    top = [layer.name for layer in _compat.sublayers(model, recursive=False)]
    assert "inner_dense" not in top and "inner" in top
    assert _compat.sublayers(model, include_self=True)[0] is model
    inner = model.get_layer("inner")
    assert _compat.own_trainable_variables(inner) == []  # its Dense owns them
    dense = inner.get_layer("inner_dense")
    assert {v.path for v in _compat.own_trainable_variables(dense)} == {
        dense.kernel.path, dense.bias.path}
    dense.bias.trainable = False
    assert _compat.own_trainable_variables(dense) == [dense.kernel]


def test_seed_generators_and_training_argument():
    model = _nested()
    assert _compat.owns_seed_generator(model.get_layer("inner").get_layer("drop"))
    assert not _compat.owns_seed_generator(model.get_layer("head"))
    assert _compat.call_takes_training(model)

    class NoTraining(keras.Model):
        def call(self, x):
            return x

    assert not _compat.call_takes_training(NoTraining())


def test_autocast_scope_casts_variables():
    assert _compat.AutocastScope is not None
    v = keras.Variable(np.ones(2, "float32"))
    with _compat.AutocastScope("float16"):
        assert keras.ops.convert_to_tensor(v).dtype == "float16"
    assert keras.ops.convert_to_tensor(v).dtype == "float32"


def test_compiled_loss_and_loss_tracker():
    model = keras.Sequential([keras.Input((3,)), L.Dense(2, kernel_regularizer="l2")])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    pred = model(x)
    kernel = model.layers[0].kernel.numpy()
    expected = float(np.mean(np.square(pred))) + 0.01 * float(np.sum(kernel ** 2))
    assert np.isclose(float(_compat.compiled_loss(model, x, y, pred, None)), expected, rtol=1e-6)
    assert isinstance(_compat.loss_tracker(model), keras.metrics.Mean)


def test_backing_variable_graph_and_untracked_attributes():
    v = keras.Variable(np.zeros(3, "float32"))
    assert isinstance(_compat.backing_tf_variable(v), tf.Variable)
    eager = _compat.current_graph()

    @tf.function
    def traced():
        return _compat.current_graph() is eager

    assert not bool(traced())
    layer = L.Dense(2)
    layer.build((None, 3))
    _compat.set_untracked(layer, "call", lambda x: x)
    assert layer.call(5) == 5
    _compat.delete_untracked(layer, "call")
    assert "call" not in layer.__dict__
    meta = _compat.summary_metadata("scalars")
    assert meta.plugin_data.plugin_name == "scalars"


def test_tracing_for_xla_inside_jit_compile_and_its_branches():
    seen = {}

    def record(name):
        seen[name] = _compat.tracing_for_xla()
        return tf.constant(1.0)

    @tf.function(jit_compile=True)
    def compiled(flag):
        record("compiled")
        return tf.cond(flag, lambda: record("branch"), lambda: tf.constant(0.0))

    @tf.function
    def plain(flag):
        record("plain")
        return tf.cond(flag, lambda: record("plain branch"), lambda: tf.constant(0.0))

    compiled(tf.constant(True))
    plain(tf.constant(True))
    assert seen == {"compiled": True, "branch": True, "plain": False, "plain branch": False}
    assert not _compat.tracing_for_xla()  # eager


@pytest.mark.all_backends
def test_held_value_and_autocast_scope():
    v = keras.Variable(np.arange(3, dtype="float32"))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(_compat.held_value(v)), [0, 1, 2])
    mixed = L.Dense(2, dtype="mixed_float16")
    mixed.build((None, 3))
    with _compat.autocast_scope(mixed):
        assert keras.backend.standardize_dtype(mixed.kernel.value.dtype) == "float16"
    plain = L.Dense(2)
    plain.build((None, 3))
    with _compat.autocast_scope(plain):
        assert keras.backend.standardize_dtype(plain.kernel.value.dtype) == "float32"


@pytest.mark.all_backends
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="Keras's torch convolution")
def test_torch_convolutions_run_under_vmap_in_their_scope():
    import torch
    from keras.src.backend.torch import nn as torch_nn

    original = torch_nn._maybe_convert_to_channels_last
    layer = L.Conv2D(3, 2)
    x = keras.ops.convert_to_tensor(np.random.default_rng(0).normal(size=(2, 4, 4, 2)),
                                    "float32")
    layer(x)
    tangents = torch.eye(x.numel()).reshape(x.numel(), *x.shape)[:5]

    def column(t):
        return torch.func.jvp(layer, (x,), (t,))[1]

    expected = torch.stack([column(t) for t in tangents])
    with _compat.torch_convolutions_in_vmap(), _compat.torch_convolutions_in_vmap():
        got = torch.func.vmap(column)(tangents)  # nested scopes: restored once, at the end
    assert torch_nn._maybe_convert_to_channels_last is original
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), atol=1e-6)


def test_row_squared_norms_and_their_gradient_on_every_route():
    """``backend.ops.row_squared_norms``: TensorFlow's one-pass ``EuclideanNorm`` route (plain
    ``tf.function``) and the summed squares (``jit_compile=True``, where XLA has no
    ``EuclideanNorm``) against NumPy in float64, and the gradient ``2 t``, finite at a zero row
    (the square of a square root would give NaN there)."""
    from pergrad.backend.ops import row_squared_norms

    t = np.random.default_rng(0).normal(size=(4, 3, 5))
    t[2] = 0.0
    expected = np.sum(t.reshape(4, -1) ** 2, axis=1)
    for jit in (False, True):
        @tf.function(jit_compile=jit)
        def norms_and_gradient(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                squared = row_squared_norms(x)
                total = tf.reduce_sum(squared * tf.range(1.0, 5.0, dtype=x.dtype))
            return squared, tape.gradient(total, x)

        squared, gradient = norms_and_gradient(tf.constant(t))
        np.testing.assert_allclose(squared.numpy(), expected, rtol=1e-12)
        np.testing.assert_allclose(gradient.numpy(),
                                   2 * t * np.arange(1.0, 5.0)[:, None, None], rtol=1e-12)
