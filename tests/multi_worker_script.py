"""One worker of the two-worker tests (tests/test_multi_worker.py); run as a script.

    python multi_worker_script.py INDEX PORT0,PORT1 MODE[,MODE...] OUT_DIR

The modes run one after another in the same two processes (one launch pays TensorFlow's start
and the cluster's set-up once). MODE ``train``: train every aggregator of ``AGGREGATORS`` with ``fit_distributed``; ``sequence``:
those of ``SEQUENCE`` one after another with Adam, sample weights and shuffled arrays;
``crash``: DP-SGD with checkpoints in ``OUT_DIR/ckpt`` (:func:`dp_run`), worker 1 killing itself
in the middle of epoch 2 (so it comes last); ``resume``: the same call again. Worker 0 writes
each mode's results as JSON to ``OUT_DIR/<MODE>.json`` as soon as the mode ends.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from pergrad import aggregate  # noqa: E402
from pergrad.keras import PerExampleModel, PrivacyCallback  # noqa: E402
from pergrad.keras.distributed import (  # noqa: E402
    WorkerFailureError,
    fit_distributed,
    multi_worker_strategy,
)

INDEX = 0  # this worker's index, set by main()

# Shared with the test, which trains the same models on one process.
N, FEATURES, CLASSES, BATCH, LR = 48, 20, 10, 16, 0.1
AGGREGATORS = {
    "mean": lambda: aggregate.mean(),
    "clip_mean": lambda: aggregate.clip_mean(0.5),
    "dp_mean": lambda: aggregate.dp_mean(0.5, 1.0, seed=3),
    "median": lambda: aggregate.median(),
}
# Trained one after another in the same processes with Adam, sample weights and shuffled arrays
# (MODE ``sequence``): each model's step is traced in processes that already ran others.
SEQUENCE = {
    "clip_mean": lambda: aggregate.clip_mean(0.5),
    "dp_mean": lambda: aggregate.dp_mean(0.5, 1.0, seed=3, expected_batch_size=10),
    "trimmed_mean": lambda: aggregate.trimmed_mean(0.25),
}


def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N),
            rng.uniform(0.5, 1.5, N).astype("float32"))


def inner_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])


def compiled(aggregator, optimizer: str = "sgd") -> PerExampleModel:
    model = PerExampleModel(inner_model(), aggregator)
    model.compile(optimizer=keras.optimizers.get({"class_name": optimizer,
                                                  "config": {"learning_rate": LR}}),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class _Die(keras.callbacks.Callback):
    """Worker 1 leaves without a word in the middle of epoch 2 (index 1)."""

    def on_train_batch_end(self, batch, logs=None):
        if INDEX == 1 and self._epoch == 1 and batch == 1:
            os._exit(3)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def dp_run(strategy, checkpoints: str, die: bool = False) -> dict:
    """Three epochs of 3 steps of DP-SGD, checkpoints after every epoch and every 2nd step of
    an epoch; its final state."""
    with strategy.scope():
        model = compiled(aggregate.dp_mean(0.5, 1.0, seed=7))
    privacy = PrivacyCallback(N, BATCH, 1.0, 1e-5, verbose=0)
    x, y, _ = data()
    fit_distributed(model, x, y, batch_size=BATCH, epochs=3, seed=5, checkpoint_dir=checkpoints,
                    checkpoint_every_n_steps=2, strategy=strategy,
                    callbacks=[privacy, _Die()] if die else [privacy])
    return {"weights": weights(model), "noise_state": model.noise_state.numpy().tolist(),
            "iterations": int(model.optimizer.iterations.numpy()),
            "privacy_steps": privacy.steps}


def dp_run_on_one_process(checkpoints: str) -> dict:
    """:func:`dp_run` under the default strategy (one device), for the tests' reference."""
    import tensorflow as tf

    return dp_run(tf.distribute.get_strategy(), checkpoints)


def weights(model) -> list:
    return [w.tolist() for w in model.model.get_weights()]


def main() -> None:
    global INDEX
    INDEX, ports, modes, out_dir = int(sys.argv[1]), sys.argv[2].split(","), \
        sys.argv[3].split(","), sys.argv[4]
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
        "task": {"type": "worker", "index": INDEX}})
    run(modes, out_dir)


def run(modes: list[str], out_dir: str) -> None:
    strategy = multi_worker_strategy(timeout_seconds=60)
    for mode in modes:
        out = run_mode(strategy, mode, out_dir)
        if INDEX == 0:
            with open(os.path.join(out_dir, f"{mode}.json"), "w") as handle:
                json.dump(out, handle)
    sys.stdout.flush()
    os._exit(0)  # no teardown collectives with a peer that may be gone


def run_mode(strategy, mode: str, out_dir: str) -> dict:
    """One mode's results (see the module's docstring)."""
    x, y, w = data()
    out = {"replicas": strategy.num_replicas_in_sync}
    if mode == "train":
        for name, make in AGGREGATORS.items():
            with strategy.scope():
                model = compiled(make())
            history = fit_distributed(model, x, y, sample_weight=w, batch_size=BATCH, epochs=1,
                                      shuffle=False, strategy=strategy)
            out[name] = {"weights": weights(model), "loss": history.history["loss"][-1]}
        try:
            model.fit(x, y, batch_size=BATCH, verbose=0)
        except ValueError as error:
            out["fit_refused"] = str(error)
    elif mode == "sequence":
        for name, make in SEQUENCE.items():
            with strategy.scope():
                model = compiled(make(), optimizer="adam")
            fit_distributed(model, x, y, sample_weight=w, batch_size=BATCH, epochs=2,
                            shuffle=True, seed=1, strategy=strategy)
            out[name] = {"weights": weights(model)}
    else:
        try:
            out["dp_run"] = dp_run(strategy, os.path.join(out_dir, "ckpt"), mode == "crash")
        except WorkerFailureError as error:
            out["failure"] = str(error)
    return out


if __name__ == "__main__":
    main()
