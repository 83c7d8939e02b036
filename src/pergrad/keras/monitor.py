"""``GradientMonitor``: gradient statistics inside the training step, logged while training."""

from __future__ import annotations

import csv
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from pergrad import backend
from pergrad.backend import ENGINE_SUPPORTED, require_supported
from pergrad.backend.ops import maximum
from pergrad.engine import PerExampleResult
from pergrad.keras.example_tables import ExampleTables, HostTables
from pergrad.rules.query import NORMS_THEN_ROWS
from pergrad.stats import (
    BATCH_STATISTICS,
    CONSENSUS_STATISTICS,
    active_examples,
    statistics_from_result,
)
from pergrad.stats.scores import class_scores, classifier_outputs

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
    training step the model calls :meth:`compute_alongside` with the step's
    ``PerExampleResult`` and its aggregator, so the statistics share its forward and backward
    pass, and on a monitored step the update reads the per-example matrices the statistics'
    norms built instead of computing its own weight pass
    (:func:`pergrad.stats.statistics_from_result`). The batch-level scalars
    (``batch_gradient_norm``, ``gradient_variance``, ``noise_scale``, ``snr``, ``norm_test``,
    ``inner_product_test``, ``orthogonality_test``, ``gradient_diversity``, ``fraction_opposed``)
    are returned into the training logs, hence the Keras history and the progress bar.

    As a callback (``PerExampleModel.fit`` adds it) it writes, for every monitored step, one CSV
    row (:func:`csv_columns`: step, epoch, the batch's mean loss, the batch statistics and the
    10/50/90 % quantiles of per-example norms and cosines) and TensorBoard scalars
    (``gradients/<statistic>``) and histograms (``per_example/norms``,
    ``per_example/cosine_to_batch``). Rows are also kept in :attr:`history`.

    Steps: a step counter counts calls of :meth:`compute`; steps with
    ``step % every_n_steps != 0`` skip the statistics (a ``cond``, nothing computed) and return
    the values of the last monitored step (NaN before the first one). With
    ``compile(steps_per_execution=k)`` only the last monitored step of each execution is written
    to the CSV and TensorBoard (the per-example tables count every monitored step).

    Backends: on TensorFlow the counters and tables are ``tf.Variable``s updated inside the
    compiled step. On JAX the statistics are computed inside the compiled step the same way and
    the step hands them (``O(B)`` numbers) to the host with an ordered
    ``jax.experimental.io_callback``, where the counters and tables live as NumPy arrays (a
    compiled JAX function can neither grow an array nor keep state outside the state it is
    given): no tracer is kept, and the same steps give the same tables on both backends. On
    PyTorch the step runs eagerly and updates the same host arrays directly.

    Per-example tracking (``track_examples=True``): for every training-example index it counts
    how often the example was in a monitored batch (``seen``), how often its gradient opposed the
    batch gradient (``opposed``: cosine < 0) and its cosines' sum (for ``mean_cosine``), and
    keeps the running sums behind the label-error scores (:meth:`example_table`,
    :func:`pergrad.stats.label_error_scores`): loss, gradient norm, TracIn self-influence and,
    for a classifier, margin, error norm and forgetting events. The
    indices are those the dataset supplies (``x["example_index"]``, passed to :meth:`compute` as
    ``indices``); without them they are derived from the sample order: ``position within the
    epoch + arange(B)`` (modulo ``num_examples`` when given), which is right only when shuffling
    is off; a warning says so. The tables grow to the largest index seen, so ``num_examples`` is
    optional. Examples with zero sample weight (padding) are not counted.

    Args:
        every_n_steps: compute the statistics on every n-th training step.
        log_dir: TensorBoard log directory (``None``: no TensorBoard). The event files are
            written with TensorFlow, on every backend: it must be installed.
        csv_path: CSV file (``None``: no CSV).
        track_examples: keep the per-example counts.
        num_examples: training-set size, to preallocate the counts (and wrap derived indices).
        from_logits: whether a classifier's outputs are logits, for margins, error norms and
            forgetting; ``None`` takes what ``PerExampleModel`` reads from the compiled loss.
    """

    def __init__(self, every_n_steps: int = 1, log_dir: str | None = None,
                 csv_path: str | None = None, track_examples: bool = True,
                 num_examples: int | None = None, from_logits: bool | None = None) -> None:
        super().__init__()
        require_supported("pergrad.keras.GradientMonitor", ENGINE_SUPPORTED)
        if int(every_n_steps) != every_n_steps or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps}.")
        if num_examples is not None and (int(num_examples) != num_examples or num_examples < 1):
            raise ValueError(f"num_examples must be a positive integer or None, got {num_examples}.")
        if log_dir is not None and not _tensorflow_installed():
            raise ImportError(
                "GradientMonitor(log_dir=...) writes TensorBoard's event files with TensorFlow, "
                "which is not installed: pip install pergrad[tensorflow] (any backend), or log "
                "with csv_path= instead.")
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
        # The one backend test of the monitor, on purpose: on TensorFlow its counters and
        # tables are tf.Variables updated inside the compiled step (no host round trip per
        # step, and tf.distribute replicas reach them); on JAX and PyTorch they live on the
        # host (_HostState), reached through backend.native().host_call.
        self._in_graph = backend.is_tensorflow()

        if self._in_graph:
            import tensorflow as tf

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
            self._tables = ExampleTables(self.num_examples or 0)
        else:
            self._host = _HostState(self.num_examples or 0)
            self._tables = self._host.tables
        self.from_logits = from_logits
        self._warned_classes = False

    # -- inside the training step ---------------------------------------------------------------
    def compute(self, result: PerExampleResult, indices: Any = None, sample_weight: Any = None,
                labels: Any = None, learning_rate: Any = None,
                from_logits: bool | None = None) -> dict[str, Any]:
        """The batch-level statistics of this step (traceable; call it in the train step).

        Returns ``{name: scalar}`` for the names in ``pergrad.stats.LOGGED_STATISTICS``, in the
        result's norm dtype. Also records what the callback writes and the per-example tables.
        ``labels`` (the batch's targets), ``learning_rate`` (this step's, for TracIn; 1 when not
        given, so ``self_influence`` is then ``sum_t ||g_i||^2``) and
        ``from_logits`` (whether the predictions are logits; the monitor's own setting wins)
        feed the per-example scores; ``PerExampleModel`` passes all three. Call it inside a
        ``tf.function`` on TensorFlow, inside ``jax.jit`` (or eagerly) on JAX.
        """
        return self.compute_alongside(result, None, indices=indices, sample_weight=sample_weight,
                                      labels=labels, learning_rate=learning_rate,
                                      from_logits=from_logits)[0]

    def compute_alongside(self, result: PerExampleResult, alongside: Callable[[Any], Any] | None,
                          indices: Any = None, sample_weight: Any = None, labels: Any = None,
                          learning_rate: Any = None,
                          from_logits: bool | None = None) -> tuple[dict[str, Any], Any]:
        """:meth:`compute`, and ``alongside(r)`` computed on the same per-example data:
        ``(statistics, alongside(r))`` (``None`` for ``alongside=None``).

        ``r`` is a ``PerExampleResult`` equal to ``result``. On TensorFlow a monitored step
        evaluates ``alongside`` inside its own branch after the statistics, on the result they
        were computed from, so a weighted sum there reads the per-example matrices the
        statistics' norms built (``C M``: one read of ``B x P`` numbers) instead of computing
        the sum again from the layer inputs (one more weight-gradient pass); a skipped step
        evaluates it on the result rebuilt in the other branch. ``PerExampleModel`` passes its
        aggregator's ``local``, so a monitored ``mean()`` step costs one weight pass less.
        ``alongside`` returns a structure of tensors (``None`` entries allowed). Elsewhere it is
        evaluated once, outside the monitor's own work (XLA merges the repeated products).
        """
        if self.track_examples and indices is None and not self._warned_order:
            warnings.warn(_ORDER_WARNING, stacklevel=3)
            self._warned_order = True
        logits = self.from_logits if self.from_logits is not None else from_logits
        classes = self._classification(result, labels, logits)
        if self._in_graph:
            return self._compute_tensorflow(result, indices, sample_weight, learning_rate,
                                            classes, alongside)
        shared = None if alongside is None else alongside(result)
        return (self._compute_on_host(result, indices, sample_weight, learning_rate, classes),
                shared)

    def _compute_tensorflow(self, result, indices, sample_weight, learning_rate, classes,
                            alongside):
        import tensorflow as tf

        step = self._step.read_value()
        self._step.assign_add(1)
        batch = tf.cast(result.batch_size, tf.int64)
        if self.track_examples and indices is None:
            indices = self._position.read_value() + tf.range(batch, dtype=tf.int64)
            if self.num_examples is not None:
                indices = indices % self.num_examples
        self._position.assign_add(batch)
        rate = tf.constant(1.0, tf.float64) if learning_rate is None \
            else tf.cast(learning_rate, tf.float64)

        branch_value = _BranchValue(alongside)

        def monitored():  # rebuilt: skipped steps must not compute what only this reads
            # Routed for the statistics (norms, sums, dot products): the alongside's sums then
            # read the per-example matrices their norms built.
            rebuilt = result.rebuilt().routed(NORMS_THEN_ROWS)
            stats, active, values = step_statistics(rebuilt, sample_weight)
            shared = branch_value.flat(rebuilt)  # after the norms: reads their matrices
            values = tf.cast(values, tf.float64)
            cosines = tf.cast(stats["cosine_to_batch"], tf.float64)
            updates = [self._last_stats.assign(values), self._last_step.assign(step),
                       self._last_norms.assign(tf.cast(stats["norms"], tf.float64)),
                       self._last_cosines.assign(cosines), self._last_active.assign(active)]
            if self.track_examples:
                updates.append(self._count(indices, active, stats, rate, classes))
            with tf.control_dependencies(updates):
                return tf.identity(values), shared

        def skipped():
            return self._last_stats.read_value(), branch_value.flat(result.rebuilt())

        values, shared = tf.cond(tf.equal(step % self.every_n_steps, 0), monitored, skipped)
        dtype = result.norm_dtype
        stats = {k: tf.cast(values[i], dtype) for i, k in enumerate(LOGGED_STATISTICS)}
        return stats, branch_value.rebuild(shared)

    def _compute_on_host(self, result, indices, sample_weight, learning_rate, classes):
        """JAX and PyTorch: the counters and tables are NumPy arrays on the host
        (:class:`_HostState`). A compiled JAX step reaches them through ordered
        ``io_callback``s; PyTorch runs eagerly and calls them directly."""
        dtype = result.norm_dtype
        batch = int(result.batch_size)
        host = self._host
        native = backend.native()
        # The host counts the step and says whether it is monitored (and what the last
        # monitored step's values were); only then does the step compute anything.
        monitored, last = native.host_call(
            lambda: host.begin(batch, self.every_n_steps, dtype),
            [((), "bool"), ((len(LOGGED_STATISTICS) + 1,), dtype)])

        def record(values: dict) -> None:
            host.record(values, self.track_examples, self.num_examples)

        def run():  # traced: rebuilt, so that skipped steps compute nothing only this reads
            stats, active, values = step_statistics(
                result if native.ROUTES.eager else result.rebuilt(), sample_weight)
            payload = {"values": values, "norms": stats["norms"],
                       "cosine_to_batch": stats["cosine_to_batch"], "active": active}
            if self.track_examples:
                payload.update(cosine_to_rest=stats["cosine_to_rest"], losses=stats["losses"],
                               rate=ops.ones([]) if learning_rate is None else learning_rate)
                if indices is not None:
                    payload["indices"] = ops.reshape(ops.convert_to_tensor(indices), [-1])
                if classes is not None:
                    payload.update({f"class_{k}": v for k, v in classes.items()})
            payload = {k: ops.convert_to_tensor(v) for k, v in payload.items()}
            native.host_call(record, None, payload)
            return values

        values = native.branch(monitored, run, lambda: ops.convert_to_tensor(last))
        return {k: values[i] for i, k in enumerate(LOGGED_STATISTICS)}

    def _classification(self, result: PerExampleResult, labels: Any,
                        from_logits: bool | None) -> dict[str, Any] | None:
        """:func:`pergrad.stats.class_scores` of the batch, or ``None`` (with one warning when
        only ``from_logits`` is missing) for outputs that are not one classifier's."""
        if not self.track_examples or labels is None:
            return None
        labels = keras.tree.map_structure(ops.convert_to_tensor, labels)
        if not classifier_outputs(result.predictions, labels):
            return None
        if from_logits is None:
            if not self._warned_classes:
                warnings.warn("GradientMonitor cannot tell whether the model outputs logits or "
                              "probabilities (the compiled loss does not say), so margins, error "
                              "norms and forgetting are not recorded; pass "
                              "GradientMonitor(from_logits=True or False).", stacklevel=4)
                self._warned_classes = True
            return None
        return class_scores(result.predictions, labels, bool(from_logits))

    def _count(self, indices, active, stats, rate, classes) -> Any:
        import tensorflow as tf

        idx = tf.boolean_mask(tf.cast(tf.reshape(indices, [-1]), tf.int64), active)

        def pick(values):
            return tf.boolean_mask(tf.cast(values, tf.float64), active)

        cos, rest = pick(stats["cosine_to_batch"]), pick(stats["cosine_to_rest"])
        norms, losses = pick(stats["norms"]), pick(stats["losses"])
        with tf.control_dependencies([self._tables.grow_to(idx)]):
            values = {"seen": tf.ones_like(idx), "opposed": cos < 0, "cosine_sum": cos,
                      "against": rest < 0, "rest_cosine_sum": rest, "loss_sum": losses,
                      "last_loss": losses, "norm_sum": norms,
                      "self_influence": rate * tf.square(norms)}
            if classes is not None:
                correct = tf.cast(pick(classes["correct"]) > 0.5, tf.int64)
                before = self._tables.gather("last_correct", idx)
                values.update({
                    "classified": tf.ones_like(idx), "error_norm_sum": pick(classes["error_norm"]),
                    "margin_sum": pick(classes["margin"]),
                    "forgotten": before * (1 - correct), "last_correct": correct,
                    "learned": tf.maximum(self._tables.gather("learned", idx), correct)})
            return self._tables.update(idx, values)

    # -- per-example results --------------------------------------------------------------------
    def example_table(self) -> dict[str, np.ndarray]:
        """Per training-example index (NaN means for examples never seen):

        * ``seen``: monitored batches the example was in;
        * against the batch gradient ``G``: ``opposed`` (cosine < 0), ``opposed_fraction``,
          ``mean_cosine``;
        * against the rest of the batch's consensus (``cosine_to_rest``, one vote per
          example): ``against_rest``, ``against_rest_fraction``, ``mean_cosine_to_rest``;
        * ``mean_loss`` and ``last_loss`` (at its latest monitored step), ``mean_norm`` (the
          mean of ``||g_i||``, GraNd) and ``self_influence`` (``sum_t eta_t ||g_i(w_t)||^2``
          over its monitored steps ``t``, TracIn);
        * for a classifier: ``classified`` (steps with margins), ``mean_error_norm`` (EL2N),
          ``mean_margin`` (AUM), ``forgetting_events`` (correct at one presentation, wrong at
          the next) and ``learned`` (ever classified correctly; ``False`` where never
          classified).

        :func:`pergrad.stats.label_error_scores` turns this table into rankings.
        """
        _wait_for_host_updates()
        t = self._tables.numpy()
        seen, classified = t["seen"], t["classified"]
        with np.errstate(invalid="ignore", divide="ignore"):
            def mean(values, count=seen):
                return np.where(count > 0, values / count, np.nan)
            return {"index": np.arange(len(seen)), "seen": seen, "opposed": t["opposed"],
                    "mean_cosine": mean(t["cosine_sum"]),
                    "opposed_fraction": mean(t["opposed"]), "against_rest": t["against"],
                    "against_rest_fraction": mean(t["against"]),
                    "mean_cosine_to_rest": mean(t["rest_cosine_sum"]),
                    "mean_loss": mean(t["loss_sum"]),
                    "last_loss": np.where(seen > 0, t["last_loss"], np.nan),
                    "mean_norm": mean(t["norm_sum"]),
                    "self_influence": np.where(seen > 0, t["self_influence"], np.nan),
                    "classified": classified,
                    "mean_error_norm": mean(t["error_norm_sum"], classified),
                    "mean_margin": mean(t["margin_sum"], classified),
                    "forgetting_events": t["forgotten"], "learned": t["learned"] > 0}

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
        _, _, norms, cosines, active = self._last()
        return {"norms": norms[active], "cosine_to_batch": cosines[active]}

    def _last(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The last monitored step: ``(step, values, norms, cosines, active)`` (step -1: none)."""
        if self._in_graph:
            return (int(self._last_step.numpy()), self._last_stats.numpy(),
                    self._last_norms.numpy(), self._last_cosines.numpy(),
                    self._last_active.numpy())
        _wait_for_host_updates()
        h = self._host
        return h.last_step, h.last_stats.copy(), h.last_norms, h.last_cosines, h.last_active

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
            import tensorflow as tf  # TensorBoard's event files, on every backend

            self._summary_writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self._in_graph:
            self._position.assign(0)
        else:
            _wait_for_host_updates()
            self._host.position = 0

    def _last_monitored_step(self) -> int:
        """The step :meth:`_last` would return, read alone (one number, not the tables)."""
        if self._in_graph:
            return int(self._last_step.numpy())
        _wait_for_host_updates()
        return self._host.last_step

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        step = self._last_monitored_step()
        if step < 0 or step == self._logged_step:
            return
        step, values, norms, cosines, active = self._last()
        self._logged_step = step
        per_example = {"norms": norms[active], "cosine_to_batch": cosines[active]}
        row: dict[str, float] = {"step": step, "epoch": self._epoch, "loss": float(values[-1])}
        row.update({k: float(v) for k, v in zip(LOGGED_STATISTICS, values, strict=False)})
        for name, key in (("norm", "norms"), ("cosine", "cosine_to_batch")):
            data = per_example[key]
            quantiles = (np.quantile(data, QUANTILES) if data.size
                         else np.full(len(QUANTILES), np.nan))
            for q, value in zip(QUANTILES, quantiles, strict=True):
                row[f"{name}_p{round(100 * q)}"] = float(value)
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


class _BranchValue:
    """``alongside(result)`` as the flat list of tensors a ``tf.cond`` branch returns (tensors
    only), and its structure, ``None`` leaves included, to rebuild it after the ``cond``."""

    def __init__(self, alongside: Callable[[Any], Any] | None) -> None:
        self.alongside = alongside
        self.structure: Any = None
        self.absent: list[bool] = []

    def flat(self, result: Any) -> list:
        if self.alongside is None:
            return []
        import tensorflow as tf

        self.structure = self.alongside(result)
        leaves = tf.nest.flatten(self.structure)
        self.absent = [t is None for t in leaves]
        return [tf.identity(t) for t in leaves if t is not None]

    def rebuild(self, flat: list) -> Any:
        if self.alongside is None:
            return None
        import tensorflow as tf

        given = iter(flat)
        leaves = [None if absent else next(given) for absent in self.absent]
        return tf.nest.pack_sequence_as(self.structure, leaves)


def step_statistics(result: PerExampleResult, sample_weight: Any) -> tuple[dict, Any, Any]:
    """One monitored step's statistics (traceable, any backend): ``(stats, active, values)``.

    ``stats`` is :func:`pergrad.stats.statistics_from_result` over the active examples: those
    with a non-zero sample weight and a finite loss and gradient norm (the examples
    ``PerExampleModel``'s aggregators drop are zeroed and weighted 0, so they cannot poison the
    running tables; on TensorFlow the masked recomputation runs only on steps that have such
    an example).
    ``active`` is ``(B,)`` bool; ``values`` the :data:`LOGGED_STATISTICS` and then the mean loss
    of the active examples, in the result's norm dtype.
    """
    given = ops.cast(active_examples(sample_weight, result.batch_size), result.norm_dtype)
    if not backend.native().ROUTES.cond_compiles_both_branches:  # one pass unless needed
        stats = statistics_from_result(result, given)
        keep = ops.logical_and(ops.isfinite(result.losses), ops.isfinite(stats["norms"]))
        weights = ops.where(keep, given, ops.zeros_like(given))
        stats = ops.cond(ops.all(keep), lambda: stats,
                         lambda: statistics_from_result(result.masked(keep), weights))
    else:
        # XLA compiles both branches of a cond: on JAX that made the step's compile time
        # 1.6x (docs/benchmarks.md, "DP noise, dispatch and compilation"). Masking with an
        # all-true mask changes no value, so JAX always computes the masked statistics (one
        # more norm pass at run time).
        keep = ops.logical_and(ops.isfinite(result.losses), ops.isfinite(result.norms()))
        weights = ops.where(keep, given, ops.zeros_like(given))
        stats = statistics_from_result(result.masked(keep), weights)
    active = active_examples(weights, result.batch_size)
    mask = ops.cast(active, stats["losses"].dtype)
    loss = ops.sum(stats["losses"] * mask) / maximum(ops.sum(mask), 1)
    dtype = stats["norms"].dtype
    values = ops.stack([ops.cast(stats[k], dtype) for k in LOGGED_STATISTICS]
                       + [ops.cast(loss, dtype)])
    return stats, active, values


class _HostState:
    """The JAX monitor's counters, last step and per-example tables, on the host.

    The compiled step calls :meth:`begin` and (on a monitored step) :meth:`record` through
    ordered ``io_callback``s, with concrete arrays: nothing here is ever a tracer. The same
    updates as the TensorFlow monitor's, in float64."""

    def __init__(self, size: int) -> None:
        self.step = 0
        self.position = 0
        self.pending: tuple[int, int] | None = None
        self.last_step = -1
        self.last_stats = np.full(len(LOGGED_STATISTICS) + 1, np.nan)
        self.last_norms = np.zeros(0)
        self.last_cosines = np.zeros(0)
        self.last_active = np.zeros(0, bool)
        self.tables = HostTables(size)

    def begin(self, batch: int, every_n_steps: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """Count a step of ``batch`` examples; return whether it is monitored and the last
        monitored step's values (for a skipped step)."""
        step, position = self.step, self.position
        self.step += 1
        self.position += batch
        self.pending = (step, position)
        return np.asarray(step % every_n_steps == 0), self.last_stats.astype(dtype)

    def record(self, values: dict, track: bool, num_examples: int | None) -> None:
        step, position = self.pending
        active = np.asarray(values["active"], bool)
        self.last_stats = np.asarray(values["values"]).astype(np.float64)
        self.last_step = step
        self.last_norms = np.asarray(values["norms"]).astype(np.float64)
        self.last_cosines = np.asarray(values["cosine_to_batch"]).astype(np.float64)
        self.last_active = active
        if not track:
            return
        if "indices" in values:
            indices = np.asarray(values["indices"]).astype(np.int64)
        else:  # derived from the sample order, as on TensorFlow
            indices = position + np.arange(len(active), dtype=np.int64)
            if num_examples is not None:
                indices = indices % num_examples
        idx = indices[active]

        def pick(name):
            return np.asarray(values[name]).astype(np.float64)[active]

        cos, rest, norms, losses = (pick(k) for k in ("cosine_to_batch", "cosine_to_rest",
                                                       "norms", "losses"))
        rate = np.float64(np.asarray(values["rate"]))
        tables = self.tables
        tables.grow_to(idx)
        update = {"seen": np.ones_like(idx), "opposed": cos < 0, "cosine_sum": cos,
                  "against": rest < 0, "rest_cosine_sum": rest, "loss_sum": losses,
                  "last_loss": losses, "norm_sum": norms, "self_influence": rate * norms ** 2}
        if "class_correct" in values:
            correct = (pick("class_correct") > 0.5).astype(np.int64)
            before = tables.gather("last_correct", idx)
            update.update({
                "classified": np.ones_like(idx), "error_norm_sum": pick("class_error_norm"),
                "margin_sum": pick("class_margin"), "forgotten": before * (1 - correct),
                "last_correct": correct,
                "learned": np.maximum(tables.gather("learned", idx), correct)})
        tables.update(idx, update)


def _wait_for_host_updates() -> None:
    """Let every dispatched step's host callback finish before reading the host state (JAX's
    ordered callbacks run asynchronously)."""
    backend.native().wait_for_host_callbacks()


def _tensorflow_installed() -> bool:
    """Whether TensorFlow can be imported (looked up, not imported)."""
    return importlib.util.find_spec("tensorflow") is not None


def _metadata(plugin: str) -> Any:
    from pergrad._compat import summary_metadata
    return summary_metadata(plugin)


def _scalar(tag: str, value: float, step: int) -> None:
    """A TensorBoard scalar, written with the core op (``tf.summary.scalar`` needs the
    tensorboard package, which pergrad does not depend on)."""
    import tensorflow as tf
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=_metadata("scalars"))


def _histogram(tag: str, data: np.ndarray, step: int, bins: int = 30) -> None:
    """A TensorBoard histogram in the plugin's format: rows of ``[left edge, right edge, count]``."""
    counts, edges = np.histogram(data, bins=bins)
    buckets = np.stack([edges[:-1], edges[1:], counts], axis=1).astype(np.float64)
    import tensorflow as tf
    tf.summary.write(tag, tf.constant(buckets), step=step, metadata=_metadata("histograms"))
