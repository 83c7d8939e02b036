"""Training-data attribution by TracIn over checkpoints (Pruthi et al. 2020, *Estimating Training
Data Influence by Tracing Gradient Descent*).

For a test example ``z'`` and a training example ``z``, with checkpoints ``w_1..w_K`` saved
during training and ``eta_k`` the learning rate in use at checkpoint ``k``,

    TracInCP(z, z') = sum_k eta_k <grad l(w_k; z), grad l(w_k; z')>

A positive value means that gradient steps on ``z`` lowered the loss of ``z'`` (``z`` is a
*proponent*, it helped the prediction); a negative one that they raised it (an *opponent*).

Each test gradient is materialized (``T`` of them, ``T`` small), but the training examples'
gradients never are for layers with a rule: each training batch needs one forward and backward
pass and ``T`` dot products ``<g_i, v>`` (:meth:`pergrad.PerExampleResult.dot`) per checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
from keras import ops

from pergrad.backend import ENGINE_SUPPORTED, require_supported
from pergrad.backend.ops import wide_float
from pergrad.engine import PerExample


@dataclass(frozen=True)
class Checkpoint:
    """The model's weights (``model.get_weights()``) and the learning rate then in use."""

    weights: list[np.ndarray]
    learning_rate: float


@dataclass
class Influence:
    """``scores[j, i] = TracInCP(train example i, test example j)``, ``(T, N)``."""

    scores: np.ndarray
    checkpoints: int = field(default=0)

    def helpful(self, k: int = 4) -> np.ndarray:
        """``(T, k)``: per test example, the training examples with the largest positive
        influence (proponents), most helpful first."""
        return np.argsort(-self.scores, axis=1, kind="stable")[:, :k]

    def harmful(self, k: int = 4) -> np.ndarray:
        """``(T, k)``: per test example, the training examples with the most negative influence
        (opponents), most harmful first."""
        return np.argsort(self.scores, axis=1, kind="stable")[:, :k]


def influence(model: keras.Model, loss: Any, checkpoints: list[Checkpoint], x_train: Any,
              y_train: Any, x_test: Any, y_test: Any, batch_size: int = 256) -> Influence:
    """TracInCP scores of every training example for every test example (module docstring).

    Args:
        model: the trained Keras model (the inner model of a ``PerExampleModel``); its weights
            are set to each checkpoint in turn and restored afterwards.
        loss: the per-example loss (as for :class:`pergrad.PerExample`).
        checkpoints: e.g. ``pergrad.keras.TracInCheckpoints(...).checkpoints``.
        x_train, y_train: the training set (arrays, or dicts of arrays), ``N`` examples.
        x_test, y_test: the ``T`` test examples to explain.
        batch_size: training examples per pass.

    Gradients are taken in inference mode (``training=False``: no dropout).
    """
    require_supported("pergrad.stats.influence", ENGINE_SUPPORTED)
    if not checkpoints:
        raise ValueError("influence needs at least one checkpoint (train with "
                         "pergrad.keras.TracInCheckpoints among the callbacks).")
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
    pex = PerExample(model, loss)
    n = len(keras.tree.flatten(x_train)[0])
    t = len(keras.tree.flatten(x_test)[0])
    scores = np.zeros((t, n))
    dots = pex.compiled("influence_dots", _dots_body(pex))
    saved = model.get_weights()
    try:
        for checkpoint in checkpoints:
            model.set_weights(checkpoint.weights)
            test_gradients = pex.gradients(x_test, y_test)
            for start in range(0, n, batch_size):
                xb, yb, _ = pex.prepare(_rows(x_train, start, start + batch_size),
                                        _rows(y_train, start, start + batch_size))
                part = np.asarray(dots(xb, yb, None, test_gradients))
                scores[:, start:start + batch_size] += checkpoint.learning_rate * part
    finally:
        model.set_weights(saved)
    return Influence(scores, len(checkpoints))


def _dots_body(pex: PerExample):
    def body(x, y, w, test_gradients):
        result = pex.compute(x, y, w)
        count = test_gradients[0].shape[0]
        rows = [result.dot([g[j] for g in test_gradients]) for j in range(count)]
        return ops.cast(ops.stack(rows), wide_float())  # (T, B)
    return body


def _rows(structure: Any, start: int, stop: int) -> Any:
    return keras.tree.map_structure(lambda a: np.asarray(a)[start:stop], structure)
