"""``analyze``: train a user's model with a ``GradientMonitor`` and score every training example."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from pergrad.keras import INDEX_KEY, GradientMonitor, PerExampleModel, TracInCheckpoints
from pergrad.stats import Checkpoint, Influence, influence, label_error_scores, ranking


@dataclass
class Analysis:
    """What :func:`analyze` found.

    Attributes:
        scores: ``{name: (N,)}`` label-error scores, higher = more suspect
            (:func:`pergrad.stats.label_error_scores`; ``"default"`` is the recommended one).
        table: the monitor's per-example table (``GradientMonitor.example_table``).
        history: Keras's ``History.history``.
        model: the trained model (the one passed in, trained in place).
        loss: the loss it was trained with.
        monitor: the ``GradientMonitor`` (its ``history`` has the per-step statistics).
        checkpoints: weights and learning rate after each epoch, for :meth:`influence`.
    """

    scores: dict[str, np.ndarray]
    table: dict[str, np.ndarray]
    history: dict[str, list]
    model: keras.Model
    loss: Any
    monitor: GradientMonitor
    checkpoints: list[Checkpoint] = field(default_factory=list)

    def ranking(self, score: str = "default") -> np.ndarray:
        """Training-example indices, most suspect first by ``score``."""
        if score not in self.scores:
            raise ValueError(f"Unknown score {score!r}; choose from {sorted(self.scores)}.")
        return ranking(self.scores[score])

    def influence(self, x_train: Any, y_train: Any, x_test: Any, y_test: Any,
                  batch_size: int = 256) -> Influence:
        """TracIn over the saved checkpoints (:func:`pergrad.stats.influence`): which training
        examples helped or hurt each test example's prediction."""
        return influence(self.model, self.loss, self.checkpoints, x_train, y_train, x_test, y_test,
                         batch_size=batch_size)


def resolve_loss(model: keras.Model, loss: Any) -> Any:
    """``loss``, else the loss the model was compiled with; a clear error when there is none."""
    if loss is not None:
        return loss
    compiled = getattr(model, "loss", None)
    if compiled is None:
        raise ValueError("The model is not compiled with a loss: pass loss= (on the command "
                         "line, --loss NAME, e.g. --loss sparse_categorical_crossentropy "
                         "--from-logits).")
    return compiled


def analyze(model: keras.Model, x: Any, y: Any, *, loss: Any = None, optimizer: Any = None,
            epochs: int = 8, batch_size: int = 64, aggregator: Any = None,
            validation_data: Any = None, from_logits: bool | None = None,
            csv_path: str | None = None, callbacks: list | tuple = (), verbose: int = 0,
            monitor: GradientMonitor | None = None) -> Analysis:
    """Train ``model`` on ``(x, y)`` with ``PerExampleModel`` and a ``GradientMonitor`` that
    tracks every example, then score each training example (one forward and one backward pass
    per step, as plain training; the scores cost about as much as per-example norms).

    Args:
        model: a Keras model (trained in place, from its current weights).
        x, y: training inputs (an array, or a dict of arrays for a multi-input model) and labels.
        loss: the loss; ``None`` takes the model's compiled loss.
        optimizer: ``None`` takes the model's compiled optimizer, else ``Adam(1e-3)``.
        epochs, batch_size: as in ``fit`` (batches are shuffled; each example keeps its index).
        aggregator: a :mod:`pergrad.aggregate` aggregator (default: the mean, Keras's update).
        validation_data: passed to ``fit``.
        from_logits: whether the model outputs logits, for margins; ``None`` reads it from the
            loss (a warning says when it cannot).
        csv_path: where the monitor writes its per-step CSV.
        callbacks: more Keras callbacks.
        verbose: ``fit``'s verbosity.
        monitor: your own ``GradientMonitor(track_examples=True)`` (then ``csv_path`` and
            ``from_logits`` are its own settings).

    Example::

        analysis = pergrad.analysis.analyze(model, x, y, loss=loss, epochs=10)
        suspects = analysis.ranking()[:20]       # most likely mislabeled first
        analysis.scores["margin"]                # any single score
    """
    loss = resolve_loss(model, loss)
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None) or keras.optimizers.Adam(1e-3)
    n = len(np.asarray(y))
    if monitor is None:
        monitor = GradientMonitor(csv_path=csv_path, num_examples=n, from_logits=from_logits)
    elif not monitor.track_examples:
        raise ValueError("analyze needs GradientMonitor(track_examples=True).")
    trainer = PerExampleModel(model, aggregator=aggregator, monitor=monitor)
    trainer.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"]
                    if _looks_like_classes(y) else None)
    saver = TracInCheckpoints()
    inputs = dict(x) if isinstance(x, dict) else {"inputs": x}
    inputs[INDEX_KEY] = np.arange(n)
    history = trainer.fit(inputs, y, batch_size=batch_size, epochs=epochs,
                          validation_data=validation_data, callbacks=[saver, *callbacks],
                          verbose=verbose)
    table = monitor.example_table()
    if len(table["seen"]) < n:  # examples beyond the last index seen were never in a batch
        table = {k: _pad(v, n) for k, v in table.items()}
    return Analysis(label_error_scores(table), table, history.history, model, loss, monitor,
                    saver.checkpoints)


def _looks_like_classes(y: Any) -> bool:
    y = np.asarray(y)
    return y.ndim <= 2 and (np.issubdtype(y.dtype, np.integer) or (y.ndim == 2 and y.shape[1] > 1))


def _pad(values: np.ndarray, n: int) -> np.ndarray:
    if len(values) >= n:
        return values
    fill = np.nan if np.issubdtype(values.dtype, np.floating) else 0
    return np.concatenate([values, np.full(n - len(values), fill, values.dtype)])
