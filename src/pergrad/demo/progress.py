"""The progress bar and per-epoch summary table of ``pergrad analyze``."""

from __future__ import annotations

import sys

import keras
import numpy as np


def _median_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r and np.isfinite(r[key])]
    return float(np.median(values)) if values else float("nan")


class EpochTable(keras.callbacks.Callback):
    """A progress bar during each epoch, then one row: loss, accuracy, validation accuracy, and
    the medians over the epoch's steps of the per-step median example norm, median cosine to the
    batch gradient, fraction of opposed examples and gradient noise scale (plus epsilon)."""

    def __init__(self, monitor, num_examples: int, batch_size: int, private: bool) -> None:
        super().__init__()
        self.monitor = monitor
        self.steps = -(-num_examples // batch_size)
        self.private = private
        self._first = 0
        self._bar = None

    def on_train_begin(self, logs=None):
        head = (f"{'epoch':>5} {'loss':>7} {'acc':>6} {'val_acc':>7} {'med|g_i|':>9} "
                f"{'med cos':>8} {'opposed':>8} {'noise B':>8}")
        print(head + (f" {'epsilon':>8}" if self.private else ""), flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._first = len(self.monitor.history)
        self._bar = keras.utils.Progbar(self.steps, width=20, verbose=1, stateful_metrics=["loss"])

    def on_train_batch_end(self, batch, logs=None):
        self._bar.update(batch + 1, [("loss", float((logs or {}).get("loss", 0.0)))])

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        rows = self.monitor.history[self._first:]
        sys.stdout.write("\r\x1b[2K" if sys.stdout.isatty() else "\n")
        line = (f"{epoch + 1:>5} {logs.get('loss', float('nan')):>7.4f} "
                f"{logs.get('accuracy', float('nan')):>6.3f} "
                f"{logs.get('val_accuracy', float('nan')):>7.3f} "
                f"{_median_of(rows, 'norm_p50'):>9.4f} {_median_of(rows, 'cosine_p50'):>8.4f} "
                f"{_median_of(rows, 'fraction_opposed'):>8.3f} "
                f"{_median_of(rows, 'noise_scale'):>8.1f}")
        if self.private:
            line += f" {logs.get('epsilon', float('nan')):>8.3f}"
        print(line, flush=True)
