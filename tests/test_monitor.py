"""GradientMonitor: statistics in the training step, CSV, TensorBoard events, per-example tracking."""

from __future__ import annotations

import csv
import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_close

import pergrad
from pergrad.keras.monitor import LOGGED_STATISTICS, GradientMonitor, csv_columns
from pergrad.stats import BATCH_STATISTICS, gradient_statistics

INDEX_KEY = "example_index"
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, BATCH, EPOCHS, ODD = 24, 8, 3, 13  # example ODD is mislabeled


class MeanStep(keras.Model):
    """A minimal per-example training step: the contract PerExampleModel follows with a monitor."""

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


def _trainer(monitor, inner=None):
    model = MeanStep(inner or _inner(), SCCE, monitor)
    model.compile(optimizer=keras.optimizers.SGD(1e-3))
    return model


def test_fixed_order_tracking_csv_tensorboard_and_history(tmp_path, float64):
    x, y = _data()
    csv_path, log_dir = str(tmp_path / "stats.csv"), str(tmp_path / "tb")
    monitor = GradientMonitor(csv_path=csv_path, log_dir=log_dir)
    inner = _inner()
    initial = [v.numpy() for v in inner.trainable_variables]
    model = _trainer(monitor, inner)
    with pytest.warns(UserWarning, match="sample order"):
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                            callbacks=[monitor])
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
    for v, value in zip(reference_model.trainable_variables, initial, strict=True):
        v.assign(value)
    expected = gradient_statistics(pergrad.PerExample(reference_model, SCCE), x[:BATCH], y[:BATCH])
    for key in BATCH_STATISTICS:
        assert_close(float(rows[0][key]), expected[key], what=key)
    assert_close(float(rows[0]["loss"]), np.mean(expected["losses"]), what="loss")
    assert_close(float(rows[0]["norm_p50"]), np.quantile(expected["norms"], 0.5), what="p50")
    assert_close(float(rows[0]["cosine_p10"]), np.quantile(expected["cosine_to_batch"], 0.1))
    assert len(monitor.history) == steps

    # TensorBoard: scalars for every statistic and histograms of norms and cosines, every step.
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
    """No callback, no num_examples: compute() alone works and the tables grow to the indices."""
    inner = _inner()
    inner.build((None, 3))
    pex = pergrad.PerExample(inner, SCCE)
    monitor = GradientMonitor(every_n_steps=1)
    x, y = _data()

    @tf.function
    def step(x, y, indices):
        return monitor.compute(pex.compute(x, y), indices=indices)

    for start in (0, 16):
        stats = step(x[start:start + 8].astype("float32"), y[start:start + 8],
                     tf.range(start, start + 8) * 2)
    assert set(stats) == set(LOGGED_STATISTICS)
    assert stats["noise_scale"].dtype == tf.float32
    seen = monitor.example_table()["seen"]
    assert len(seen) == 2 * 23 + 1 and seen.sum() == 16 and seen[46] == 1


def test_rankings_follow_the_example_table():
    """most_conflicting ranks by mean cosine to the rest (default) or by opposed fraction."""
    inner = _inner()
    inner.build((None, 3))
    pex = pergrad.PerExample(inner, SCCE)
    monitor = GradientMonitor()
    x, y = _data()
    step = tf.function(lambda x, y, i: monitor.compute(pex.compute(x, y), indices=i))
    for start in (0, 8, 16):
        step(x[start:start + 8].astype("float32"), y[start:start + 8], tf.range(start, start + 8))
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
