"""Out-of-sample scores and confident learning (``pergrad.analysis.out_of_sample``) against
hand-computed values and against cleanlab (a test extra), and cross-fitting's guarantee that
each row is scored by a model that never trained on it."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad.analysis.out_of_sample import (
    confidence_scores,
    confident_learning,
    cross_fitted_probabilities,
    fold_assignment,
)


def _noisy_probabilities(n: int = 400, classes: int = 4, seed: int = 0):
    """Predicted probabilities peaked on a true class, labels with 15% flipped."""
    rng = np.random.default_rng(seed)
    true = rng.integers(0, classes, n)
    logits = rng.normal(size=(n, classes)) + 3.0 * np.eye(classes)[true]
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = true.copy()
    flip = rng.random(n) < 0.15
    labels[flip] = (true[flip] + rng.integers(1, classes, flip.sum())) % classes
    return p, labels


def test_confidence_scores_by_hand():
    p = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    found = confidence_scores(p, np.array([0, 0]))
    np.testing.assert_allclose(found["self_confidence"], [0.3, 0.9])
    np.testing.assert_allclose(found["oos_margin"], [0.2 - 0.7, 0.6 - 0.1])
    np.testing.assert_array_equal(found["suggested"], [0, 2])


def test_confident_learning_by_hand():
    # Class thresholds: t0 = mean(0.9, 0.8, 0.2) = 0.6333, t1 = mean(0.7, 0.9) = 0.8.
    p = np.array([[0.9, 0.1], [0.8, 0.2], [0.2, 0.8], [0.3, 0.7], [0.1, 0.9]])
    labels = np.array([0, 0, 0, 1, 1])
    found = confident_learning(p, labels)
    np.testing.assert_allclose(found.thresholds, [(0.9 + 0.8 + 0.2) / 3, 0.8])
    # Row 2 (label 0) is confidently class 1; row 3 (label 1, p1 = 0.7 < 0.8) is confident of
    # nothing, so it is not flagged.
    np.testing.assert_array_equal(found.flagged, [False, False, True, False, False])
    np.testing.assert_array_equal(found.suggested, [0, 0, 1, 1, 1])
    # Joint [[2, 1], [0, 1]], rows calibrated to the label counts (3, 2): [[2, 1], [0, 2]].
    assert found.estimated_errors == 1


def test_confident_learning_agrees_with_cleanlab():
    from cleanlab.count import compute_confident_joint, num_label_issues

    for seed in range(3):
        p, labels = _noisy_probabilities(seed=seed)
        ours = confident_learning(p, labels)
        _, theirs = compute_confident_joint(labels, p, return_indices_of_off_diagonals=True)
        # cleanlab takes the overall argmax where two or more classes reach their thresholds;
        # the paper (and pergrad) the most probable confident class. Compare where they agree.
        reaches = p >= ours.thresholds - 1e-6
        overall = p.argmax(axis=1)
        same_rule = (reaches.sum(axis=1) < 2) | reaches[np.arange(len(p)), overall]
        flagged_theirs = np.zeros(len(p), bool)
        flagged_theirs[theirs] = True
        np.testing.assert_array_equal(ours.flagged[same_rule], flagged_theirs[same_rule])
        expected = num_label_issues(labels, p, estimation_method="off_diagonal_calibrated")
        assert abs(ours.estimated_errors - expected) <= 1, (ours.estimated_errors, expected)


def test_fold_assignment_is_stratified_and_refuses_rare_classes():
    labels = np.repeat([0, 1, 2], [10, 20, 30])
    folds = fold_assignment(labels, 5, seed=0)
    for fold in range(5):
        np.testing.assert_array_equal(np.bincount(labels[folds == fold]), [2, 4, 6])
    with pytest.raises(ValueError, match="class 0 has 10"):
        fold_assignment(labels, 11)
    with pytest.raises(ValueError, match="at least 2 folds"):
        fold_assignment(labels, 1)


def test_cross_fitting_scores_each_row_with_a_model_that_never_saw_it():
    """With a learning rate that memorizes, a row's own label would be predicted with
    probability near 1 by any model that trained on it. Labels here are random, so
    out-of-sample probabilities of the given label stay near chance."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 20)).astype("float32")
    y = rng.integers(0, 2, 60)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(2)])
    before = [w.copy() for w in model.get_weights()]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    p = cross_fitted_probabilities(model, x, y, loss=loss, optimizer=keras.optimizers.Adam(0.05),
                                   from_logits=True, folds=3, epochs=40, batch_size=20)
    assert p.shape == (60, 2)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-6)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)  # the model passed in is not trained
    own = p[np.arange(60), y]
    assert own.mean() < 0.75, own.mean()
    # The same recipe in-sample memorizes the random labels.
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    model.fit(x, y, epochs=40, batch_size=20, verbose=0)
    logits = np.asarray(model.predict(x, verbose=0), np.float64)
    inside = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert inside[np.arange(60), y].mean() > 0.9
