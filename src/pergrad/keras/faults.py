"""Surviving a lost process: :class:`WorkerFailureError`, and :class:`DistributedBackup`, a
``keras.callbacks.BackupAndRestore`` whose resume is exact for DP training on one or several
processes (any backend; on TensorFlow's ``MultiWorkerMirroredStrategy`` use
:func:`pergrad.keras.fit_distributed`, which checkpoints by itself).

How a fault plays out on several JAX processes (``jax.distributed.initialize``):

* **A process dies.** Its peers' next collective fails at once (gloo: "Connection closed by
  peer"); ``PerExampleModel.fit`` raises :class:`WorkerFailureError`, naming the epoch training
  resumes from. JAX's coordination service then terminates each survivor when it shuts down
  (or after ``heartbeat_timeout_seconds``, whichever is first).
* **A process stalls** (hung, stopped, cut off). Collectives wait, and the coordination service
  terminates every process once the stalled one has sent no heartbeat for
  ``heartbeat_timeout_seconds`` (``jax.distributed.initialize``'s argument, 100 by default):
  no hang past that bound, but no Python exception either (JAX aborts with "Terminating process
  because the JAX distributed service detected fatal errors").

Either way, restart every process with the same command: :class:`DistributedBackup` puts back
the weights, the optimizer state, the noise stream's position and the epoch of the last
checkpoint, so training reaches the weights it would have reached without the fault.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Iterator

import keras
import numpy as np

from pergrad import backend


class WorkerFailureError(RuntimeError):
    """A worker (process) stopped responding during distributed training."""


#: The file in which ``keras.callbacks.BackupAndRestore`` keeps the epoch to resume from.
_METADATA = "training_metadata.json"

#: The file in which :class:`DistributedBackup` records how many noise keys have been drawn.
_KEYS_DRAWN = "keys_drawn.json"

#: Text of the XLA runtime errors a collective raises when a peer process is gone.
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "heartbeat",
              "unavailable", "deadline exceeded", "socket closed", "connection refused")


class DistributedBackup(keras.callbacks.Callback):
    """``keras.callbacks.BackupAndRestore`` made exact for DP and several processes.

    It runs Keras's callback (its format: ``latest.weights.h5`` with the model's weights, the
    optimizer's variables and, for a ``PerExampleModel``, its ``noise_state``; a metadata file
    with the epoch to resume from) and adds three things:

    * **One checkpoint per process.** On ``n > 1`` JAX processes, process ``i`` writes under
      ``backup_dir/process_i``: no two processes write one file, on a shared file system or a
      local one. The values are replicated, so every copy is the same.
    * **Epoch boundaries only.** Keras's ``save_freq=<int>`` saves mid-epoch but resumes at the
      start of that epoch, so the batches before the checkpoint would be trained on twice and
      charged twice in the privacy count. Only ``save_freq="epoch"`` is accepted.
    * **All processes resume from the same point.** After restoring, the processes compare
      ``(epoch, optimizer.iterations, noise counter)``; a process whose checkpoint is older (it
      died while the others saved) makes every process raise, instead of training on
      different weights.

    **Noise keys after a restart.** The steps run after the last checkpoint drew noise keys
    before the fault; the callback records how many (``keys_drawn.json``, after every batch).
    On a restart it never draws one of those keys for *other* data:

    * by default the noise counter moves past every key the lost run drew, so the steps run
      again get fresh keys, and :class:`~pergrad.keras.PrivacyCallback` charges the lost run's
      steps too (their noisy updates may have left it: logs, TensorBoard, a saver);
    * with ``replay_same_batches=True`` the counter is restored to the checkpoint's, so every
      step run again draws the key it drew before, for the same batch: the same noisy update,
      released again, costs no privacy, and training reaches exactly the weights, optimizer
      state and noise position of the run without the fault. Pass it only when every epoch's
      batches are the same after a restart (arrays with ``shuffle=False``, ``poisson_batches``
      with a ``seed``, a dataset built from the epoch number); ``PerExampleModel.fit`` refuses
      it with arrays and ``shuffle=True``.

    ``fit`` runs this callback first, so that every other callback (``PrivacyCallback`` above
    all) sees the restored state.

    The process's folder is chosen when training begins, so the callback may be made before
    ``jax.distributed.initialize``.
    """

    def __init__(self, backup_dir: str, save_freq: str = "epoch",
                 double_checkpoint: bool = False, delete_checkpoint: bool = True,
                 replay_same_batches: bool = False) -> None:
        super().__init__()
        if save_freq != "epoch":
            raise ValueError(
                f"DistributedBackup saves at epoch boundaries only (save_freq='epoch'), got "
                f"save_freq={save_freq!r}. Keras's BackupAndRestore resumes a mid-epoch "
                "checkpoint at the start of its epoch, which trains on (and charges privacy "
                "for) the batches before the checkpoint twice.")
        if not backup_dir:
            raise ValueError("Empty `backup_dir` argument passed")
        self.shared_dir = str(backup_dir)
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.replay_same_batches = bool(replay_same_batches)
        self._keras: keras.callbacks.BackupAndRestore | None = None
        self._keys_at_epoch_begin = 0
        self._keys_per_step = 0

    @property
    def backup_dir(self) -> str:
        """This process's folder: ``backup_dir``, or ``backup_dir/process_i`` on several."""
        if _process_count() > 1:
            return os.path.join(self.shared_dir, f"process_{_process_index()}")
        return self.shared_dir

    def _callback(self) -> keras.callbacks.BackupAndRestore:
        if self._keras is None:
            self._keras = keras.callbacks.BackupAndRestore(
                self.backup_dir, save_freq="epoch", double_checkpoint=self.double_checkpoint,
                delete_checkpoint=self.delete_checkpoint)
        self._keras.set_model(self.model)
        return self._keras

    def on_train_begin(self, logs=None) -> None:
        self._callback().on_train_begin(logs)
        if _process_count() > 1:
            _require_same_position(self.resume_position())
        state = getattr(self.model, "noise_state", None)
        aggregator = getattr(self.model, "aggregator", None)
        self._keys_per_step = int(state is not None and bool(getattr(aggregator, "noisy", False)))
        if state is None:
            return
        seed, counter = (int(v) for v in keras.ops.convert_to_numpy(state))
        drawn = _agreed_maximum(self._keys_drawn())
        if drawn > counter and not self.replay_same_batches:
            # Skip every key the lost run drew after the checkpoint: it may have been used on
            # batches other than the ones the restart sees.
            state.assign(np.array([seed, drawn], dtype=np.int64))
            counter = drawn
        self._keys_at_epoch_begin = counter
        self._write_keys_drawn(counter)

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        self._steps_in_epoch = 0

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        # ``batch`` is the index of the last step run in this epoch (steps_per_execution > 1
        # skips indices); each noisy step drew one key.
        if self._keys_per_step:
            self._steps_in_epoch = batch + 1
            self._write_keys_drawn(self._keys_at_epoch_begin + self._steps_in_epoch)

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        self._keys_at_epoch_begin += self._keys_per_step * getattr(self, "_steps_in_epoch", 0)
        self._steps_in_epoch = 0
        self._callback().on_epoch_end(epoch, logs)

    def _keys_drawn(self) -> int:
        """The most noise keys any earlier run in this folder drew (0 if none was recorded)."""
        path = os.path.join(self.backup_dir, _KEYS_DRAWN)
        if not os.path.exists(path):
            return 0
        with open(path) as file:
            return int(json.load(file)["keys_drawn"])

    def _write_keys_drawn(self, count: int) -> None:
        os.makedirs(self.backup_dir, exist_ok=True)
        path = os.path.join(self.backup_dir, _KEYS_DRAWN)
        with open(path + ".tmp", "w") as file:
            json.dump({"keys_drawn": int(count)}, file)
        os.replace(path + ".tmp", path)  # atomic: a crash leaves the old count or the new

    def on_train_end(self, logs=None) -> None:
        self._callback().on_train_end(logs)

    def resume_position(self) -> np.ndarray:
        """``[epoch, optimizer iterations, noise counter]`` this process starts training from
        (the noise counter is -1 for a model without a noise stream)."""
        iterations = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        state = getattr(self.model, "noise_state", None)
        counter = -1 if state is None else int(keras.ops.convert_to_numpy(state)[1])
        return np.array([self.resume_epoch(), iterations, counter], dtype=np.int64)

    def resume_epoch(self) -> int:
        """The epoch a restart would begin with: the one after the last saved checkpoint."""
        path = os.path.join(self.backup_dir, _METADATA)
        if not os.path.exists(path):
            return 0
        with open(path) as file:
            return int(json.load(file)["epoch"])


def _process_count() -> int:
    return backend.native().process_count()


def _process_index() -> int:
    import jax
    return jax.process_index()


def _agreed_maximum(value: int) -> int:
    """The largest ``value`` over all JAX processes (the value itself on one process)."""
    if _process_count() <= 1:
        return value
    from jax.experimental import multihost_utils
    return int(np.max(np.asarray(multihost_utils.process_allgather(np.int64(value)))))


def _require_same_position(position: np.ndarray) -> None:
    """Every process's resume position, compared across processes (one small all-gather)."""
    from jax.experimental import multihost_utils
    positions = np.asarray(multihost_utils.process_allgather(position))
    if not (positions == positions[0]).all():
        rows = ", ".join(f"process {i}: epoch {p[0]}, step {p[1]}, noise counter {p[2]}"
                         for i, p in enumerate(positions))
        raise WorkerFailureError(
            "The processes restored different checkpoints (" + rows + "): one of them stopped "
            "while the others saved. Restore every process from the same epoch (the oldest, "
            "kept by double_checkpoint=True, or start over) before training again.")


@contextlib.contextmanager
def lost_process_errors(callbacks=None) -> Iterator[None]:
    """Raise :class:`WorkerFailureError` for the runtime error a collective gives when a peer
    process is gone (several JAX processes only; anything else passes through unchanged)."""
    try:
        yield
    except Exception as error:
        if _process_count() <= 1 or not _is_peer_loss(error):
            raise
        backup = _backup_in(callbacks)
        where = ("Restart every process with the same command: training resumes from epoch "
                 f"{backup.resume_epoch()} of the checkpoints in {backup.shared_dir!r}."
                 if backup is not None else
                 "No DistributedBackup callback was given, so a restart begins from the "
                 "start; pass pergrad.keras.DistributedBackup(backup_dir) to resume instead.")
        raise WorkerFailureError(
            f"A peer process stopped responding during training on {_process_count()} JAX "
            f"processes ({type(error).__name__}: {str(error).splitlines()[0][:300]}). "
            + where) from error


def backups_first(model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fit``'s arguments with every ``BackupAndRestore`` (``DistributedBackup`` included)
    moved to the front of the callbacks, so that the state it restores is what every other
    callback sees when training begins (``PrivacyCallback`` counts the restored noise steps).
    Refuses ``DistributedBackup(replay_same_batches=True)`` for a noisy model trained on arrays
    with ``shuffle=True``: a restart would draw the replayed keys for other batches."""
    bound = inspect.signature(keras.Model.fit).bind_partial(model, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks")
    items = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) \
        else list(callbacks or ())
    backups = [c for c in items if isinstance(c, (DistributedBackup,
                                                  keras.callbacks.BackupAndRestore))]
    if not backups:
        return args, kwargs
    noisy = bool(getattr(getattr(model, "aggregator", None), "noisy", False))
    x = bound.arguments.get("x")
    arrays = x is not None and not _is_dataset_like(x)
    if noisy and arrays and bound.arguments.get("shuffle", True) and any(
            getattr(c, "replay_same_batches", False) for c in backups):
        raise ValueError(
            "DistributedBackup(replay_same_batches=True) replays each step's noise key after a "
            "restart, which is sound only for the same batch; fit shuffles arrays "
            "(shuffle=True) differently after a restart. Pass shuffle=False, or leave "
            "replay_same_batches off (the restart then draws fresh keys).")
    reordered = backups + [c for c in items if not any(c is b for b in backups)]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks[:] = reordered
    else:
        bound.arguments["callbacks"] = reordered
    return bound.args[1:], bound.kwargs


def _is_dataset_like(x) -> bool:
    """A ``tf.data.Dataset``, a ``keras.utils.PyDataset``, a generator or another iterable
    Keras iterates as it is (not arrays, which ``fit`` shuffles itself)."""
    if isinstance(x, (np.ndarray, list, tuple, dict)) or hasattr(x, "__array__"):
        return False
    return hasattr(x, "__iter__") or hasattr(x, "__getitem__")


def _is_peer_loss(error: Exception) -> bool:
    import jax
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    text = str(error).lower()
    return any(marker in text for marker in _PEER_LOST)


def _backup_in(callbacks) -> DistributedBackup | None:
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in callbacks or ():
        if isinstance(callback, DistributedBackup):
            return callback
    return None


__all__ = ["DistributedBackup", "WorkerFailureError", "backups_first", "lost_process_errors"]
