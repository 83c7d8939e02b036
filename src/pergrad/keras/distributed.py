"""``fit_distributed``: train a ``PerExampleModel`` on several workers with
``tf.distribute.MultiWorkerMirroredStrategy``, with checkpoints that survive a lost worker.

Keras 3's ``Model.fit`` does not run under ``MultiWorkerMirroredStrategy`` (keras-team/keras
issue 20585: its symbolic build and its log reduction convert per-replica values to tensors), so
this module runs the model's own ``train_step`` under ``strategy.run`` in a loop of its own, with
the same model, aggregator, callbacks and data as ``fit``. Everything distributed is
TensorFlow's: the dataset is split by ``strategy.experimental_distribute_dataset``, per-example
quantities are combined by the aggregator's collectives (one all-reduce of the ``P`` summed
gradient entries for linear aggregators; an all-gather of ``B x P`` rows for ``median``,
``trimmed_mean`` and ``custom``), and the optimizer applies the same update on every worker.

DP across workers: every example is clipped where it lives, the noise key comes from the model's
``noise_state`` (one value for all replicas), so noise of standard deviation ``C sigma / B`` is
added once per global step (the same draw on every worker, not one per worker), and the update
equals one worker's with the same global batch.

Faults: collectives time out after ``timeout_seconds`` (set on the strategy by
:func:`multi_worker_strategy`) and TensorFlow's health check aborts them when a peer dies; the
error is raised as :class:`WorkerFailureError`. Restart every worker with the same command:
training resumes from the last checkpoint in ``checkpoint_dir`` (weights, optimizer state, the
noise stream's position, the epoch and the step within it) and, with deterministic data (arrays,
or a dataset that is the same for a given epoch), reaches exactly the weights it would have
reached without the fault. Steps after the checkpoint are undone and run again with the same
noise keys; their earlier results never left the lost process, so no step is charged twice in
the privacy count and none is missing (the count is the model's ``noise_state`` counter and
``optimizer.iterations``, both restored).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from pergrad._compat import symbolic_build
from pergrad.backend import require_tensorflow
from pergrad.backend.lazy import tensorflow as tf
from pergrad.keras.faults import WorkerFailureError


def _peer_errors() -> tuple[type[Exception], ...]:
    """The errors a collective raises when a peer is gone or too slow."""
    return (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.CancelledError, tf.errors.AbortedError)


def multi_worker_strategy(timeout_seconds: float = 60.0,
                          cluster_resolver: Any = None) -> tf.distribute.MultiWorkerMirroredStrategy:
    """``MultiWorkerMirroredStrategy`` whose collectives fail after ``timeout_seconds`` instead
    of hanging. The cluster comes from ``TF_CONFIG`` (default) or ``cluster_resolver`` (e.g.
    ``tf.distribute.cluster_resolver.SlurmClusterResolver()``)."""
    if not timeout_seconds > 0:
        raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}.")
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=cluster_resolver,
                                                     communication_options=options)


def _is_chief(strategy: tf.distribute.Strategy) -> bool:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return True
    return resolver.task_type == "chief" or (resolver.task_type == "worker"
                                             and resolver.task_id == 0)


class _Checkpoints:
    """The chief writes ``directory``; every other worker writes (collectively) to a scratch
    folder it then deletes, as ``tf.distribute`` requires of multi-worker saves."""

    def __init__(self, strategy, directory: str, model, epoch: tf.Variable,
                 step: tf.Variable) -> None:
        self.directory = directory
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                              epoch=epoch, step_in_epoch=step)
        self.chief = _is_chief(strategy)
        resolver = getattr(strategy, "cluster_resolver", None)
        task = 0 if resolver is None or resolver.task_id is None else resolver.task_id
        self.write_dir = directory if self.chief else os.path.join(directory, f".worker{task}")
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.write_dir, max_to_keep=2)

    def restore(self) -> str | None:
        latest = tf.train.latest_checkpoint(self.directory)
        if latest is not None:
            self.checkpoint.restore(latest).assert_existing_objects_matched()
        return latest

    def save(self) -> None:
        self.manager.save()
        if not self.chief:
            shutil.rmtree(self.write_dir, ignore_errors=True)


def _epoch_dataset(x, y, sample_weight, batch_size: int, shuffle: bool, seed: int,
                   epoch: int) -> tf.data.Dataset:
    """The epoch's global batches of the arrays, in an order fixed by ``(seed, epoch)``."""
    arrays = (x, y) if sample_weight is None else (x, y, sample_weight)
    data = tf.data.Dataset.from_tensor_slices(arrays)
    if shuffle:
        data = data.shuffle(len(np.asarray(y)), seed=seed + epoch, reshuffle_each_iteration=False)
    return data.batch(batch_size)


def fit_distributed(model: keras.Model, x: Any = None, y: Any = None, *,
                    batch_size: int | None = None, epochs: int = 1, sample_weight: Any = None,
                    shuffle: bool = True, seed: int = 0, callbacks: list | None = None,
                    verbose: int = 0, checkpoint_dir: str | None = None,
                    checkpoint_every_n_steps: int | None = None,
                    strategy: tf.distribute.Strategy | None = None) -> keras.callbacks.History:
    """``model.fit`` for ``MultiWorkerMirroredStrategy`` (and any other ``tf.distribute``
    strategy): the model's ``train_step`` under ``strategy.run``, one global batch per step.

    Args:
        model: a compiled ``PerExampleModel`` (any aggregator) built and compiled inside
            ``strategy.scope()``. Every worker runs the same call.
        x, y, sample_weight: arrays (every worker holds the same arrays; each step's global batch
            is split between the replicas), or ``x`` a ``tf.data.Dataset`` of global batches
            ``(x, y[, w])``, or a function ``epoch -> tf.data.Dataset`` (then ``y`` is None).
            A dataset must yield the same batches for a given epoch to resume exactly.
        batch_size: the global batch size (arrays only).
        epochs: epochs to train, counting those already in the checkpoint.
        shuffle, seed: arrays only: shuffle each epoch in an order fixed by ``seed + epoch``.
        callbacks: Keras callbacks (``PrivacyCallback``, ``History``, ``EarlyStopping``, your
            own); they run on every worker.
        verbose: 0 silent, 1 progress bar (chief only).
        checkpoint_dir: a folder every worker can read (the chief writes it): resume from its
            latest checkpoint, save after every epoch.
        checkpoint_every_n_steps: also save every ``n`` steps within an epoch (a restart then
            skips the epoch's batches already done).
        strategy: the strategy the model was built in (default: the current one).

    Returns:
        The ``History`` of this call. Raises :class:`WorkerFailureError` when a worker is lost.
    """
    require_tensorflow("pergrad.keras.fit_distributed")
    strategy = strategy or tf.distribute.get_strategy()
    if not all(strategy.extended.variable_created_in_scope(getattr(v, "value", v))
               for v in model.variables):
        raise ValueError("Build and compile the model inside strategy.scope() of the strategy "
                         "passed to fit_distributed.")
    if getattr(model, "optimizer", None) is None:
        raise ValueError("Compile the model before fit_distributed.")
    if getattr(model, "monitor", None) is not None and strategy.num_replicas_in_sync > 1:
        raise ValueError("GradientMonitor keeps per-process tables and supports one replica; "
                         "train without a monitor under a multi-replica strategy.")
    if int(epochs) != epochs or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs}.")
    if checkpoint_every_n_steps is not None and (
            int(checkpoint_every_n_steps) != checkpoint_every_n_steps
            or checkpoint_every_n_steps < 1 or checkpoint_dir is None):
        raise ValueError("checkpoint_every_n_steps must be a positive integer, with "
                         f"checkpoint_dir; got {checkpoint_every_n_steps}.")
    datasets = _datasets(x, y, sample_weight, batch_size, shuffle, seed)

    epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False)
    step_var = tf.Variable(0, dtype=tf.int64, trainable=False)
    saver = None if checkpoint_dir is None else _Checkpoints(strategy, checkpoint_dir, model,
                                                             epoch_var, step_var)
    if saver is not None:
        saver.restore()
    first_epoch, skip = int(epoch_var.numpy()), int(step_var.numpy())
    with strategy.scope():
        # Every variable made before the step is traced (Adam's slots, the metrics'), as fit does.
        symbolic_build(model, next(iter(datasets(first_epoch))))

    @tf.function
    def train_step(iterator):
        strategy.run(model.train_step, args=(next(iterator),))

    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0 and _is_chief(strategy),
        model=model, verbose=verbose, epochs=epochs)
    model.stop_training = False
    callback_list.on_train_begin()
    logs: dict = {}
    try:
        for epoch in range(first_epoch, epochs):
            callback_list.on_epoch_begin(epoch)
            data = datasets(epoch).skip(skip) if skip else datasets(epoch)
            iterator = iter(strategy.experimental_distribute_dataset(data))
            step, steps = skip, skip + _cardinality(data)
            while step < steps:
                # Callbacks see batch indices from 0 for the steps this call runs in the epoch
                # (a resumed epoch's skipped steps were counted before the fault).
                callback_list.on_train_batch_begin(step - skip)
                train_step(iterator)
                logs = _metrics(model)
                step += 1
                if checkpoint_every_n_steps and step % checkpoint_every_n_steps == 0:
                    epoch_var.assign(epoch)
                    step_var.assign(step)
                    saver.save()
                callback_list.on_train_batch_end(step - 1 - skip, logs)
                if model.stop_training:
                    break
            finished = step >= steps  # else stopped by a callback within the epoch
            epoch_var.assign(epoch + 1 if finished else epoch)
            step_var.assign(0 if finished else step)
            if saver is not None:
                saver.save()
            callback_list.on_epoch_end(epoch, dict(logs))
            skip = 0
            if model.stop_training:
                break
    except _peer_errors() as error:
        where = "" if checkpoint_dir is None else (
            f" Training resumes from the last checkpoint in {checkpoint_dir} (epoch "
            f"{int(epoch_var.numpy())}, step {int(step_var.numpy())}) when every worker is "
            "started again.")
        raise WorkerFailureError(
            f"A worker stopped responding ({type(error).__name__}). Restart every worker with "
            f"the same command.{where}") from error
    callback_list.on_train_end(logs)
    return model.history


def _metrics(model) -> dict:
    """The model's metric results, read across replicas (a collective: every worker reads)."""
    return {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()
            if np.asarray(v).size == 1}


def _cardinality(data: tf.data.Dataset) -> int:
    count = int(data.cardinality().numpy())
    if count < 0:
        raise ValueError("fit_distributed needs a dataset of known, finite length (every worker "
                         "must run the same number of steps); use dataset.apply("
                         "tf.data.experimental.assert_cardinality(n)) if you know it.")
    return count


def _datasets(x, y, sample_weight, batch_size, shuffle, seed) -> Callable[[int], tf.data.Dataset]:
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError("With a dataset, y and sample_weight come from the dataset.")
        return lambda epoch: x
    if callable(x) and not hasattr(x, "shape"):
        return x
    if y is None or batch_size is None:
        raise ValueError("With arrays, pass x, y and the global batch_size.")
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
    return lambda epoch: _epoch_dataset(x, y, sample_weight, int(batch_size), shuffle, seed,
                                        epoch)
