"""Each private Keras/TensorFlow name behind ``pergrad._compat`` still means what pergrad needs,
on the installed Keras and TensorFlow."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from pergrad import _compat
from pergrad.backend.lazy import tensorflow as tf  # on first use: TensorFlow may be absent

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


def test_every_layer_built_looks_inside_nested_layers():
    class Holder(keras.layers.Layer):  # built, but its sublayer builds on first call only
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(2)

        def build(self, input_shape):
            self.built = True

        def call(self, x):
            return self.inner(x)

    inner = keras.Sequential([keras.layers.Dense(2)])
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1)])
    assert _compat.every_layer_built(outer)
    holder = Holder()
    holder.build((None, 3))
    assert holder.built and not holder.inner.built
    assert not _compat.every_layer_built(holder)


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
        assert keras.backend.standardize_dtype(keras.ops.convert_to_tensor(v).dtype) == "float16"
    assert keras.backend.standardize_dtype(keras.ops.convert_to_tensor(v).dtype) == "float32"


def test_compiled_loss_and_loss_tracker():
    model = keras.Sequential([keras.Input((3,)), L.Dense(2, kernel_regularizer="l2")])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    pred = model(x)
    kernel = keras.ops.convert_to_numpy(model.layers[0].kernel)
    expected = (float(np.mean(np.square(keras.ops.convert_to_numpy(pred))))
                + 0.01 * float(np.sum(kernel ** 2)))
    loss = keras.ops.convert_to_numpy(_compat.compiled_loss(model, x, y, pred, None))
    assert np.isclose(float(loss), expected, rtol=1e-6)
    assert isinstance(_compat.loss_tracker(model), keras.metrics.Mean)
    assert _compat.compiled_metrics(model) is None
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    assert isinstance(_compat.compiled_metrics(model), keras.metrics.Metric)


def test_update_compiled_metrics_weights_the_unweighted_metrics_by_the_given_rows():
    """Keras gives ``metrics=`` no weight and ``weighted_metrics=`` the sample weight; the helper
    gives the first a row mask (padding rows left out) and the second the sample weight."""
    model = keras.Sequential([keras.Input((3,)), L.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"], weighted_metrics=["mse"])
    y_pred = np.array([[1.0, 1.0], [2.0, 2.0], [5.0, 5.0], [9.0, 9.0]], "float32")
    y_true = np.zeros((4, 2), "float32")
    rows = np.array([1.0, 1.0, 1.0, 0.0], "float32")  # the last row is padding
    weight = np.array([1.0, 2.0, 1.0, 0.0], "float32")
    container = _compat.compiled_metrics(model)
    _compat.update_compiled_metrics(container, y_true, y_pred, weight, rows)
    got = {k: float(keras.ops.convert_to_numpy(v)) for k, v in model.get_metrics_result().items()}
    assert got["mae"] == pytest.approx((1 + 2 + 5) / 3)  # the padding row (9) left out
    assert got["mse"] == pytest.approx((1 + 2 * 4 + 25) / 4)  # Keras: sum w_i l_i / sum w_i


@pytest.mark.tensorflow_only(reason=(
    "the tf.Variable behind a Keras variable, the tf.function graph, TensorBoard's "
    "SummaryMetadata (TensorFlow's private names)"))
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


@pytest.mark.tensorflow_only(reason=(
    "TensorFlow's XLA context: tf.function(jit_compile=True) and its tf.cond branches"))
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


def test_keras_mask_of_padding_and_ignored_labels():
    tokens = np.array([[3, 1, 0, 0], [2, 0, 0, 0]], "int32")
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(tokens)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(_compat.keras_mask(embedded)),
                                  tokens != 0)
    assert _compat.keras_mask(keras.ops.ones((2, 3))) is None
    plain = keras.ops.ones((2, 4))
    _compat.set_keras_mask(plain, keras.ops.convert_to_tensor(tokens != 0))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(_compat.keras_mask(plain)),
                                  tokens != 0)


def test_micro_steps_counts_every_apply_under_gradient_accumulation():
    variable = keras.Variable(np.ones(3, "float32"))
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
    optimizer.build([variable])
    for _ in range(4):
        optimizer.apply([keras.ops.ones(3)], [variable])
    assert int(keras.ops.convert_to_numpy(_compat.micro_steps(optimizer))) == 4
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 1  # the updates


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


@pytest.mark.tensorflow_only(reason=(
    "TensorFlow's routes of row_squared_norms: the EuclideanNorm kernel in a tf.function, summed "
    "squares under jit_compile=True, their tf.GradientTape gradient"))
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


def _must_compile_calls(graph) -> int:
    """Calls in ``graph`` (its own ops, not those of functions it calls) of a function XLA must
    compile (a nested ``jit_compile=True``), read from the ``GraphDef`` and its library."""
    graph_def = graph.as_graph_def()
    must_compile = {f.signature.name for f in graph_def.library.function
                    if f.attr["_XlaMustCompile"].b}
    return sum(node.op in ("PartitionedCall", "StatefulPartitionedCall")
               and node.attr["f"].func.name in must_compile for node in graph_def.node)


@pytest.mark.tensorflow_only(reason=(
    "TensorFlow's routes of outer_products: a nested jit_compile=True call in tf.function graphs "
    "(counted in the GraphDef), tf.cond branches and tapes"))
def test_outer_products_on_every_route():
    """``backend.ops.outer_products``: eagerly, in a plain ``tf.function`` with a dynamic batch
    (a nested XLA computation there: the graph holds one must-compile call), in a ``tf.cond``
    branch, under ``jit_compile=True`` (plain ops, no nested call) and through a tape, against
    NumPy's outer products exactly (one product per number, no rounding to differ)."""
    from pergrad.backend.ops import outer_products

    rng = np.random.default_rng(0)
    for dtype in ("float32", "float64"):
        a = rng.normal(size=(5, 7, 2)).astype(dtype)
        d = rng.normal(size=(5, 2, 3)).astype(dtype)
        expected = np.einsum("big,bgo->bigo", a, d)
        spec = [tf.TensorSpec((None, 7, 2), dtype), tf.TensorSpec((None, 2, 3), dtype)]
        plain = tf.function(outer_products, input_signature=spec)
        in_branch = tf.function(lambda a, d: tf.cond(tf.shape(a)[0] > 0,
                                                     lambda: outer_products(a, d),
                                                     lambda: tf.zeros([0, 7, 2, 3], a.dtype)),
                                input_signature=spec)
        compiled = tf.function(outer_products, jit_compile=True)
        for route in (outer_products, plain, in_branch, compiled):
            np.testing.assert_array_equal(route(tf.constant(a), tf.constant(d)).numpy(),
                                          expected)
        assert _must_compile_calls(plain.get_concrete_function().graph) == 1
        assert _must_compile_calls(compiled.get_concrete_function(a, d).graph) == 0

        @tf.function
        def gradient(a, d):
            with tf.GradientTape() as tape:
                tape.watch(a)
                total = tf.reduce_sum(outer_products(a, d))
            return tape.gradient(total, a)

        np.testing.assert_allclose(gradient(tf.constant(a), tf.constant(d)).numpy(),
                                   np.broadcast_to(d.sum(-1)[:, None, :], a.shape),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.tensorflow_only(reason=(
    "TensorFlow's routes of segment_sum: a nested jit_compile=True call in tf.function graphs "
    "(counted in the GraphDef) and tf.cond branches"))
def test_segment_sum_on_every_route():
    """``backend.ops.segment_sum``: eagerly, in a plain ``tf.function`` whose number of segments
    is a tensor of a dynamic batch (a nested XLA computation: one must-compile call), in a
    ``tf.cond`` branch and under ``jit_compile=True`` (plain ops), against NumPy in float64,
    repeated segments and empty ones included."""
    from pergrad.backend.ops import segment_sum

    rng = np.random.default_rng(1)
    values = rng.normal(size=(12, 3))
    segments = np.array([0, 4, 4, 1, 9, 0, 4, 7, 7, 7, 2, 0], dtype="int32")
    expected = np.zeros((10, 3))
    np.add.at(expected, segments, values)
    spec = [tf.TensorSpec((None, 3), tf.float64), tf.TensorSpec((None,), tf.int32)]

    def per_batch(v, s):  # 10 segments, counted from the dynamic leading size as a tensor
        return segment_sum(v, s, tf.shape(v)[0] - 2)

    plain = tf.function(per_batch, input_signature=spec)
    in_branch = tf.function(lambda v, s: tf.cond(tf.shape(v)[0] > 0, lambda: per_batch(v, s),
                                                 lambda: tf.zeros([0, 3], tf.float64)),
                            input_signature=spec)
    compiled = tf.function(lambda v, s: segment_sum(v, s, 10), jit_compile=True)
    for route in (lambda v, s: segment_sum(v, s, 10), plain, in_branch, compiled):
        np.testing.assert_allclose(route(tf.constant(values), tf.constant(segments)).numpy(),
                                   expected, rtol=1e-12)
    assert _must_compile_calls(plain.get_concrete_function().graph) == 1
    assert _must_compile_calls(
        compiled.get_concrete_function(tf.constant(values), tf.constant(segments)).graph) == 0


@pytest.mark.tensorflow_only(reason=(
    "pergrad.backend.tensorflow.ops' fallback where TensorFlow cannot run nested XLA, read from "
    "tf.function graphs"))
def test_plain_ops_where_nested_xla_does_not_run(monkeypatch):
    """Where TensorFlow cannot compile a nested ``jit_compile=True`` function (a build or device
    plugin without XLA), ``outer_products`` and ``segment_sum`` stay plain ops with the same
    numbers; here XLA runs, which the probe says."""
    from pergrad.backend.tensorflow import ops as backend_ops

    assert backend_ops._nested_xla_runs()
    monkeypatch.setattr(backend_ops, "_nested_xla_runs", lambda: False)
    a, d = np.ones((2, 3, 1)), np.full((2, 1, 4), 2.0)
    outer = tf.function(backend_ops.outer_products)
    sums = tf.function(lambda v, s: backend_ops.segment_sum(v, s, 3))
    np.testing.assert_array_equal(outer(tf.constant(a), tf.constant(d)).numpy(),
                                  np.full((2, 3, 1, 4), 2.0))
    np.testing.assert_array_equal(
        sums(tf.constant(a[:, :, 0]), tf.constant([2, 0])).numpy(),
        [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert _must_compile_calls(outer.get_concrete_function(tf.constant(a), tf.constant(d)).graph) == 0
    assert _must_compile_calls(sums.get_concrete_function(
        tf.constant(a[:, :, 0]), tf.constant([2, 0])).graph) == 0


@pytest.mark.tensorflow_only(reason=(
    "TensorFlow's oneDNN switch (TF_ENABLE_ONEDNN_OPTS) in a subprocess"))
def test_onednn_enabled_is_tensorflows_answer_and_follows_its_switch():
    import os
    import subprocess
    import sys

    assert isinstance(_compat.onednn_enabled(), bool)
    code = "from pergrad import _compat; print(_compat.onednn_enabled())"
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_is_keras_variable_knows_a_layers_variables():
    """A layer's variables are Keras variables on every Keras pyproject allows (on Keras 3.5
    they are not instances of the exported ``keras.Variable``, and ``jvp``/``vjp``/``hvp`` with
    them as primals returned zeros there); tensors and arrays are not."""
    from pergrad._compat import is_keras_variable

    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert is_keras_variable(layer.kernel) and is_keras_variable(keras.Variable(1.0))
    assert not is_keras_variable(keras.ops.ones((2,))) and not is_keras_variable(np.ones(2))

