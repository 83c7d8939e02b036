"""Out-of-sample label-error scores: class probabilities from models that did not train on the
example (k-fold cross-fitting, as cleanlab's recipe does), and confident learning on them.

With ``p_i`` example ``i``'s predicted class probabilities and ``y_i`` its given label:

=====================  ====================================================================
score                  definition (higher = more likely mislabeled)
=====================  ====================================================================
``self_confidence``    ``1 - p_i[y_i]``
``oos_margin``         ``max_{k != y_i} p_i[k] - p_i[y_i]``
=====================  ====================================================================

Confident learning (Northcutt, Jiang and Chuang 2021): class ``j``'s threshold is
``t_j = mean of p_i[j] over the examples labelled j``; example ``i`` is confidently of class
``k*_i = argmax {p_i[k] : p_i[k] >= t_k}`` (none if no class reaches its threshold). The
confident joint ``C[y][k]`` counts the examples labelled ``y`` confidently of class ``k``; an
example is a *label issue* when ``k*_i`` exists and differs from ``y_i``, and the estimated
number of wrong labels is the off-diagonal mass of ``C`` after calibrating each row ``y`` to
the number of examples labelled ``y`` and the whole to ``N`` (with at least one example counted
on each diagonal entry, as cleanlab's ``num_label_issues(...,
estimation_method="off_diagonal_calibrated")`` does; the tests compare the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def class_probabilities(model: Any, x: Any, from_logits: bool, batch_size: int = 256) -> np.ndarray:
    """``(N, C)`` float64 class probabilities of ``model`` on ``x``: softmax of logits (or the
    outputs themselves when ``from_logits`` is false); one sigmoid output ``s`` becomes the two
    columns ``(1 - s, s)``."""
    import keras

    outputs = np.asarray(model.predict(x, batch_size=batch_size, verbose=0), np.float64)
    if outputs.ndim == 1:
        outputs = outputs[:, None]
    if outputs.shape[1] == 1:
        positive = 1.0 / (1.0 + np.exp(-outputs[:, 0])) if from_logits else outputs[:, 0]
        return np.stack([1.0 - positive, positive], axis=1)
    if from_logits:
        return np.asarray(keras.ops.convert_to_numpy(keras.ops.softmax(outputs, axis=1)),
                          np.float64)
    return outputs


def confidence_scores(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """``{"self_confidence", "oos_margin"}`` as in the module docstring, and ``"suggested"``
    (the most probable class), each ``(N,)``."""
    p = np.asarray(probabilities, np.float64)
    labels = np.asarray(labels, np.int64)
    own = p[np.arange(len(p)), labels]
    others = np.where(np.eye(p.shape[1], dtype=bool)[labels], -np.inf, p).max(axis=1)
    return {"self_confidence": 1.0 - own, "oos_margin": others - own,
            "suggested": p.argmax(axis=1)}


@dataclass
class LabelIssues:
    """What confident learning found (module docstring).

    Attributes:
        flagged: ``(N,)`` bool, the examples whose confident class differs from their label.
        suggested: ``(N,)`` the confident class where there is one, else the most probable.
        estimated_errors: the calibrated off-diagonal count of the confident joint.
        thresholds: ``(C,)`` the per-class thresholds ``t_j``.
    """

    flagged: np.ndarray
    suggested: np.ndarray
    estimated_errors: int
    thresholds: np.ndarray


def confident_learning(probabilities: np.ndarray, labels: np.ndarray) -> LabelIssues:
    """Confident learning on out-of-sample probabilities ``(N, C)`` and given labels ``(N,)``
    (module docstring). A class with no examples gets threshold 1 (it is never confident)."""
    p = np.asarray(probabilities, np.float64)
    labels = np.asarray(labels, np.int64)
    classes = p.shape[1]
    thresholds = np.ones(classes)
    for j in range(classes):
        members = labels == j
        if members.any():
            thresholds[j] = p[members, j].mean()
    reaches = p >= thresholds[None, :] - 1e-6
    confident = np.where(reaches, p, -np.inf).argmax(axis=1)
    has_class = reaches.any(axis=1)
    flagged = has_class & (confident != labels)
    joint = np.zeros((classes, classes))
    np.add.at(joint, (labels[has_class], confident[has_class]), 1.0)
    np.fill_diagonal(joint, np.maximum(joint.diagonal(), 1.0))
    counts = np.bincount(labels, minlength=classes).astype(np.float64)
    calibrated = joint * (counts / joint.sum(axis=1))[:, None]
    calibrated *= len(labels) / calibrated.sum()
    estimated = int(round(calibrated.sum() - np.trace(calibrated)))
    suggested = np.where(has_class, confident, p.argmax(axis=1))
    return LabelIssues(flagged, suggested, estimated, thresholds)


def add_out_of_sample(scores: dict[str, np.ndarray], probabilities: np.ndarray,
                      labels: np.ndarray) -> dict[str, np.ndarray]:
    """``scores`` (one per example) with the out-of-sample ``self_confidence`` and
    ``oos_margin`` of ``probabilities`` added; ``default`` is left as it is.

    Ranking by the training dynamics' default found label errors at least as well as ranking
    by its rank average with ``self_confidence`` in the label-errors benchmark
    (docs/analysis.md), at the cost of one training run; cross-fitted probabilities serve the
    suggested labels and the confident-learning count (:func:`confident_learning`).
    """
    found = confidence_scores(probabilities, labels)
    return {**scores, "self_confidence": found["self_confidence"],
            "oos_margin": found["oos_margin"]}


def fold_assignment(labels: np.ndarray, folds: int, seed: int = 0) -> np.ndarray:
    """``(N,)`` the fold (``0..folds-1``) of each example, stratified by class.

    Raises:
        ValueError: fewer than ``folds`` examples of some class, or ``folds < 2``.
    """
    from sklearn.model_selection import StratifiedKFold

    labels = np.asarray(labels)
    if folds < 2:
        raise ValueError(f"Cross-fitting needs at least 2 folds; got {folds}.")
    values, counts = np.unique(labels, return_counts=True)
    if counts.min() < folds:
        rare = values[np.argmin(counts)].item()
        raise ValueError(f"{folds} folds need at least {folds} examples of every class; class "
                         f"{rare!r} has {int(counts.min())}. Use fewer folds.")
    assignment = np.empty(len(labels), np.int64)
    splitter = StratifiedKFold(folds, shuffle=True, random_state=seed)
    for fold, (_, held_out) in enumerate(splitter.split(np.zeros(len(labels)), labels)):
        assignment[held_out] = fold
    return assignment


def cross_fitted_probabilities(model: Any, x: Any, y: np.ndarray, *, loss: Any, optimizer: Any,
                               from_logits: bool, folds: int = 5, epochs: int = 8,
                               batch_size: int = 64, seed: int = 0) -> np.ndarray:
    """``(N, C)`` out-of-sample class probabilities: ``folds`` copies of ``model`` (its
    architecture and its current weights as the starting point, a fresh copy of ``optimizer``)
    each train with plain ``fit`` on all folds but one and predict the one held out.

    ``model`` itself is not changed. Costs ``folds`` trainings of ``(folds - 1) / folds`` of
    the data.
    """
    import keras

    y = np.asarray(y)
    assignment = fold_assignment(y, folds, seed)
    start = model.get_weights()
    result = None
    for fold in range(folds):
        train, held_out = assignment != fold, assignment == fold
        copy = keras.models.clone_model(model)
        copy.set_weights(start)
        copy.compile(optimizer=optimizer.__class__.from_config(optimizer.get_config()),
                     loss=loss)
        keras.utils.set_random_seed(seed + fold)
        copy.fit(_take(x, train), y[train], epochs=epochs, batch_size=batch_size, verbose=0)
        probabilities = class_probabilities(copy, _take(x, held_out), from_logits)
        if result is None:
            result = np.zeros((len(y), probabilities.shape[1]))
        result[held_out] = probabilities
    return result


def _take(x: Any, mask: np.ndarray) -> Any:
    return {k: np.asarray(v)[mask] for k, v in x.items()} if isinstance(x, dict) \
        else np.asarray(x)[mask]
