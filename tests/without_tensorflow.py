"""Run by tests/test_lazy_tensorflow.py with KERAS_BACKEND=jax or torch: pergrad's workflows
there must never import TensorFlow. On JAX: per-example gradients, training with DP aggregation,
the monitor and the privacy callback, statistics, accounting, Jacobians. On PyTorch:
per-example gradients, the aggregators and DP training with the privacy callback (its noise
drawn by NumPy's Philox). Exits 1 naming where it was first looked up."""

from __future__ import annotations

import sys
import traceback

first_import: list[str] = []


class _RecordTensorFlowImport:
    """Records the stack of the first lookup of ``tensorflow`` and lets it proceed, so code
    that catches ImportError behaves as usual. A lookup may be a mere availability probe
    (``importlib.util.find_spec``): only ``sys.modules`` says whether it was imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "tensorflow" and not first_import:
            first_import.extend(traceback.format_stack()[:-1])
        return None


sys.meta_path.insert(0, _RecordTensorFlowImport())

import os  # noqa: E402

if os.environ["KERAS_BACKEND"] == "jax":
    import jax

    jax.config.update("jax_enable_x64", True)  # DP noise keys need 64-bit integers on JAX

import keras  # noqa: E402
import numpy as np  # noqa: E402

import pergrad  # noqa: E402
from pergrad import aggregate  # noqa: E402

assert keras.backend.backend() == os.environ["KERAS_BACKEND"], keras.backend.backend()
rng = np.random.default_rng(0)
x = rng.normal(size=(32, 8)).astype("float32")
y = rng.integers(0, 3, 32)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build() -> keras.Model:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3)])


model = build()
pex = pergrad.PerExample(model, loss)
pex.norms(x, y)
pex.clipped_sum(x, y, 1.0)
pex.gradients(x, y)
pex.dot(x, y, [np.ones(v.shape, "float32") for v in model.trainable_variables])
result = pex.compute(x, y)
aggregate.clip_mean(1.0)(result)
aggregate.median()(result)

# DP training with the privacy callback: JAX draws its noise with threefry, PyTorch with
# NumPy's Philox; neither needs TensorFlow.
trained = pergrad.keras.PerExampleModel(build(), aggregate.dp_mean(1.0, 1.0, seed=0,
                                                                    expected_batch_size=8))
trained.compile(optimizer="adam", loss=loss)
trained.fit(x, y, batch_size=8, epochs=1, verbose=0,
            callbacks=[pergrad.keras.PrivacyCallback(32, 8, 1.0, delta=1e-5, verbose=0)])
aggregate.dp_mean(1.0, 1.0, seed=1)(result)

if keras.backend.backend() == "jax":
    pergrad.stats.gradient_statistics(pex, x, y)
    trained = pergrad.keras.PerExampleModel(build(), aggregate.dp_mean(1.0, 1.0, seed=0,
                                                                        expected_batch_size=8))
    trained.compile(optimizer="adam", loss=loss)
    monitor = pergrad.keras.GradientMonitor(every_n_steps=1)
    trained.fit(x, y, batch_size=8, epochs=1, verbose=0,
                callbacks=[monitor, pergrad.keras.PrivacyCallback(32, 8, 1.0, delta=1e-5, verbose=0)])
    pergrad.privacy.epsilon(32, 8, 1.0, 1, 1e-5)

    pergrad.jacobian(lambda z: model(z), batched=True)(x[:4])
    pergrad.hvp(lambda z: keras.ops.sum(model(z) ** 2), x[:2], x[:2])

if "tensorflow" in sys.modules:
    print("TensorFlow was imported; first looked up here:\n" + "".join(first_import[-12:]))
    sys.exit(1)
print("tensorflow not imported")
