"""``PerExampleModel``: Keras behaviour, closed forms, equality with plain Keras, bad inputs."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
from pergrad import aggregate
from pergrad.keras import INDEX_KEY, PerExampleModel


def _mlp(regularizer=None, outputs=3):
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer),
        keras.layers.Dense(outputs),
    ])


def _twin(model):
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def _assert_weights_close(a, b, rtol=1e-5):
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(wa, wb, rtol=rtol, atol=rtol * max(1.0, np.abs(wb).max()))


# -- closed form ------------------------------------------------------------------------------------

@pytest.mark.parametrize("clip", [10.0, 40.0, 200.0])
def test_closed_form_clip_without_bias(clip):
    """Dense(1, use_bias=False) at 0, x=[3, 4], y=15, MSE: g = -2*15*[3, 4] = -[90, 120],
    ||g|| = 150 (not 153), so one SGD(0.01) step gives w = 0.01*[90, 120]*min(1, C/150)."""
    inner = keras.Sequential([keras.Input((2,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model = PerExampleModel(inner, aggregate.clip_mean(clip))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(np.array([[3.0, 4.0]]), np.array([15.0]), epochs=1, verbose=0)
    expected = 0.01 * np.array([90.0, 120.0]) * min(1.0, clip / 150.0)
    np.testing.assert_allclose(inner.get_weights()[0].ravel(), expected, rtol=1e-6)


@pytest.mark.parametrize("clip", [10.0, 40.0, 200.0])
def test_closed_form_clip_with_bias(clip):
    """With a bias: g = -30*[3, 4, 1], ||g|| = 30 sqrt(26) = 152.97 (the issue's "153"); the step
    is w = 0.01*[90, 120]*f, b = 0.01*30*f with f = min(1, C / (30 sqrt(26)))."""
    inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model = PerExampleModel(inner, aggregate.clip_mean(clip))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(np.array([[3.0, 4.0]]), np.array([15.0]), epochs=1, verbose=0)
    factor = min(1.0, clip / (30 * np.sqrt(26)))
    kernel, bias = inner.get_weights()
    np.testing.assert_allclose(kernel.ravel(), 0.01 * np.array([90.0, 120.0]) * factor, rtol=1e-6)
    np.testing.assert_allclose(bias, [0.3 * factor], rtol=1e-6)


# -- equality with plain Keras ----------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mean_training_equals_plain_keras(rng, optimizer):
    x = rng.normal(size=(40, 6)).astype("float32")
    y = rng.integers(0, 3, size=40)
    w = rng.uniform(0.2, 2.0, size=40).astype("float32")
    keras.utils.set_random_seed(0)
    inner = _mlp(regularizer=keras.regularizers.L2(0.01))
    plain = _twin(inner)
    model = PerExampleModel(inner)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.get(optimizer), loss=loss, metrics=["accuracy"])
    plain.compile(optimizer=keras.optimizers.get(optimizer), loss=loss, metrics=["accuracy"])
    h1 = model.fit(x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False, verbose=0)
    h2 = plain.fit(x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_weights_close(inner, plain)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h1.history["accuracy"], h2.history["accuracy"])
    assert h1.history["dropped_examples"] == [0.0, 0.0]
    e1, e2 = model.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0)
    np.testing.assert_allclose(e1[:1], e2[:1], rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_class_weight_equals_plain_keras(rng):
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, size=32)
    inner = _mlp()
    plain = _twin(inner)
    model = PerExampleModel(inner)
    for m in (model, plain):
        m.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(x, y, class_weight={0: 1.0, 1: 3.0, 2: 0.5}, batch_size=8, epochs=1,
              shuffle=False, verbose=0)
    _assert_weights_close(inner, plain)


def test_multi_output_dict_losses_equal_plain_keras(rng):
    inputs = keras.Input((6,), name="x")
    hidden = keras.layers.Dense(5, activation="relu")(inputs)
    outputs = {"a": keras.layers.Dense(2, name="a")(hidden),
               "b": keras.layers.Dense(1, name="b")(hidden)}
    inner = keras.Model(inputs, outputs)
    plain = _twin(inner)
    model = PerExampleModel(inner)
    x = rng.normal(size=(24, 6)).astype("float32")
    y = {"a": rng.normal(size=(24, 2)).astype("float32"),
         "b": rng.normal(size=(24, 1)).astype("float32")}
    for m in (model, plain):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss={"a": "mse", "b": "mae"},
                  loss_weights={"a": 1.0, "b": 0.3})
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_weights_close(inner, plain)


def test_sequence_output_loss_is_averaged_like_keras(rng):
    """Outputs (B, T, C): Keras averages the loss over T too; so must the per-example loss."""
    inner = keras.Sequential([keras.Input((4, 3)), keras.layers.Dense(2)])
    plain = _twin(inner)
    model = PerExampleModel(inner)
    x = rng.normal(size=(12, 4, 3)).astype("float32")
    y = rng.normal(size=(12, 4, 2)).astype("float32")
    for m in (model, plain):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_weights_close(inner, plain)


# -- the reported loss ------------------------------------------------------------------------------

def _reported_and_keras_loss(inner, x, y, loss, sample_weight=None, **compile_args):
    """``(model, [its loss, Keras's loss], its logs)``: the loss ``train_on_batch`` reports for a
    ``PerExampleModel`` and for plain Keras, on the same weights and batch (both report the loss
    before the update)."""
    plain = _twin(inner)
    model = PerExampleModel(inner)
    logs = []
    for m in (model, plain):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, **compile_args)
        logs.append(m.train_on_batch(x, y, sample_weight=sample_weight, return_dict=True))
    assert set(logs[0]) == set(logs[1]) | {"dropped_examples"}
    return model, [float(entry["loss"]) for entry in logs], logs[0]


def test_reported_loss_from_per_example_losses_is_keras_loss(rng):
    """No mask, no metrics: the step reads ``sum_i w_i l_i / B + regularization`` from the
    engine's per-example losses instead of running the compiled loss again; Keras's value."""
    x = rng.normal(size=(10, 6)).astype("float32")
    y = rng.integers(0, 3, size=10)
    w = rng.uniform(0.2, 2.0, size=10).astype("float32")
    model, (ours, keras_loss), _ = _reported_and_keras_loss(
        _mlp(regularizer=keras.regularizers.L2(0.05)), x, y,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), sample_weight=w)
    np.testing.assert_allclose(ours, keras_loss, rtol=1e-6)
    result = model.per_example().compute(x, y, w)
    assert pergrad.keras.step.loss_from_per_example_losses(model, result) is not None


def test_reported_loss_of_weighted_sequence_outputs_is_keras_loss(rng):
    """Two outputs, one a sequence ``(B, T, F)``, with ``loss_weights``: Keras averages each
    output's loss over its own elements, then weights and adds them, and logs each output's
    loss besides; so does the step."""
    inputs = keras.Input((4, 3))
    outputs = [keras.layers.Dense(2)(inputs),
               keras.layers.Dense(1)(keras.layers.Flatten()(inputs))]
    x = rng.normal(size=(8, 4, 3)).astype("float32")
    y = [rng.normal(size=(8, 4, 2)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")]
    model, (ours, keras_loss), logs = _reported_and_keras_loss(
        keras.Model(inputs, outputs), x, y, ["mse", "mae"], loss_weights=[0.7, 2.0])
    np.testing.assert_allclose(ours, keras_loss, rtol=1e-6)
    assert len(logs) == 4  # loss, each output's loss, dropped_examples


@pytest.mark.parametrize("metrics", [None, ["sparse_categorical_accuracy"]])
def test_reported_masked_loss_is_keras_batch_wide_mean(rng, metrics):
    """Padding of unequal lengths: each example's own loss is the mean over its valid tokens,
    but Keras reports the sum over the batch's valid tokens divided by their count; the step
    reports Keras's (the engine's mean of means would differ), and the compiled metrics count
    the valid tokens only."""
    vocabulary, steps = 7, 5
    tokens = keras.Input((steps,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 4, mask_zero=True)(tokens)
    inner = keras.Model(tokens, keras.layers.Dense(vocabulary)(h))
    x = rng.integers(1, vocabulary, size=(6, steps)).astype("int32")
    for i, n in enumerate([1, 2, 5, 3, 5, 4]):
        x[i, n:] = 0
    y = np.roll(x, -1, axis=1)
    predicted = keras.ops.convert_to_numpy(inner(x)).argmax(-1)
    model, (ours, keras_loss), logs = _reported_and_keras_loss(
        inner, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics)
    np.testing.assert_allclose(ours, keras_loss, rtol=1e-6)
    # Over the valid tokens only (Keras's own JAX step drops the mask here). Keras 3.5's
    # compiled metrics do not read the mask at all (seen on 3.5, the oldest pair CI runs; 3.15
    # reads it): there the metric counts every token.
    masked_metrics = tuple(int(v) for v in keras.__version__.split(".")[:2]) >= (3, 15)
    if metrics and masked_metrics:
        np.testing.assert_allclose(float(logs["sparse_categorical_accuracy"]),
                                   (predicted == y)[x != 0].mean(), rtol=1e-6)
    mean_of_means = float(keras.ops.mean(model.per_example().compute(x, y).losses))
    assert abs(mean_of_means - keras_loss) > 1e-3  # the case where the fallback matters
    assert pergrad.keras.step.loss_from_per_example_losses(
        model, model.per_example().compute(x, y)) is None


# -- Keras surface ----------------------------------------------------------------------------------

def test_keras_surface_and_inner_model(rng):
    inner = _mlp()
    model = PerExampleModel(inner, aggregate.clip_mean(1.0))
    assert model.model is inner
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x = rng.normal(size=(20, 6)).astype("float32")
    y = rng.normal(size=(20, 3)).astype("float32")
    history = model.fit(x, y, batch_size=5, epochs=2, validation_split=0.25, verbose=0)
    assert set(history.history) >= {"loss", "mae", "val_loss", "val_mae", "dropped_examples"}
    assert model.predict(x, verbose=0).shape == (20, 3)
    assert len(model.evaluate(x, y, verbose=0)) >= 2
    lines = []
    model.summary(print_fn=lambda line, **kw: lines.append(line))
    assert any("sequential" in line.lower() for line in lines)


def test_save_load_round_trip(rng, tmp_path):
    inner = _mlp()
    model = PerExampleModel(inner, aggregate.dp_mean(1.0, 0.5, seed=3, expected_batch_size=10))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x = rng.normal(size=(20, 6)).astype("float32")
    y = rng.normal(size=(20, 3)).astype("float32")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, PerExampleModel)
    assert loaded.aggregator.name == "dp_mean"
    assert loaded.aggregator.config == model.aggregator.config
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # Adam state restored
    loaded.fit(x, y, batch_size=10, epochs=1, verbose=0)  # compiled state restored
    assert all(np.isfinite(w).all() for w in loaded.get_weights())


# -- monitor contract -------------------------------------------------------------------------------

class FakeMonitor(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen_indices = []
        self.began = 0

    def on_train_begin(self, logs=None):
        self.began += 1

    def compute(self, result, indices=None, sample_weight=None):
        assert isinstance(result, pergrad.PerExampleResult)
        self.seen_indices.append(indices)
        stats = {"mean_norm": keras.ops.mean(result.norms())}
        if indices is not None:
            stats["index_sum"] = keras.ops.cast(keras.ops.sum(indices), "float32")
        return stats


def test_monitor_contract_and_index_key(rng):
    monitor = FakeMonitor()
    inner = _mlp()
    model = PerExampleModel(inner, monitor=monitor)
    model.compile(optimizer="sgd", loss="mse")
    x = rng.normal(size=(12, 6)).astype("float32")
    y = rng.normal(size=(12, 3)).astype("float32")
    history = model.fit({"features": x, INDEX_KEY: np.arange(12)}, y, batch_size=12, epochs=2,
                        shuffle=False, verbose=0)
    assert monitor.began == 1  # fit added the monitor as a callback
    assert history.history["index_sum"] == [66.0, 66.0]
    expected = pergrad.PerExample(_twin(inner), "mse").norms(x, y)  # after training: just finite
    assert np.isfinite(history.history["mean_norm"]).all() and expected.shape == (12,)
    history = model.fit(x, y, batch_size=6, epochs=1, callbacks=[monitor], verbose=0)
    assert monitor.began == 2 and "index_sum" not in history.history
    assert monitor.seen_indices[-1] is None


def test_monitor_norms_match_engine(rng):
    monitor = FakeMonitor()
    inner = _mlp()
    reference = pergrad.PerExample(_twin(inner), "mse", training=True)
    model = PerExampleModel(inner, monitor=monitor)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x = rng.normal(size=(8, 6)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    np.testing.assert_allclose(history.history["mean_norm"][0],
                               float(np.mean(keras.ops.convert_to_numpy(reference.norms(x, y)))),
                               rtol=1e-5)


# -- NaN handling -----------------------------------------------------------------------------------

def test_nan_example_is_dropped_and_counted(rng):
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    x[5, 2] = np.nan
    inner = _mlp()
    plain = _twin(inner)
    model = PerExampleModel(inner)  # mean: the dropped row counts as a zero-weight row
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert history.history["dropped_examples"] == [1.0, 1.0]
    assert np.isfinite(history.history["loss"]).all()
    clean_x, weights = x.copy(), np.ones(16, "float32")
    clean_x[5] = 0.0
    weights[5] = 0.0
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    expected = plain.fit(clean_x, y, sample_weight=weights, batch_size=8, epochs=2,
                         shuffle=False, verbose=0)
    _assert_weights_close(inner, plain)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)


# -- bad input --------------------------------------------------------------------------------------

def test_scalar_loss_is_refused_before_training(rng):
    inner = _mlp()
    before = inner.get_weights()
    model = PerExampleModel(inner)
    model.compile(optimizer="sgd", loss=lambda y, p: keras.ops.mean(keras.ops.square(y - p)))
    with pytest.raises(ValueError, match="returned a scalar"):
        model.fit(rng.normal(size=(8, 6)), rng.normal(size=(8, 3)), verbose=0)
    for a, b in zip(inner.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_batch_norm_in_training_mode_is_refused(rng):
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(name="bn_here"),
                              keras.layers.Dense(3)])
    before = inner.get_weights()
    model = PerExampleModel(inner)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(pergrad.MixesExamplesError, match="bn_here"):
        model.fit(rng.normal(size=(8, 6)), rng.normal(size=(8, 3)), verbose=0)
    for a, b in zip(inner.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_aggregator_with_wrong_shapes_is_refused(rng):
    model = PerExampleModel(_mlp(), aggregate.custom(lambda grads, norms: [g[0] for g in grads[:2]]))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="returned 2 tensors for 4 trainable variables"):
        model.fit(rng.normal(size=(8, 6)), rng.normal(size=(8, 3)), verbose=0)


def test_activity_regularizer_is_refused(rng):
    inner = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(3, activity_regularizer="l2")])
    model = PerExampleModel(inner)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="adds losses in call"):
        model.fit(rng.normal(size=(8, 6)), rng.normal(size=(8, 3)), verbose=0)


def test_missing_and_ambiguous_losses():
    model = PerExampleModel(_mlp())
    with pytest.raises(ValueError, match="needs a loss"):
        model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match="ambiguous"):
        model.compile(optimizer="sgd", loss="crossentropy")
    with pytest.raises(ValueError, match="reduction='sum'"):
        model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    with pytest.raises(TypeError, match="Keras model"):
        PerExampleModel("not a model")


# -- mixed precision --------------------------------------------------------------------------------

@pytest.fixture
def policy():
    def set_policy(name):
        keras.config.set_dtype_policy(name)
    yield set_policy
    keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_trains_with_float32_unscaled_norms(rng, policy, name):
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    reference = _mlp()
    reference_norms = keras.ops.convert_to_numpy(
        pergrad.PerExample(reference, "mse", training=True).norms(x, y))
    policy(name)
    inner = _mlp()
    inner.set_weights(reference.get_weights())
    monitor = FakeMonitor()
    model = PerExampleModel(inner, aggregate.clip_mean(float(np.median(reference_norms))),
                            monitor=monitor)
    if name == "mixed_float16":
        # A moderate initial scale: the default 2**15 overflows float16 on the first step here
        # (see test_float16_overflow_skips_the_step).
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05), initial_scale=2.0 ** 8), loss="mse")
    else:
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    norms_dtype = []
    monitor.compute = lambda result, **kw: (
        norms_dtype.append(keras.backend.standardize_dtype(result.norms().dtype)),
        {"mean_norm": keras.ops.mean(result.norms())})[1]
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert set(norms_dtype) == {"float32"}  # Keras may trace the step twice
    # Unscaled norms: the loss scale (32768 for float16) must not show.
    np.testing.assert_allclose(history.history["mean_norm"][0], reference_norms.mean(), rtol=3e-2)
    plain = PerExampleModel(reference, aggregate.clip_mean(float(np.median(reference_norms))))
    policy("float32")
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    plain.fit(x, y, batch_size=16, epochs=1, verbose=0)
    for a, b in zip(inner.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-2)
        assert a.dtype == np.float32


def test_float16_overflow_skips_the_step(rng, policy):
    """Default loss scale 2**15 overflows float16 in the backward pass: the non-finite update
    reaches the LossScaleOptimizer, which skips the step and halves the scale (as in Keras);
    the overflowing examples are not counted as dropped (their loss is finite)."""
    policy("mixed_float16")
    inner = _mlp()
    before = inner.get_weights()
    model = PerExampleModel(inner, aggregate.clip_mean(1.0))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = 50 * rng.normal(size=(16, 3)).astype("float32")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert float(model.optimizer.dynamic_scale) == 2.0 ** 14
    assert history.history["dropped_examples"] == [0.0]
    for a, b in zip(inner.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    for _ in range(12):  # the scale comes down until steps go through
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert float(model.optimizer.dynamic_scale) < 2.0 ** 14
    assert any(not np.array_equal(a, b) for a, b in zip(inner.get_weights(), before, strict=True))
    assert all(np.isfinite(w).all() for w in inner.get_weights())


@pytest.mark.only_on("tensorflow", reason=(
    "tf.function traces a function that creates variables twice; JAX and PyTorch trace (or "
    "run) the step after Keras has built everything"))
@pytest.mark.parametrize("call", ["fit", "train_on_batch"])
def test_the_train_step_is_traced_once_with_metrics_and_optimizer_slots(rng, monkeypatch, call):
    """The compiled metrics' variables and the optimizer's momentum slots exist before the
    per-example step is traced, so TensorFlow traces it once, not twice."""
    from pergrad.keras import step

    traced = []
    original = step.train_step

    def counted(*args, **kwargs):
        traced.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(step, "train_step", counted)
    inputs = keras.Input((4,))
    model = PerExampleModel(keras.Model(inputs, keras.layers.Dense(3)(inputs)),
                            aggregator=aggregate.dp_mean(1.0, 1.0, seed=0))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.integers(0, 3, size=16)
    if call == "fit":
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    else:
        model.train_on_batch(x[:8], y[:8])
        model.train_on_batch(x[8:], y[8:])
    assert len(traced) == 1
    assert model.optimizer.iterations.numpy() == (4 if call == "fit" else 2)
