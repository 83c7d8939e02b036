"""The one per-example loss adapter, ``pergrad.engine.losses.leaf_loss``, in its two uses:
``PerExample`` (summed over non-batch axes) and ``PerExampleModel`` (Keras's compiled loss)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from pergrad.engine.losses import leaf_loss


def _numpy(t) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(t))


def test_per_example_sums_and_compile_averages_over_non_batch_axes(rng):
    y_true = rng.normal(size=(4, 5, 3)).astype("float32")
    y_pred = rng.normal(size=(4, 5, 3)).astype("float32")
    loss = keras.losses.MeanSquaredError()  # elementwise: mean over the last axis -> (4, 5)
    per_step = np.mean((y_true - y_pred) ** 2, axis=-1)
    np.testing.assert_allclose(_numpy(leaf_loss(loss)(y_true, y_pred)), per_step.sum(1),
                               rtol=1e-6)
    compiled = _numpy(leaf_loss(loss, like_compile=True)(y_true, y_pred))
    np.testing.assert_allclose(compiled, per_step.mean(1), rtol=1e-6)
    # The batch mean of the compiled form is Keras's own reduced loss.
    np.testing.assert_allclose(compiled.mean(), _numpy(loss(y_true, y_pred)), rtol=1e-6)


def test_compile_form_casts_labels_like_keras_and_the_engine_leaves_them(rng):
    seen = {}

    def probe(y_true, y_pred):
        seen["dtype"] = keras.backend.standardize_dtype(y_true.dtype)
        return keras.ops.sum(y_pred, axis=-1)

    labels = keras.ops.convert_to_tensor(np.array([0, 1, 2], "int32"))
    predictions = rng.normal(size=(3, 2)).astype("float32")
    leaf_loss(probe)(labels, predictions)
    assert seen["dtype"] == "int32"
    leaf_loss(probe, like_compile=True)(labels, predictions)
    assert seen["dtype"] == keras.config.floatx()


def test_refusals():
    with pytest.raises(ValueError, match="ambiguous"):
        leaf_loss("crossentropy", like_compile=True)
    with pytest.raises(ValueError, match="reduction='sum'"):
        leaf_loss(keras.losses.MeanSquaredError(reduction="sum"), like_compile=True)
    with pytest.raises(TypeError, match="a Keras loss, a loss name, or a callable"):
        leaf_loss(3)
    scalar = leaf_loss(lambda y, p: keras.ops.mean(p))
    with pytest.raises(ValueError, match="returned a scalar"):
        scalar(np.zeros((2, 1), "float32"), np.zeros((2, 1), "float32"))
