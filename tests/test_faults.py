"""``DistributedBackup`` and the lost-process error, in one process (the multi-process runs are
in tests/test_jax_multi_process.py and tests/test_multi_worker.py)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from pergrad import aggregate
from pergrad.keras import DistributedBackup, PerExampleModel, WorkerFailureError, faults


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 3, size=32)


def _model() -> PerExampleModel:
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    model = PerExampleModel(inner, aggregate.dp_mean(0.5, 1.0, seed=5))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _Interrupt(keras.callbacks.Callback):
    """Raise in the middle of epoch 1, as a lost process would end the run."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 2:
            raise KeyboardInterrupt


def _numpy(variables) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(v.value) for v in variables]


def test_restart_resumes_weights_optimizer_and_noise_exactly(tmp_path):
    x, y = _data()
    uninterrupted = _model()
    uninterrupted.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)

    interrupted = _model()
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                        callbacks=[DistributedBackup(tmp_path, replay_same_batches=True),
                                   _Interrupt()])
    backup = DistributedBackup(tmp_path, replay_same_batches=True)
    assert backup.resume_epoch() == 1
    restarted = _model()  # a new process: same code, fresh weights
    history = restarted.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                            callbacks=[backup])
    assert history.epoch == [1, 2]  # the last checkpoint's epoch onwards, not from the start
    for got, want in zip(restarted.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(_numpy(restarted.optimizer.variables),
                         _numpy(uninterrupted.optimizer.variables), strict=True):
        np.testing.assert_array_equal(got, want)
    # 12 steps in all: the 3 steps of epoch 1 before the interruption were undone with the
    # weights, and their keys were drawn again for the same batches (the same noisy updates).
    assert keras.ops.convert_to_numpy(restarted.noise_state).tolist() == [5, 12]
    assert not tmp_path.joinpath("latest.weights.h5").exists()  # deleted after a finished fit


def test_by_default_a_restart_draws_fresh_keys_and_charges_the_lost_steps(tmp_path):
    """Without replay_same_batches the keys the lost run drew after the checkpoint are never
    drawn again (the restart may see other batches), and PrivacyCallback counts them, whatever
    the order of the callbacks."""
    from pergrad.keras import PrivacyCallback
    x, y = _data()
    interrupted = _model()
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(x, y, batch_size=8, epochs=3, verbose=0,
                        callbacks=[DistributedBackup(tmp_path), _Interrupt()])
    # Epoch 0: 4 keys (checkpointed); epoch 1: 3 more before the interruption.
    restarted = _model()
    privacy = PrivacyCallback(num_examples=32, batch_size=8, noise_multiplier=1.0, delta=1e-5)
    history = restarted.fit(x, y, batch_size=8, epochs=3, verbose=0,
                            callbacks=[privacy, DistributedBackup(tmp_path)])
    assert history.epoch == [1, 2]
    # Restored counter 4, moved past the 7 keys drawn, then 8 new steps.
    assert keras.ops.convert_to_numpy(restarted.noise_state).tolist() == [5, 15]
    assert privacy.steps == 15  # every noisy update computed, the lost ones included


def test_replaying_keys_on_shuffled_arrays_is_refused(tmp_path):
    x, y = _data()
    model = _model()
    with pytest.raises(ValueError, match="shuffle=False"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[DistributedBackup(tmp_path, replay_same_batches=True)])
    plain = PerExampleModel(_model().model, aggregate.mean())  # no noise: nothing to replay
    plain.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[DistributedBackup(tmp_path, replay_same_batches=True)])


def test_mid_epoch_checkpoints_are_refused(tmp_path):
    with pytest.raises(ValueError, match="trains on .* twice"):
        DistributedBackup(tmp_path, save_freq=5)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX processes")
def test_processes_restoring_different_epochs_refuse_to_train(monkeypatch):
    from jax.experimental import multihost_utils
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda position: np.stack([position, position - [1, 2, 2]]))
    with pytest.raises(WorkerFailureError, match="restored different checkpoints"):
        faults._require_same_position(np.array([2, 8, 8]))
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda position: np.stack([position, position]))
    faults._require_same_position(np.array([2, 8, 8]))  # the same everywhere: no error


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX processes")
def test_a_lost_peer_becomes_worker_failure_error_naming_the_resume_epoch(tmp_path,
                                                                          monkeypatch):
    import jax
    monkeypatch.setattr(faults, "_process_count", lambda: 2)
    monkeypatch.setattr(faults, "_process_index", lambda: 0)
    backup = DistributedBackup(tmp_path)
    lost = jax.errors.JaxRuntimeError(
        "UNKNOWN: Gloo all-reduce failed: Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(WorkerFailureError, match="resumes from epoch 0") as raised, \
            faults.lost_process_errors([backup]):
        raise lost
    assert raised.value.__cause__ is lost and str(tmp_path) in str(raised.value)
    with pytest.raises(WorkerFailureError, match="No DistributedBackup"), \
            faults.lost_process_errors():
        raise lost
    # Any other error passes through unchanged.
    with pytest.raises(jax.errors.JaxRuntimeError), faults.lost_process_errors([backup]):
        raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes differ")
    with pytest.raises(ValueError), faults.lost_process_errors([backup]):
        raise ValueError("not a runtime error")


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX processes")
def test_monitor_is_refused_on_several_processes(monkeypatch):
    import jax

    from pergrad.keras import GradientMonitor
    x, y = _data()
    model = _model()
    model = PerExampleModel(model.model, aggregate.mean(), monitor=GradientMonitor())
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="keeps its per-example tables in one process"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="keeps its per-example tables in one process"):
        model.train_on_batch(x[:8], y[:8])
