"""``TracInCheckpoints``: the weights and learning rate at the end of every few epochs, kept in
memory for :func:`pergrad.stats.influence`."""

from __future__ import annotations

import keras
import numpy as np

from pergrad.stats.influence import Checkpoint


class TracInCheckpoints(keras.callbacks.Callback):
    """Keep ``Checkpoint(weights, learning_rate)`` of the trained model every ``every_n_epochs``
    epochs (and after the last one), for TracIn (:func:`pergrad.stats.influence`).

    The weights are those of the model being explained: the inner model of a
    ``PerExampleModel``, or the fitted model itself. They are held in memory: ``K`` checkpoints
    cost ``K`` copies of the weights.
    """

    def __init__(self, every_n_epochs: int = 1) -> None:
        super().__init__()
        if int(every_n_epochs) != every_n_epochs or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be a positive integer, got {every_n_epochs}.")
        self.every_n_epochs = int(every_n_epochs)
        self.checkpoints: list[Checkpoint] = []
        self._last_epoch = -1
        self._final_epoch: int | None = None

    def _explained(self) -> keras.Model:
        return getattr(self.model, "model", None) or self.model

    def _keep(self, epoch: int) -> None:
        if epoch == self._last_epoch:
            return
        rate = float(np.asarray(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))
        self.checkpoints.append(Checkpoint(self._explained().get_weights(), rate))
        self._last_epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if (epoch + 1) % self.every_n_epochs == 0:
            self._keep(epoch)
        self._final_epoch = epoch

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._final_epoch is not None:
            self._keep(self._final_epoch)
