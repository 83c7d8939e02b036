"""Per-example classification quantities behind the data-debugging scores (traceable).

For one batch of a classifier with outputs ``f(x_i)`` (logits, or probabilities) and given labels
``y_i``, in the two-or-more-class view of :func:`class_scores`:

* ``p_i = softmax(f(x_i))`` (or ``f(x_i)`` itself when it already is a probability vector);
* **margin** (Pleiss et al. 2020, *Identifying Mislabeled Data using the Area Under the Margin
  Ranking*): ``m_i = z_{i,y_i} - max_{k != y_i} z_{i,k}`` on the logits ``z`` (on the
  probabilities when the model outputs probabilities); negative when the model prefers another
  class than the given one. Its mean over training is the *area under the margin*, AUM;
* **error norm** (Paul et al. 2021, *Deep Learning on a Data Diet*, EL2N):
  ``e_i = ||p_i - onehot(y_i)||_2``, in ``[0, sqrt(2)]``;
* **correct**: ``argmax_k f(x_i)_k == y_i``, the input of forgetting events (Toneva et al. 2019,
  *An Empirical Study of Example Forgetting during Deep Neural Network Learning*).

Labels may be integer class indices ``(B,)`` / ``(B, 1)`` or one-hot (or soft) rows ``(B, C)``
(whose argmax is the given class). A single output column ``(B,)`` / ``(B, 1)`` is a binary
classifier: a logit ``z`` becomes the two logits ``(0, z)`` (so ``softmax`` is ``sigmoid``), a
probability ``p`` the two probabilities ``(1 - p, p)``.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

#: What :func:`class_scores` returns per example.
CLASS_SCORES = ("margin", "error_norm", "correct")


def _is_tensor(value: Any) -> bool:
    return ops.is_tensor(value) or isinstance(value, keras.KerasTensor)


def classifier_outputs(predictions: Any, labels: Any) -> bool:
    """Whether ``predictions`` and ``labels`` (static shapes) look like one classifier's outputs
    and class labels: one output tensor ``(B,)``, ``(B, 1)`` or ``(B, C)``, and labels ``(B,)``,
    ``(B, 1)`` or ``(B, C)``."""
    if not (_is_tensor(predictions) and _is_tensor(labels)):
        return False
    p, y = tuple(predictions.shape), tuple(labels.shape)
    if len(p) not in (1, 2) or len(y) not in (1, 2):
        return False
    classes = 1 if len(p) == 1 else p[-1]
    return not (len(y) == 2 and y[-1] not in (1, classes) and None not in (y[-1], classes))


def _two_or_more_columns(predictions: Any, from_logits: bool) -> Any:
    z = predictions[:, None] if len(predictions.shape) == 1 else predictions
    if z.shape[-1] is None:
        raise ValueError("A classifier's number of outputs must be known when tracing; got "
                         f"predictions of shape {tuple(predictions.shape)}.")
    if z.shape[-1] != 1:
        return z
    if from_logits:
        return ops.concatenate([ops.zeros_like(z), z], axis=1)
    return ops.concatenate([1.0 - z, z], axis=1)


def given_classes(labels: Any, num_classes: int) -> Any:
    """``(B,)`` int32 class indices from integer labels or one-hot/soft rows."""
    if len(labels.shape) == 2 and labels.shape[-1] == num_classes and num_classes > 1:
        return ops.cast(ops.argmax(labels, axis=1), "int32")
    flat = ops.reshape(labels, [-1])
    if keras.backend.is_float_dtype(keras.backend.standardize_dtype(flat.dtype)):
        flat = ops.round(flat)
    return ops.cast(flat, "int32")


def class_scores(predictions: Any, labels: Any, from_logits: bool) -> dict[str, Any]:
    """``{"margin", "error_norm", "correct"}``, each ``(B,)`` in float32 (``correct`` is 0/1),
    as defined in the module docstring (traceable, any backend)."""
    predictions = ops.convert_to_tensor(predictions)
    labels = ops.convert_to_tensor(labels)
    z = ops.cast(_two_or_more_columns(predictions, from_logits), "float32")
    classes = z.shape[-1]
    given = given_classes(labels, classes)
    onehot = ops.one_hot(given, classes, dtype="float32")
    probabilities = ops.softmax(z, axis=1) if from_logits else z
    own = ops.sum(z * onehot, axis=1)
    lowest = ops.full_like(z, float(np.finfo(np.float32).min))
    others = ops.max(ops.where(onehot > 0, lowest, z), axis=1)
    error = probabilities - onehot
    predicted = ops.cast(ops.argmax(z, axis=1), "int32")
    return {
        "margin": own - others,
        "error_norm": ops.sqrt(ops.sum(error * error, axis=1)),
        "correct": ops.cast(ops.equal(predicted, given), "float32"),
    }


_PROBABILITY_LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy",
                       "binary_crossentropy", "categorical_focal_crossentropy",
                       "binary_focal_crossentropy")


def loss_from_logits(loss: Any) -> bool | None:
    """Whether a classification loss takes logits: a Keras loss object's ``from_logits``; a
    cross-entropy given by name or as Keras's function takes probabilities (Keras's default,
    ``False``); ``None`` for anything else (it cannot be known)."""
    if loss is None:
        return None
    value = getattr(loss, "from_logits", None)
    if isinstance(value, bool):
        return value
    name = loss if isinstance(loss, str) else getattr(loss, "__name__", None)
    if isinstance(name, str) and name.lower() in _PROBABILITY_LOSSES:
        return False
    return None
