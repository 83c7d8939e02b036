"""GradientMonitor: statistics in the training step, CSV, TensorBoard events, per-example tracking.

Every test not marked ``tensorflow_only`` runs on TensorFlow, JAX and PyTorch; each compares
with an independent float64 computation (NumPy), so every backend is held to the same
numbers."""

from __future__ import annotations

import csv
import glob
import os

import keras
import numpy as np
import pytest
from oracle import assert_close, compiled_like_a_user, softmax

import pergrad
from pergrad.backend.lazy import tensorflow as tf  # on first use: TensorFlow may be absent
from pergrad.keras import PerExampleModel
from pergrad.keras.monitor import LOGGED_STATISTICS, GradientMonitor, csv_columns
from pergrad.stats import BATCH_STATISTICS, gradient_statistics

INDEX_KEY = "example_index"
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, BATCH, EPOCHS, ODD = 24, 8, 3, 13  # example ODD is mislabeled


class MeanStep(keras.Model):
    """A minimal per-example training step on TensorFlow: the contract PerExampleModel follows
    with a monitor."""

    def __init__(self, inner, loss, monitor):
        super().__init__()
        self.inner = inner
        self.monitor = monitor
        self.pex = pergrad.PerExample(inner, loss, training=True)

    def call(self, x, training=False):
        return self.inner(x, training=training)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        indices = None
        if isinstance(x, dict):
            x = dict(x)
            indices = x.pop(INDEX_KEY, None)
            (x,) = x.values()
        result = self.pex.compute(x, y, sample_weight)
        scale = 1.0 / tf.cast(result.batch_size, result.losses.dtype)
        grads = result.weighted_sum(tf.fill([result.batch_size], scale))
        self.optimizer.apply_gradients(zip(grads, result.variables, strict=True))
        stats = self.monitor.compute(result, indices=indices, sample_weight=sample_weight)
        return {"loss": tf.reduce_mean(result.losses), **stats}


def _data(seed=0):
    """Inputs clustered around one point, all labelled 0 except example ODD: its gradient points
    against everyone else's."""
    rng = np.random.default_rng(seed)
    x = np.array([1.0, -0.5, 2.0]) + 0.05 * rng.normal(size=(N, 3))
    y = np.zeros(N, np.int64)
    y[ODD] = 1
    return x, y


def _inner():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def _trainer(monitor, inner=None, custom=False):
    """SGD(1e-3) on the mean gradient with ``monitor``: ``PerExampleModel`` (any backend) or,
    with ``custom=True``, the hand-written TensorFlow step :class:`MeanStep`."""
    if custom:
        model = MeanStep(inner or _inner(), SCCE, monitor)
        model.compile(optimizer=keras.optimizers.SGD(1e-3))
        return model
    model = PerExampleModel(inner or _inner(), monitor=monitor)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=SCCE)
    return model


def _dense_gradients(w, b, x, y):
    """Per-example gradients ``(B, P)`` and losses of softmax cross-entropy on logits
    ``x @ w + b``, by hand in float64."""
    z = x @ w + b
    p = softmax(z)
    onehot = np.eye(w.shape[1])[y]
    d = p - onehot
    grads = np.concatenate([(x[:, :, None] * d[:, None, :]).reshape(len(x), -1), d], axis=1)
    losses = -np.log(p[np.arange(len(x)), y])
    return grads, losses, z


def _reference_statistics(g):
    """Float64 norms, cosines to the batch and to the rest, and a few batch statistics, from
    the materialized per-example gradients ``g`` ``(B, P)``."""
    n = len(g)
    norms = np.linalg.norm(g, axis=1)
    mean = g.mean(axis=0)
    cos = g @ mean / (norms * np.linalg.norm(mean))
    unit = g / norms[:, None]
    rest = unit.sum(axis=0)[None, :] - unit
    cos_rest = np.sum(g * rest, axis=1) / (norms * np.linalg.norm(rest, axis=1))
    variance = np.sum((g - mean) ** 2) / (n - 1)
    return {"norms": norms, "cosine_to_batch": cos, "cosine_to_rest": cos_rest,
            "batch_gradient_norm": np.linalg.norm(mean), "gradient_variance": variance,
            "noise_scale": variance / np.sum(mean ** 2), "fraction_opposed": np.mean(cos < 0),
            "fraction_against_rest": np.mean(cos_rest < 0)}


def _fit_in_fixed_order(monitor, inner=None):
    """Trains on ``_data()`` unshuffled for EPOCHS epochs with ``monitor``; the Keras history."""
    x, y = _data()
    with pytest.warns(UserWarning, match="sample order"):
        return _trainer(monitor, inner).fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                            verbose=0, callbacks=[monitor])


def test_fixed_order_tracking_csv_and_history(tmp_path, float64):
    x, y = _data()
    csv_path = str(tmp_path / "stats.csv")
    monitor = GradientMonitor(csv_path=csv_path)
    inner = _inner()
    initial = inner.get_weights()
    history = _fit_in_fixed_order(monitor, inner)
    steps = EPOCHS * N // BATCH

    # Keras history holds the batch statistics.
    assert set(BATCH_STATISTICS) <= set(history.history)

    # Per-example tracking: indices from the sample order.
    table = monitor.example_table()
    np.testing.assert_array_equal(table["index"], np.arange(N))
    np.testing.assert_array_equal(table["seen"], np.full(N, EPOCHS))
    expected_opposed = np.zeros(N, np.int64)
    expected_opposed[ODD] = EPOCHS
    np.testing.assert_array_equal(table["opposed"], expected_opposed)
    assert table["mean_cosine"][ODD] < -0.9 and np.all(np.delete(table["mean_cosine"], ODD) > 0.9)
    assert table["opposed_fraction"][ODD] == 1.0
    assert monitor.most_conflicting(1).tolist() == [ODD]

    # CSV: header and one row per step; the first row against gradient_statistics on the
    # first batch with the initial weights (float64).
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == csv_columns()
    assert [int(r["step"]) for r in rows] == list(range(steps))
    assert [int(r["epoch"]) for r in rows] == [s // (N // BATCH) for s in range(steps)]
    reference_model = _inner()
    reference_model.set_weights(initial)
    expected = gradient_statistics(pergrad.PerExample(reference_model, SCCE), x[:BATCH], y[:BATCH])
    for key in BATCH_STATISTICS:
        assert_close(float(rows[0][key]), expected[key], what=key)
    # ... and against gradients written out by hand in float64.
    grads, losses, _ = _dense_gradients(*initial, x[:BATCH], y[:BATCH])
    reference = _reference_statistics(grads)
    for key in ("batch_gradient_norm", "gradient_variance", "noise_scale", "fraction_opposed",
                "fraction_against_rest"):
        assert_close(float(rows[0][key]), reference[key], what=key)
    assert_close(float(rows[0]["loss"]), np.mean(losses), what="loss")
    assert_close(float(rows[0]["norm_p50"]), np.quantile(reference["norms"], 0.5), what="p50")
    assert_close(float(rows[0]["cosine_p10"]), np.quantile(reference["cosine_to_batch"], 0.1))
    assert len(monitor.history) == steps


@pytest.mark.needs_tensorflow  # TensorBoard's event files are written and read with TensorFlow
def test_tensorboard_scalars_and_histograms_every_step(tmp_path, float64):
    log_dir = str(tmp_path / "tb")
    _fit_in_fixed_order(GradientMonitor(log_dir=log_dir))
    steps = EPOCHS * N // BATCH
    tags: dict[str, list[int]] = {}
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
                if value.tag.startswith("per_example/"):
                    assert value.metadata.plugin_data.plugin_name == "histograms"
                    assert tf.make_ndarray(value.tensor).shape[1] == 3
    for key in ["loss", *BATCH_STATISTICS, "norm_p90", "cosine_p50"]:
        assert sorted(tags[f"gradients/{key}"]) == list(range(steps)), key
    for key in ["per_example/norms", "per_example/cosine_to_batch"]:
        assert sorted(tags[key]) == list(range(steps))


@pytest.mark.needs_tensorflow  # a shuffled tf.data pipeline
def test_supplied_indices_under_shuffling(float64):
    x, y = _data(1)
    permutation = np.random.default_rng(3).permutation(N)  # ODD sits elsewhere in the arrays
    data = tf.data.Dataset.from_tensor_slices(
        ({"features": x[permutation], INDEX_KEY: permutation}, y[permutation]))
    data = data.shuffle(N, seed=1, reshuffle_each_iteration=True).batch(BATCH)
    monitor = GradientMonitor(num_examples=N)
    _trainer(monitor).fit(data, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[monitor])
    table = monitor.example_table()
    np.testing.assert_array_equal(table["seen"], np.full(N, EPOCHS))
    assert table["opposed"][ODD] == EPOCHS
    assert table["opposed"].sum() == EPOCHS
    assert monitor.most_conflicting(3)[0] == ODD


def test_every_n_steps_skips_and_holds(float64):
    x, y = _data()
    monitor = GradientMonitor(every_n_steps=2, num_examples=N)
    with pytest.warns(UserWarning, match="sample order"):
        history = _trainer(monitor).fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                        verbose=0, callbacks=[monitor])
    assert [r["step"] for r in monitor.history] == [0, 2, 4, 6, 8]
    # Steps 0..8 over 3 batches per epoch: batch 0 monitored at steps 0 and 6, batch 1 at 4,
    # batch 2 at 2 and 8.
    seen = monitor.example_table()["seen"]
    np.testing.assert_array_equal(seen, np.repeat([2, 1, 2], BATCH))
    # The epoch's last step (8) is monitored; its values are in the history.
    assert history.history["noise_scale"][-1] == pytest.approx(monitor.history[-1]["noise_scale"])


def test_zero_weight_examples_are_not_counted(float64):
    x, y = _data()
    weight = np.ones(N)
    weight[[0, 9]] = 0.0
    monitor = GradientMonitor(num_examples=N)
    with pytest.warns(UserWarning):
        _trainer(monitor).fit(x, y, sample_weight=weight, batch_size=BATCH, epochs=1,
                              shuffle=False, verbose=0, callbacks=[monitor])
    seen = monitor.example_table()["seen"]
    assert seen[0] == 0 and seen[9] == 0 and seen.sum() == N - 2


def test_compute_in_a_custom_loop_grows_tables():
    """No callback, no num_examples: compute() alone works (in the user's own compiled
    function, and eagerly) and the tables grow to the indices."""
    inner = _inner()
    inner.build((None, 3))
    pex = pergrad.PerExample(inner, SCCE)
    monitor = GradientMonitor(every_n_steps=1)
    x, y = _data()
    x = x.astype("float32")
    step = compiled_like_a_user(lambda x, y, indices: monitor.compute(pex.compute(x, y), indices=indices))
    for start in (0, 16):
        stats = step(x[start:start + 8], y[start:start + 8], np.arange(start, start + 8) * 2)
    assert set(stats) == set(LOGGED_STATISTICS)
    assert keras.backend.standardize_dtype(stats["noise_scale"].dtype) == "float32"
    seen = monitor.example_table()["seen"]
    assert len(seen) == 2 * 23 + 1 and seen.sum() == 16 and seen[46] == 1
    np.testing.assert_array_equal(np.flatnonzero(seen), np.r_[0:16:2, 32:48:2])
    eager = monitor.compute(pex.compute(x[:8], y[:8]), indices=np.arange(8))
    grads, _, _ = _dense_gradients(*[w.astype(np.float64) for w in inner.get_weights()],
                                   x[:8].astype(np.float64), y[:8])
    assert_close(eager["noise_scale"], _reference_statistics(grads)["noise_scale"], rtol=1e-4)
    assert monitor.example_table()["seen"][:8].tolist() == [2, 1, 2, 1, 2, 1, 2, 1]


def test_rankings_follow_the_example_table():
    """most_conflicting ranks by mean cosine to the rest (default) or by opposed fraction."""
    inner = _inner()
    inner.build((None, 3))
    pex = pergrad.PerExample(inner, SCCE)
    monitor = GradientMonitor()
    x, y = _data()
    step = compiled_like_a_user(lambda x, y, i: monitor.compute(pex.compute(x, y), indices=i))
    for start in (0, 8, 16):
        step(x[start:start + 8].astype("float32"), y[start:start + 8], np.arange(start, start + 8))
    table = monitor.example_table()
    seen = np.flatnonzero(table["seen"] > 0)
    by_rest = monitor.most_conflicting(5)
    assert np.all(np.diff(table["mean_cosine_to_rest"][by_rest]) >= 0)
    assert set(by_rest) <= set(seen)
    assert table["mean_cosine_to_rest"][by_rest[0]] == np.nanmin(table["mean_cosine_to_rest"])
    by_batch = monitor.most_conflicting(5, against="batch")
    assert np.all(np.diff(table["opposed_fraction"][by_batch]) <= 0)
    with pytest.raises(ValueError, match="against must be"):
        monitor.most_conflicting(3, against="median")


def test_bad_arguments():
    with pytest.raises(ValueError, match="every_n_steps"):
        GradientMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="num_examples"):
        GradientMonitor(num_examples=-3)


def test_tensorboard_without_tensorflow_is_a_clear_error(monkeypatch):
    import pergrad.keras.monitor as monitor_module

    monkeypatch.setattr(monitor_module, "_tensorflow_installed", lambda: False)
    with pytest.raises(ImportError, match=r"pip install pergrad\[tensorflow\]"):
        GradientMonitor(log_dir="tb")
    GradientMonitor(csv_path="m.csv")  # the CSV needs no TensorFlow


def test_with_per_example_model(tmp_path, float64):
    """The real PerExampleModel: fit adds the monitor, pops x["example_index"] into indices."""
    from pergrad.keras import INDEX_KEY as MODEL_INDEX_KEY
    from pergrad.keras import GradientMonitor as Exported
    from pergrad.keras import PerExampleModel

    assert MODEL_INDEX_KEY == INDEX_KEY and Exported is GradientMonitor
    x, y = _data()
    permutation = np.random.default_rng(5).permutation(N)
    monitor = GradientMonitor(csv_path=str(tmp_path / "m.csv"))
    model = PerExampleModel(_inner(), monitor=monitor)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=SCCE)
    history = model.fit({"x": x[permutation], INDEX_KEY: permutation}, y[permutation],
                        batch_size=BATCH, epochs=EPOCHS, verbose=0)
    assert set(BATCH_STATISTICS) <= set(history.history)
    table = monitor.example_table()
    assert table["opposed"][ODD] == EPOCHS and table["opposed"].sum() == EPOCHS
    with open(tmp_path / "m.csv") as f:
        assert len(list(csv.DictReader(f))) == EPOCHS * N // BATCH


def test_a_nan_example_does_not_poison_the_monitor():
    """PerExampleModel drops a non-finite example; the monitor sees it as inactive."""
    from pergrad.keras import PerExampleModel

    x, y = _data()
    x = x.astype("float32")
    x[5, 1] = np.nan
    monitor = GradientMonitor(num_examples=N)
    model = PerExampleModel(_inner(), monitor=monitor)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=SCCE)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    table = monitor.example_table()
    assert table["seen"][5] == 0 and np.all(table["seen"][np.arange(N) != 5] == 2)
    finite = np.arange(N) != 5
    assert np.all(np.isfinite(table["mean_cosine"][finite]))
    assert np.all(np.isfinite(table["mean_cosine_to_rest"][finite]))
    assert np.isfinite(history.history["noise_scale"]).all()
    assert history.history["dropped_examples"] == [1.0, 1.0]


def test_tables_over_several_steps_match_a_float64_replay(float64):
    """Three epochs of SGD with every second step monitored and the examples in a permuted order:
    the per-example tables, the monitor's rows and the values a skipped step holds, against the
    same training replayed by hand in float64 (gradients written out for a Dense softmax)."""
    n, batch, classes, rate = 12, 4, 3, 0.5
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 3))
    y = rng.integers(0, classes, n)
    order = rng.permutation(n)
    keras.utils.set_random_seed(3)
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(classes)])
    w, b = inner.get_weights()
    monitor = GradientMonitor(every_n_steps=2, num_examples=n)
    model = PerExampleModel(inner, monitor=monitor)
    model.compile(optimizer=keras.optimizers.SGD(rate), loss=SCCE)
    history = model.fit({"x": x[order], INDEX_KEY: order}, y[order], batch_size=batch, epochs=3,
                        shuffle=False, verbose=0)

    columns = ("seen", "loss", "norm", "influence", "cosine", "rest", "margin", "error",
               "forgotten", "last_correct", "learned", "last_loss")
    want = {c: np.zeros(n) for c in columns}
    rows = []
    for step in range(3 * n // batch):
        chosen = order[(step % 3) * batch:(step % 3 + 1) * batch]
        g, losses, z = _dense_gradients(w, b, x[chosen], y[chosen])
        if step % 2 == 0:
            ref = _reference_statistics(g)
            p, onehot = softmax(z), np.eye(classes)[y[chosen]]
            correct = (z.argmax(axis=1) == y[chosen]).astype(float)
            own = z[np.arange(batch), y[chosen]]
            for column, value in (
                    ("seen", 1.0), ("loss", losses), ("norm", ref["norms"]),
                    ("influence", rate * ref["norms"] ** 2), ("cosine", ref["cosine_to_batch"]),
                    ("rest", ref["cosine_to_rest"]),
                    ("margin", own - np.where(onehot > 0, -np.inf, z).max(axis=1)),
                    ("error", np.linalg.norm(p - onehot, axis=1)),
                    ("forgotten", want["last_correct"][chosen] * (1 - correct))):
                want[column][chosen] += value
            want["last_correct"][chosen] = correct
            want["learned"][chosen] = np.maximum(want["learned"][chosen], correct)
            want["last_loss"][chosen] = losses
            rows.append((step, np.mean(losses), ref))
        mean = g.mean(axis=0)
        w, b = w - rate * mean[:-classes].reshape(w.shape), b - rate * mean[-classes:]

    table = monitor.example_table()
    seen = want["seen"]
    np.testing.assert_array_equal(table["seen"], seen)
    assert set(np.unique(seen)) == {1, 2}  # batches 0 and 2 twice, batch 1 once
    for key, column in (("mean_loss", "loss"), ("mean_norm", "norm"), ("mean_cosine", "cosine"),
                        ("mean_cosine_to_rest", "rest")):
        assert_close(table[key], want[column] / seen, what=key)
    assert_close(table["self_influence"], want["influence"], what="self_influence")
    assert_close(table["last_loss"], want["last_loss"], what="last_loss")
    assert_close(table["mean_margin"], want["margin"] / seen, rtol=1e-5, what="margin")
    assert_close(table["mean_error_norm"], want["error"] / seen, rtol=1e-5, what="error_norm")
    np.testing.assert_array_equal(table["forgetting_events"], want["forgotten"])
    np.testing.assert_array_equal(table["learned"], want["learned"] > 0)
    assert [r["step"] for r in monitor.history] == [r[0] for r in rows] == [0, 2, 4, 6, 8]
    for got, (_, loss, ref) in zip(monitor.history, rows, strict=True):
        assert_close(got["loss"], loss, what="loss")
        for key in ("noise_scale", "batch_gradient_norm", "fraction_against_rest"):
            assert_close(got[key], ref[key], what=key)
    # Epochs end on steps 2 and 8 (monitored) and 5 (skipped: it holds step 4's values).
    assert_close(history.history["noise_scale"],
                 [rows[k][2]["noise_scale"] for k in (1, 2, 4)], what="held")


def test_the_monitor_changes_nothing_in_a_dp_step(float64):
    """A monitor reads the step's raw per-example gradients and draws no noise: the same DP
    model with and without it trains to the same weights and the same noise stream."""
    from pergrad import aggregate

    x, y = _data(2)
    models = []
    for monitor in (None, GradientMonitor(num_examples=N)):
        keras.utils.set_random_seed(11)
        if monitor is None:
            model = PerExampleModel(_inner(), aggregate.dp_mean(1.0, 1.1, seed=5))
        else:
            with pytest.warns(UserWarning, match="not differentially private"):
                model = PerExampleModel(_inner(), aggregate.dp_mean(1.0, 1.1, seed=5),
                                        monitor=monitor)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCCE)
        model.fit({"x": x, INDEX_KEY: np.arange(N)}, y, batch_size=BATCH, epochs=2,
                  shuffle=False, verbose=0)
        models.append(model)
    plain, monitored = models
    for a, b in zip(plain.get_weights(), monitored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert monitored.monitor.example_table()["seen"].tolist() == [2] * N
    assert not np.allclose(plain.model.get_weights()[0], _inner().get_weights()[0])


def _conv_inner():
    """Convolutions down each route of the rule (patches for the strided one, shifted slices
    for the stride-1 one with 16 channels) and a Dense head."""
    return keras.Sequential([
        keras.Input((9, 9, 2)),
        keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="tanh"),
        keras.layers.Conv2D(4, 3, padding="same", activation="tanh"),
        keras.layers.Flatten(), keras.layers.Dense(3)])


def test_the_monitor_changes_nothing_in_a_mean_step(float64):
    """A monitored step's ``mean()`` sums read the per-example matrices the statistics built
    (``GradientMonitor.compute_alongside``), a skipped step's the layer inputs: over steps of
    both kinds (``every_n_steps=2``) the weights equal those of the model without a monitor and
    of Keras's own ``fit``."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, 9, 9, 2))
    y = rng.integers(0, 3, N)
    keras.utils.set_random_seed(4)
    initial = _conv_inner().get_weights()
    trained = []
    for monitor in (None, GradientMonitor(every_n_steps=2, num_examples=N), "keras"):
        inner = _conv_inner()
        inner.set_weights(initial)
        model = inner if monitor == "keras" else PerExampleModel(inner, monitor=monitor)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCCE)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        trained.append(inner.get_weights())
    plain, monitored, reference = trained
    assert not np.allclose(reference[0], initial[0])
    for k, (a, b, c) in enumerate(zip(plain, monitored, reference, strict=True)):
        assert_close(b, a, rtol=1e-10, what=f"weight {k}, monitored against plain")
        assert_close(b, c, rtol=1e-10, what=f"weight {k}, monitored against Keras")


def test_a_step_refused_by_the_mixing_check_is_not_recorded():
    """BatchNormalization in training mode mixes examples: the clipped model refuses the first
    step, and the monitor counts nothing from it."""
    from pergrad import MixesExamplesError, aggregate

    x, y = _data()
    inner = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    monitor = GradientMonitor(num_examples=N)
    model = PerExampleModel(inner, aggregate.clip_mean(1.0), monitor=monitor)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCCE)
    with pytest.raises(MixesExamplesError):
        model.fit({"x": x.astype("float32"), INDEX_KEY: np.arange(N)}, y, batch_size=BATCH,
                  epochs=1, verbose=0)
    assert monitor.example_table()["seen"].sum() == 0 and monitor.history == []


@pytest.mark.tensorflow_only(reason=(
    "MeanStep is a hand-written TensorFlow train_step (tf.cast, tf.fill on the step's tensors) "
    "compared with PerExampleModel's"))
def test_a_custom_tensorflow_train_step_follows_the_same_contract(float64):
    """The hand-written step :class:`MeanStep` and ``PerExampleModel`` fill the same tables."""
    x, y = _data(3)
    tables = []
    for custom in (True, False):
        inner = _inner()
        inner.set_weights([np.full((3, 2), 0.3), np.array([0.1, -0.2])])
        monitor = GradientMonitor(num_examples=N)
        model = _trainer(monitor, inner, custom=custom)
        model.fit({"x": x, INDEX_KEY: np.arange(N)}, y, batch_size=BATCH, epochs=2,
                  shuffle=False, verbose=0, callbacks=[monitor])
        tables.append(monitor.example_table())
    for key in ("seen", "mean_cosine", "mean_cosine_to_rest", "mean_loss", "mean_norm"):
        assert_close(tables[0][key], tables[1][key], what=key)
    # MeanStep passes no learning rate (TracIn then weighs every step by 1), PerExampleModel 1e-3.
    assert_close(1e-3 * tables[0]["self_influence"], tables[1]["self_influence"])
