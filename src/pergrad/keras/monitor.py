"""``GradientMonitor``: gradient statistics inside the training step, logged while training."""

from __future__ import annotations

import csv
import os
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad.engine import PerExampleResult
from pergrad.stats import (
    BATCH_STATISTICS,
    CONSENSUS_STATISTICS,
    active_examples,
    statistics_from_result,
)

#: The scalars the monitor logs each monitored step.
LOGGED_STATISTICS = (*BATCH_STATISTICS, *CONSENSUS_STATISTICS)

#: The quantiles of per-example norms and cosines written to the CSV and TensorBoard.
QUANTILES = (0.1, 0.5, 0.9)

_ORDER_WARNING = (
    "GradientMonitor(track_examples=True) got no example indices, so it derives them from the "
    "sample order (position within the epoch). That is right only when the data is not shuffled: "
    "fit(..., shuffle=False) on arrays, or a tf.data pipeline without shuffle. Put the index of "
    "every example in the inputs as x['example_index'] to track examples under shuffling."
)


def csv_columns(quantiles: tuple[float, ...] = QUANTILES) -> list[str]:
    """The CSV header: ``step, epoch, loss``, the batch statistics, then the quantile columns."""
    qs = [f"p{round(100 * q)}" for q in quantiles]
    return (["step", "epoch", "loss", *LOGGED_STATISTICS]
            + [f"norm_{q}" for q in qs] + [f"cosine_{q}" for q in qs])


class GradientMonitor(keras.callbacks.Callback):
    """Each example's gradient against the batch gradient, measured inside the training step.

    Give it to ``pergrad.keras.PerExampleModel(model, monitor=GradientMonitor(...))``. In the
    training step the model calls :meth:`compute` with the step's ``PerExampleResult``, so the
    statistics share its forward and backward pass; they cost one more weighted sum and one
    dot product per layer (:func:`pergrad.stats.statistics_from_result`). The batch-level scalars
    (``batch_gradient_norm``, ``gradient_variance``, ``noise_scale``, ``snr``, ``norm_test``,
    ``inner_product_test``, ``orthogonality_test``, ``gradient_diversity``, ``fraction_opposed``)
    are returned into the training logs, hence the Keras history and the progress bar.

    As a callback (``PerExampleModel.fit`` adds it) it writes, for every monitored step, one CSV
    row (:func:`csv_columns`: step, epoch, the batch's mean loss, the batch statistics and the
    10/50/90 % quantiles of per-example norms and cosines) and TensorBoard scalars
    (``gradients/<statistic>``) and histograms (``per_example/norms``,
    ``per_example/cosine_to_batch``). Rows are also kept in :attr:`history`.

    Steps: a step counter (a ``tf.Variable``) counts calls of :meth:`compute`; steps with
    ``step % every_n_steps != 0`` skip the statistics (``tf.cond``, nothing computed) and return
    the values of the last monitored step (NaN before the first one). With
    ``compile(steps_per_execution=k)`` only the last monitored step of each execution is written.

    Per-example tracking (``track_examples=True``): for every training-example index it counts
    how often the example was in a monitored batch (``seen``), how often its gradient opposed the
    batch gradient (``opposed``: cosine < 0) and its cosines' sum (for ``mean_cosine``). The
    indices are those the dataset supplies (``x["example_index"]``, passed to :meth:`compute` as
    ``indices``); without them they are derived from the sample order: ``position within the
    epoch + arange(B)`` (modulo ``num_examples`` when given), which is right only when shuffling
    is off; a warning says so. The tables grow to the largest index seen, so ``num_examples`` is
    optional. Examples with zero sample weight (padding) are not counted.

    Args:
        every_n_steps: compute the statistics on every n-th training step.
        log_dir: TensorBoard log directory (``None``: no TensorBoard).
        csv_path: CSV file (``None``: no CSV).
        track_examples: keep the per-example counts.
        num_examples: training-set size, to preallocate the counts (and wrap derived indices).
    """

    def __init__(self, every_n_steps: int = 1, log_dir: str | None = None,
                 csv_path: str | None = None, track_examples: bool = True,
                 num_examples: int | None = None) -> None:
        super().__init__()
        if int(every_n_steps) != every_n_steps or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps}.")
        if num_examples is not None and (int(num_examples) != num_examples or num_examples < 1):
            raise ValueError(f"num_examples must be a positive integer or None, got {num_examples}.")
        self.every_n_steps = int(every_n_steps)
        self.log_dir = log_dir
        self.csv_path = csv_path
        self.track_examples = track_examples
        self.num_examples = None if num_examples is None else int(num_examples)
        self.history: list[dict[str, float]] = []
        self._epoch = 0
        self._logged_step = -1
        self._csv_file = None
        self._csv_writer = None
        self._summary_writer = None
        self._warned_order = False

        def var(value, dtype, shape=None):
            return tf.Variable(value, dtype=dtype, trainable=False, shape=shape)

        unknown = tf.TensorShape([None])
        self._step = var(0, tf.int64)
        self._position = var(0, tf.int64)
        self._last_step = var(-1, tf.int64)
        # The last monitored step's batch statistics, then its mean loss.
        self._last_stats = var(np.full(len(LOGGED_STATISTICS) + 1, np.nan), tf.float64)
        self._last_norms = var(np.zeros(0), tf.float64, unknown)
        self._last_cosines = var(np.zeros(0), tf.float64, unknown)
        self._last_active = var(np.zeros(0, bool), tf.bool, unknown)
        size = self.num_examples or 0
        self._seen = var(np.zeros(size, np.int64), tf.int64, unknown)
        self._opposed = var(np.zeros(size, np.int64), tf.int64, unknown)
        self._cosine_sum = var(np.zeros(size), tf.float64, unknown)
        self._against = var(np.zeros(size, np.int64), tf.int64, unknown)
        self._rest_cosine_sum = var(np.zeros(size), tf.float64, unknown)

    # -- inside the training step ---------------------------------------------------------------
    def compute(self, result: PerExampleResult, indices: Any = None,
                sample_weight: Any = None) -> dict[str, tf.Tensor]:
        """The batch-level statistics of this step (traceable; call it in the train step).

        Returns ``{name: scalar}`` for the names in ``pergrad.stats.LOGGED_STATISTICS``, in the
        result's norm dtype. Also records what the callback writes and the per-example counts.
        """
        step = self._step.read_value()
        self._step.assign_add(1)
        batch = tf.cast(result.batch_size, tf.int64)
        if self.track_examples and indices is None:
            if not self._warned_order:
                warnings.warn(_ORDER_WARNING, stacklevel=2)
                self._warned_order = True
            indices = self._position.read_value() + tf.range(batch, dtype=tf.int64)
            if self.num_examples is not None:
                indices = indices % self.num_examples
        self._position.assign_add(batch)

        def monitored():
            # Non-finite examples (which PerExampleModel's aggregators drop) are inactive here
            # too: zeroed and weighted 0, so they cannot poison the running tables.
            # The masked recomputation runs only on steps that have such an example.
            given = tf.cast(active_examples(sample_weight, result.batch_size), result.norm_dtype)
            stats = statistics_from_result(result, given)
            keep = tf.logical_and(tf.math.is_finite(result.losses),
                                  tf.math.is_finite(stats["norms"]))
            weights = tf.where(keep, given, tf.zeros_like(given))

            def without_dropped():
                return statistics_from_result(result.masked(keep), weights)

            stats = tf.cond(tf.reduce_all(keep), lambda: stats, without_dropped)
            active = active_examples(weights, result.batch_size)
            mask = tf.cast(active, result.losses.dtype)
            loss = tf.reduce_sum(stats["losses"] * mask) / tf.maximum(tf.reduce_sum(mask), 1)
            values = tf.cast(tf.stack([stats[k] for k in LOGGED_STATISTICS]
                                      + [tf.cast(loss, stats["norms"].dtype)]), tf.float64)
            cosines = tf.cast(stats["cosine_to_batch"], tf.float64)
            updates = [self._last_stats.assign(values), self._last_step.assign(step),
                       self._last_norms.assign(tf.cast(stats["norms"], tf.float64)),
                       self._last_cosines.assign(cosines), self._last_active.assign(active)]
            if self.track_examples:
                rest = tf.cast(stats["cosine_to_rest"], tf.float64)
                updates.append(self._count(indices, active, cosines, rest))
            with tf.control_dependencies(updates):
                return tf.identity(values)

        def skipped():
            return self._last_stats.read_value()

        values = tf.cond(tf.equal(step % self.every_n_steps, 0), monitored, skipped)
        dtype = result.norm_dtype
        return {k: tf.cast(values[i], dtype) for i, k in enumerate(LOGGED_STATISTICS)}

    def _count(self, indices, active, cosines, rest_cosines) -> tf.Operation:
        idx = tf.boolean_mask(tf.cast(tf.reshape(indices, [-1]), tf.int64), active)
        cos = tf.boolean_mask(cosines, active)
        rest = tf.boolean_mask(rest_cosines, active)
        needed = tf.reduce_max(tf.concat([idx + 1, tf.zeros([1], tf.int64)], 0))
        tables = (self._seen, self._opposed, self._cosine_sum, self._against,
                  self._rest_cosine_sum)

        def grow():
            extra = needed - tf.size(self._seen, out_type=tf.int64)
            ops = [t.assign(tf.concat([t, tf.zeros([extra], t.dtype)], 0)) for t in tables]
            with tf.control_dependencies(ops):
                return tf.constant(True)

        grown = tf.cond(needed > tf.size(self._seen, out_type=tf.int64), grow,
                        lambda: tf.constant(False))
        with tf.control_dependencies([grown]):
            where = idx[:, None]
            ops = [self._seen.scatter_nd_add(where, tf.ones_like(idx)),
                   self._opposed.scatter_nd_add(where, tf.cast(cos < 0, tf.int64)),
                   self._cosine_sum.scatter_nd_add(where, cos),
                   self._against.scatter_nd_add(where, tf.cast(rest < 0, tf.int64)),
                   self._rest_cosine_sum.scatter_nd_add(where, rest)]
        return tf.group(ops)

    # -- per-example results --------------------------------------------------------------------
    def example_table(self) -> dict[str, np.ndarray]:
        """Per training-example index (NaN fractions and means for examples never seen):

        * ``seen``: monitored batches the example was in;
        * against the batch gradient ``G``: ``opposed`` (cosine < 0), ``opposed_fraction``,
          ``mean_cosine``;
        * against the rest of the batch's consensus (``cosine_to_rest``, one vote per
          example): ``against_rest``, ``against_rest_fraction``, ``mean_cosine_to_rest``.
        """
        seen = self._seen.numpy()
        opposed, against = self._opposed.numpy(), self._against.numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            def mean(values):
                return np.where(seen > 0, values / seen, np.nan)
            return {"index": np.arange(len(seen)), "seen": seen, "opposed": opposed,
                    "mean_cosine": mean(self._cosine_sum.numpy()),
                    "opposed_fraction": mean(opposed), "against_rest": against,
                    "against_rest_fraction": mean(against),
                    "mean_cosine_to_rest": mean(self._rest_cosine_sum.numpy())}

    def most_conflicting(self, k: int = 16, against: str = "rest") -> np.ndarray:
        """The ``k`` seen example indices that fought the others most.

        ``against="rest"`` (default) ranks by the lowest mean ``cosine_to_rest`` (each example's
        gradient against the consensus of the other examples of its batches); ``"batch"`` ranks
        by the highest fraction of steps opposed to the batch gradient (ties: lowest mean
        cosine). See :func:`pergrad.stats.formulas.consensus_statistics` for why "rest" finds
        mislabeled examples and "batch" does not.
        """
        if against not in ("rest", "batch"):
            raise ValueError(f"against must be 'rest' or 'batch', got {against!r}.")
        table = self.example_table()
        seen = table["seen"] > 0
        if against == "rest":
            order = np.argsort(table["mean_cosine_to_rest"][seen], kind="stable")
        else:
            order = np.lexsort((table["mean_cosine"][seen], -table["opposed_fraction"][seen]))
        return table["index"][seen][order][:k]

    def last_per_example(self) -> dict[str, np.ndarray]:
        """The last monitored batch's per-example ``norms`` and ``cosine_to_batch`` (active
        examples only)."""
        active = self._last_active.numpy()
        return {"norms": self._last_norms.numpy()[active],
                "cosine_to_batch": self._last_cosines.numpy()[active]}

    # -- callback -------------------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.csv_path is not None and self._csv_file is None:
            directory = os.path.dirname(os.path.abspath(self.csv_path))
            os.makedirs(directory, exist_ok=True)
            new = not self.history
            self._csv_file = open(self.csv_path, "w" if new else "a", newline="")  # noqa: SIM115
            self._csv_writer = csv.writer(self._csv_file)
            if new:
                self._csv_writer.writerow(csv_columns())
        if self.log_dir is not None and self._summary_writer is None:
            self._summary_writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._position.assign(0)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        step = int(self._last_step.numpy())
        if step < 0 or step == self._logged_step:
            return
        self._logged_step = step
        values = self._last_stats.numpy()
        per_example = self.last_per_example()
        row: dict[str, float] = {"step": step, "epoch": self._epoch, "loss": float(values[-1])}
        row.update({k: float(v) for k, v in zip(LOGGED_STATISTICS, values, strict=False)})
        for name, key in (("norm", "norms"), ("cosine", "cosine_to_batch")):
            data = per_example[key]
            for q in QUANTILES:
                row[f"{name}_p{round(100 * q)}"] = (float(np.quantile(data, q)) if data.size
                                                    else float("nan"))
        self.history.append(row)
        if self._csv_writer is not None:
            self._csv_writer.writerow([row[c] for c in csv_columns()])
            self._csv_file.flush()
        if self._summary_writer is not None:
            self._write_summaries(step, row, per_example)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = self._csv_writer = None
        if self._summary_writer is not None:
            self._summary_writer.flush()

    def _write_summaries(self, step: int, row: dict, per_example: dict) -> None:
        with self._summary_writer.as_default():
            for key, value in row.items():
                if key not in ("step", "epoch"):
                    _scalar(f"gradients/{key}", value, step)
            for key, data in per_example.items():
                if data.size:
                    _histogram(f"per_example/{key}", data, step)


def _metadata(plugin: str) -> tf.compat.v1.SummaryMetadata:
    return tf.compat.v1.SummaryMetadata(
        plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name=plugin))


def _scalar(tag: str, value: float, step: int) -> None:
    """A TensorBoard scalar, written with the core op (``tf.summary.scalar`` needs the
    tensorboard package, which pergrad does not depend on)."""
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=_metadata("scalars"))


def _histogram(tag: str, data: np.ndarray, step: int, bins: int = 30) -> None:
    """A TensorBoard histogram in the plugin's format: rows of ``[left edge, right edge, count]``."""
    counts, edges = np.histogram(data, bins=bins)
    buckets = np.stack([edges[:-1], edges[1:], counts], axis=1).astype(np.float64)
    tf.summary.write(tag, tf.constant(buckets), step=step, metadata=_metadata("histograms"))
