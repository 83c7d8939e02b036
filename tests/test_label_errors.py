"""Label-error scores, TracIn influence and the noise helpers against float64 computations
(every test not marked ``tensorflow_only`` runs on TensorFlow, JAX and PyTorch)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from oracle import assert_close, compiled_like_a_user, keras_loss, loop_gradients, softmax

import pergrad
from pergrad.demo import flip_classes
from pergrad.keras import INDEX_KEY, GradientMonitor, PerExampleModel, TracInCheckpoints
from pergrad.stats import (
    Checkpoint,
    class_scores,
    influence,
    label_error_scores,
    rank_average,
    ranking,
)
from pergrad.stats.scores import loss_from_logits

L = keras.layers
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _expected_class_scores(z, labels, from_logits):
    z = np.asarray(z, np.float64)
    p = softmax(z) if from_logits else z
    onehot = np.eye(z.shape[1])[labels]
    others = np.where(onehot > 0, -np.inf, z).max(axis=1)
    return {"margin": z[np.arange(len(z)), labels] - others,
            "error_norm": np.linalg.norm(p - onehot, axis=1),
            "correct": (z.argmax(axis=1) == labels).astype(float)}


@pytest.mark.parametrize("case", ["logits", "probabilities", "one_hot", "binary_logit",
                                  "binary_probability"])
def test_class_scores_match_float64(case):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 12)
    z = rng.normal(size=(12, 4)) * 3
    f32 = np.float32
    if case == "logits":
        got = class_scores(z.astype(f32), labels, True)
        want = _expected_class_scores(z, labels, True)
    elif case == "probabilities":
        p = softmax(z)
        got = class_scores(p.astype(f32), labels[:, None], False)
        want = _expected_class_scores(p, labels, False)
    elif case == "one_hot":
        got = class_scores(z.astype(f32), np.eye(4)[labels], True)
        want = _expected_class_scores(z, labels, True)
    else:
        labels = labels % 2
        logit = z[:, :1]
        if case == "binary_logit":  # a logit z is the two logits (0, z)
            got = class_scores(logit.astype(f32), labels, True)
            want = _expected_class_scores(np.concatenate([0 * logit, logit], 1), labels, True)
        else:
            p = 1 / (1 + np.exp(-logit))
            got = class_scores(p.astype(f32), labels.astype(float), False)
            want = _expected_class_scores(np.concatenate([1 - p, p], 1), labels, False)
    for key, value in want.items():
        assert_close(got[key], value, rtol=1e-5, what=key)


def test_loss_from_logits():
    assert loss_from_logits(SCCE) is True
    assert loss_from_logits(keras.losses.CategoricalCrossentropy()) is False
    assert loss_from_logits("sparse_categorical_crossentropy") is False
    assert loss_from_logits(keras.losses.get("binary_crossentropy")) is False
    assert loss_from_logits("mse") is None
    assert loss_from_logits(lambda y, p: y) is None


def _model(seed=0, classes=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), L.Dense(6, activation="tanh"), L.Dense(classes)])


def _data(n=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n)


def test_monitor_tables_match_float64(float64):
    """Two monitored steps at fixed weights: sums, learning-rate-weighted TracIn, margins, and a
    forgetting event where the second step's labels make every correct example wrong."""
    model = _model()
    x, _ = _data()
    z = keras.ops.convert_to_numpy(model(x))
    pred = z.argmax(axis=1)
    monitor = GradientMonitor(num_examples=len(x))
    pex = pergrad.PerExample(model, SCCE)
    step = compiled_like_a_user(lambda x, y, i, rate: monitor.compute(
        pex.compute(x, y), indices=i, labels=y, learning_rate=rate, from_logits=True))
    step(x, pred, np.arange(len(x)), 0.5)        # every example correct
    wrong = (pred + 1) % 3
    step(x, wrong, np.arange(len(x)), 0.25)      # every example wrong: one forgetting event each
    table = monitor.example_table()
    sq1, losses1 = _sq(model, x, pred)
    sq2, losses2 = _sq(model, x, wrong)
    assert_close(table["mean_loss"], (losses1 + losses2) / 2, what="mean_loss")
    assert_close(table["last_loss"], losses2, what="last_loss")
    assert_close(table["mean_norm"], (np.sqrt(sq1) + np.sqrt(sq2)) / 2, what="mean_norm")
    assert_close(table["self_influence"], 0.5 * sq1 + 0.25 * sq2, what="self_influence")
    m1 = _expected_class_scores(z, pred, True)
    m2 = _expected_class_scores(z, wrong, True)
    assert_close(table["mean_margin"], (m1["margin"] + m2["margin"]) / 2, what="margin")
    assert_close(table["mean_error_norm"], (m1["error_norm"] + m2["error_norm"]) / 2,
                 what="error_norm")
    np.testing.assert_array_equal(table["forgetting_events"], np.ones(len(x)))
    assert table["learned"].all() and (table["classified"] == 2).all()


def _sq(model, x, y):
    """``(||g_i||^2, l_i)`` by the float64 loop."""
    grads, losses = loop_gradients(model, keras_loss(SCCE), x, y)
    return sum(np.sum(g.reshape(len(x), -1) ** 2, axis=1) for g in grads), losses


def test_per_example_model_feeds_labels_and_learning_rate(float64):
    """One full-batch SGD step: TracIn is lr * ||g_i||^2 and the margin that of the initial
    weights, both against the float64 loop."""
    model = _model(1)
    x, y = _data(8, 1)
    sq, _ = _sq(model, x, y)
    z = keras.ops.convert_to_numpy(model(x))
    monitor = GradientMonitor(num_examples=len(x))
    trainer = PerExampleModel(model, monitor=monitor)
    trainer.compile(optimizer=keras.optimizers.SGD(0.3), loss=SCCE)
    trainer.fit({"x": x, INDEX_KEY: np.arange(len(x))}, y, batch_size=len(x), epochs=1,
                verbose=0)
    table = monitor.example_table()
    assert_close(table["self_influence"], 0.3 * sq, rtol=1e-6, what="self_influence")
    assert_close(table["mean_margin"], _expected_class_scores(z, y, True)["margin"], rtol=1e-6,
                 what="margin")


def test_unknown_logits_warns_and_skips_class_scores():
    model = _model()
    x, y = _data()
    monitor = GradientMonitor(num_examples=len(x))
    trainer = PerExampleModel(model, monitor=monitor)
    trainer.compile(optimizer="sgd", loss=lambda t, p: SCCE.call(t, p))
    with pytest.warns(UserWarning, match="from_logits"):
        trainer.fit({"x": x, INDEX_KEY: np.arange(len(x))}, y, batch_size=5, verbose=0)
    table = monitor.example_table()
    assert (table["classified"] == 0).all() and np.isnan(table["mean_margin"]).all()
    scores = label_error_scores(table)
    assert np.isnan(scores["margin"]).all()
    assert np.isfinite(scores["default"]).all()  # falls back to the scores that exist


def test_label_error_scores_and_ranking():
    n = 5
    table = {"seen": np.array([2, 2, 2, 2, 0]), "classified": np.array([2, 2, 2, 2, 0]),
             "learned": np.array([True, True, False, True, False]),
             "forgetting_events": np.array([0, 1, 0, 0, 0]),
             "mean_loss": np.array([0.1, 0.5, 2.0, 0.2, np.nan]),
             "last_loss": np.array([0.1, 0.4, 1.5, 0.3, np.nan]),
             "mean_margin": np.array([3.0, 1.0, -2.0, 2.0, np.nan]),
             "mean_error_norm": np.array([0.1, 0.5, 1.2, 0.2, np.nan]),
             "mean_norm": np.array([0.2, 0.3, 0.9, 0.1, np.nan]),
             "self_influence": np.array([0.1, 0.2, 0.8, 0.05, np.nan]),
             "mean_cosine_to_rest": np.array([0.5, 0.1, -0.4, 0.3, np.nan])}
    scores = label_error_scores(table)
    np.testing.assert_array_equal(scores["forgetting"][:4], [0, 1, 3, 0])  # never learned: n+1
    assert np.isnan(scores["forgetting"][4])
    np.testing.assert_array_equal(scores["margin"][:4], [-3, -1, 2, -2])
    assert ranking(scores["default"])[0] == 2 and ranking(scores["default"])[-1] == 4
    ranks = rank_average(np.array([1.0, 2, 3]), np.array([3.0, 2, 1]))
    np.testing.assert_allclose(ranks, [0.5, 0.5, 0.5])
    np.testing.assert_allclose(rank_average(np.array([1.0, np.nan, 3])), [0.5, 0.0, 1.0])
    with pytest.raises(ValueError, match="Unknown scores"):
        label_error_scores(table, default=("nope",))
    assert n == len(scores["default"])


def test_influence_matches_float64_tracin(float64):
    """sum_k eta_k <g_i(w_k), g_j(w_k)> over two checkpoints, against the loop oracle."""
    model = _model(2)
    x, y = _data(9, 2)
    xt, yt = _data(3, 3)
    checkpoints, expected = [], np.zeros((3, 9))
    for k, rate in enumerate((0.5, 0.1)):
        keras.utils.set_random_seed(10 + k)
        model.set_weights([np.random.default_rng(k).normal(size=w.shape) * 0.5
                           for w in model.get_weights()])
        checkpoints.append(Checkpoint(model.get_weights(), rate))
        g_train, _ = loop_gradients(model, keras_loss(SCCE), x, y)
        g_test, _ = loop_gradients(model, keras_loss(SCCE), xt, yt)
        flat_train = np.concatenate([g.reshape(9, -1) for g in g_train], 1)
        flat_test = np.concatenate([g.reshape(3, -1) for g in g_test], 1)
        expected += rate * flat_test @ flat_train.T
    before = model.get_weights()
    got = influence(model, SCCE, checkpoints, x, y, xt, yt, batch_size=4)
    assert_close(got.scores, expected, rtol=1e-8, what="tracin")
    for a, b in zip(model.get_weights(), before, strict=True):  # weights restored
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got.helpful(2), np.argsort(-expected, axis=1)[:, :2])
    np.testing.assert_array_equal(got.harmful(2), np.argsort(expected, axis=1)[:, :2])
    with pytest.raises(ValueError, match="checkpoint"):
        influence(model, SCCE, [], x, y, xt, yt)


def test_tracin_checkpoints_keep_weights_and_learning_rate():
    model = _model(3)
    x, y = _data(8, 3)
    saver = TracInCheckpoints()
    trainer = PerExampleModel(model)
    trainer.compile(optimizer=keras.optimizers.SGD(0.05), loss=SCCE)
    trainer.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[saver])
    assert len(saver.checkpoints) == 2
    assert all(c.learning_rate == pytest.approx(0.05) for c in saver.checkpoints)
    for a, b in zip(saver.checkpoints[-1].weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(saver.checkpoints[0].weights[0], saver.checkpoints[1].weights[0])
    with pytest.raises(ValueError, match="every_n_epochs"):
        TracInCheckpoints(every_n_epochs=0)


def test_flip_classes_flips_only_sources():
    labels = np.repeat(np.arange(4), 10)
    noisy, flipped = flip_classes(labels, {1: 2, 3: 0}, 0.3, seed=0)
    assert flipped.sum() == 6
    assert set(labels[flipped]) == {1, 3}
    assert (noisy[flipped & (labels == 1)] == 2).all() and (noisy[flipped & (labels == 3)] == 0).all()
    assert (noisy[~flipped] == labels[~flipped]).all()
    with pytest.raises(ValueError, match="itself"):
        flip_classes(labels, {1: 1}, 0.1)


@pytest.mark.slow(reason="a label-errors benchmark row with cleanlab's cross-validation: 10-20 s")
def test_detection_benchmark_row_finds_flips_and_runs_cleanlab():
    """One digits row of ``pergrad bench --suites label-errors --quick`` (2 epochs, 2 folds):
    pergrad's combined default and cleanlab's baseline both rank the flips well above chance,
    and the table shows both with their wall times."""
    from pergrad.bench import label_errors

    rows = label_errors.run(quick=True)
    assert len(rows) == 1
    row = rows[0]
    assert row["flipped"] == round(0.1 * 1797) and row["examples"] == 1797
    for name in label_errors.COLUMNS:
        assert row[f"{name}_auc"] > 0.8, (name, row)  # chance: 0.5
    assert row["pergrad_seconds"] > 0 and row["cleanlab_seconds"] > 0
    table = label_errors.markdown(rows)
    assert table.count("\n") == 2 and "cleanlab" in table.splitlines()[0]


def test_add_out_of_sample_adds_confidence_and_keeps_the_default():
    from pergrad.analysis import add_out_of_sample

    scores = {"default": np.array([0.1, 0.9, 0.5, 0.7]), "loss": np.arange(4.0)}
    p = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.5, 0.5]])
    out = add_out_of_sample(scores, p, np.array([0, 0, 1, 1]))
    np.testing.assert_allclose(out["self_confidence"], [0.1, 0.8, 0.6, 0.5])
    np.testing.assert_allclose(out["oos_margin"], [-0.8, 0.6, 0.2, 0.0])
    assert out["default"] is scores["default"] and out["loss"] is scores["loss"]
    assert set(scores) == {"default", "loss"}  # the input is not changed
