"""``PerExampleModel`` under ``tf.distribute.MirroredStrategy`` on two logical CPU devices.

Logical devices must be configured before TensorFlow initializes, so the training runs in a fresh
subprocess that prints its measurements as JSON; the assertions are made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.tensorflow_only(reason=(
    "tf.distribute.MirroredStrategy over two logical TensorFlow CPU devices, in a TensorFlow "
    "subprocess")), pytest.mark.slow(reason="every case trains in one subprocess: ~60 s")]

SCRIPT = textwrap.dedent(r"""
    import json
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np
    from pergrad import aggregate
    from pergrad.keras import PerExampleModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, size=32)
    w = rng.uniform(0.5, 1.5, size=32).astype("float32")
    keras.utils.set_random_seed(0)
    init = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh",
                             kernel_regularizer=keras.regularizers.L2(0.01)),
                             keras.layers.Dense(3)]).get_weights()

    def train(agg, strategy=None, epochs=2):
        scope = strategy.scope() if strategy else keras.utils.custom_object_scope({})
        with scope:
            inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
                8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
                keras.layers.Dense(3)])
            inner.set_weights(init)
            model = PerExampleModel(inner, agg)
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        history = model.fit(x, y, sample_weight=w, batch_size=16, epochs=epochs, shuffle=False,
                            verbose=0)
        return inner.get_weights(), history.history

    def max_diff(a, b):
        return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {"replicas": strategy.num_replicas_in_sync}
    def by_loss(grads, norms, losses, predictions):
        # Examples weighted by softmax(-loss) and their top logit: needs the gathered extras.
        weights = tf.nn.softmax(-losses) * tf.reduce_max(predictions, axis=-1)
        return [tf.tensordot(weights, g, axes=1) for g in grads]

    # One aggregator per model: a seeded dp_mean feeds one noise stream; two built with the same
    # seed draw the same noise, which is what makes one device and two comparable.
    for name, make in [("mean", aggregate.mean), ("clip_mean", lambda: aggregate.clip_mean(0.5)),
                       ("median", aggregate.median),
                       ("trimmed_mean", lambda: aggregate.trimmed_mean(0.2)),
                       ("dp_mean", lambda: aggregate.dp_mean(0.5, 1.0, seed=11)),
                       ("custom_by_loss", lambda: aggregate.custom(by_loss))]:
        one, h1 = train(make())
        two, h2 = train(make(), strategy)
        out[name] = {"weights": max_diff(one, two),
                     "loss": float(np.max(np.abs(np.subtract(h1["loss"], h2["loss"])))),
                     "dropped": h2["dropped_examples"]}

    # Plain Keras under the same strategy, for the mean.
    with strategy.scope():
        plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
            8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(3)])
        plain.set_weights(init)
        plain.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain.fit(x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False, verbose=0)
    two, _ = train(aggregate.mean(), strategy)
    out["mean_vs_plain_keras"] = max_diff(two, plain.get_weights())

    # DP noise: one step of SGD(1) on a 1000-weight layer, dp_mean minus clip_mean is the noise
    # divided by the batch size; added once it has stddev C * sigma / B.
    xb = rng.normal(size=(16, 1000)).astype("float32")
    yb = rng.normal(size=(16, 1)).astype("float32")

    def one_step(agg, seed):
        with strategy.scope():
            inner = keras.Sequential([keras.Input((1000,)),
                                      keras.layers.Dense(1, use_bias=False,
                                                         kernel_initializer="zeros")])
            model = PerExampleModel(inner, agg)
            model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        model.fit(xb, yb, batch_size=16, epochs=1, verbose=0)
        return inner.get_weights()[0].ravel()

    noise = np.concatenate([one_step(aggregate.dp_mean(1.0, 4.0, seed=s), s)
                            - one_step(aggregate.clip_mean(1.0), s) for s in range(3)])
    out["noise_std"] = float(noise.std())
    out["noise_expected"] = 1.0 * 4.0 / 16

    # An embedding, whose clipped sums and per-example tables are nested XLA computations
    # inside each replica's step (backend.ops.segment_sum); ids repeat within examples.
    ids = rng.integers(0, 50, size=(32, 7)).astype("int32")
    ids[:, 1] = ids[:, 0]
    keras.utils.set_random_seed(1)
    def embedding_bag():
        return keras.Sequential([keras.Input((7,), dtype="int32"), keras.layers.Embedding(50, 4),
                                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    start = embedding_bag().get_weights()

    def train_embedding(agg, strategy=None):
        scope = strategy.scope() if strategy else keras.utils.custom_object_scope({})
        with scope:
            inner = embedding_bag()
            inner.set_weights(start)
            model = PerExampleModel(inner, agg)
            model.compile(optimizer=keras.optimizers.SGD(0.5),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(ids, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return inner.get_weights()

    for name, make in [("clip_mean", lambda: aggregate.clip_mean(0.05)),
                       ("dp_mean", lambda: aggregate.dp_mean(0.05, 1.0, seed=3)),
                       ("median", aggregate.median)]:
        one = train_embedding(make())
        out["embedding_" + name] = {"weights": max_diff(one, train_embedding(make(), strategy)),
                                    "moved": max_diff(one, start)}
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def measured():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT"):])


def test_two_replicas(measured):
    assert measured["replicas"] == 2


@pytest.mark.parametrize("name", ["mean", "clip_mean", "median", "trimmed_mean", "dp_mean",
                                  "custom_by_loss"])
def test_matches_one_device(measured, name):
    """Deterministic aggregators, and dp_mean with a fixed seed (the same noise draw), give the
    same weights and reported loss on two replicas as on one device."""
    assert measured[name]["weights"] < 1e-5, measured[name]
    assert measured[name]["loss"] < 1e-5, measured[name]
    assert measured[name]["dropped"] == [0.0, 0.0]


def test_mean_matches_plain_keras_under_strategy(measured):
    assert measured["mean_vs_plain_keras"] < 1e-5


def test_dp_noise_is_added_once_per_global_step(measured):
    """Per-replica noise would show as sqrt(2) (summed) or 1/sqrt(2) (averaged) of this."""
    ratio = measured["noise_std"] / measured["noise_expected"]
    assert abs(ratio - 1) < 0.1, measured


@pytest.mark.parametrize("name", ["clip_mean", "dp_mean", "median"])
def test_embedding_matches_one_device(measured, name):
    """An embedding's clipped (and noised) sums run as nested XLA computations inside each
    replica's step: the same weights on two replicas as on one device, after steps that moved
    them. The median reads the per-example tables, nested XLA computations before the sums
    were: a regression check of that route under replicas."""
    result = measured["embedding_" + name]
    assert result["weights"] < 1e-5 and result["moved"] > 1e-3, result
