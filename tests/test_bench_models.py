"""Every benchmark model builds, its ``batch()`` feeds it, every layer with weights has a rule, and
pergrad's per-example norms on it equal the loop oracle's (float32, as the benchmarks run)."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from oracle import assert_close, keras_loss, loop_gradients

import pergrad
from pergrad.bench.models import DEFAULT_BATCH, MODELS, batch

pytestmark = pytest.mark.tensorflow_only(reason=(
    "not yet run on JAX/PyTorch: backend-neutral Keras benchmark models (the JAX and PyTorch "
    "benchmarks build them too); would need np.asarray(norms) in place of .numpy() (a JAX array "
    "has none) and the compile time of the larger models on JAX"))

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_norms_match_the_loop_oracle(name):
    keras.utils.set_random_seed(0)
    model = MODELS[name]()
    x, y = batch(name, 4, seed=1)
    assert len(x) == len(y) == 4 and set(np.unique(y)) <= set(range(10))
    assert tuple(model(x).shape) == (4, 10)
    assert DEFAULT_BATCH[name] and all(b > 0 for b in DEFAULT_BATCH[name])

    pex = pergrad.PerExample(model, LOSS)
    assert [row for row in pex.plan.describe() if row[2] != "rule"] == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norms = pex.norms(x, y).numpy()
    ours = [str(w.message) for w in caught
            if "pergrad" in str(w.message) or "pergrad" in (w.filename or "")]
    assert ours == []

    grads, _ = loop_gradients(model, keras_loss(LOSS), x, y)
    expected = np.sqrt(sum(np.sum(g.reshape(4, -1) ** 2, axis=1) for g in grads))
    assert_close(norms, expected, rtol=1e-4, what=f"{name} per-example norms")


def test_batch_rejects_unknown_model():
    with pytest.raises(ValueError, match="unknown benchmark model"):
        batch("resnet50", 2)
