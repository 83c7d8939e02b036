"""The cost of GradientMonitor: a PerExampleModel training step with the monitor at every step
against the same step without it, measured in the same run.

Models (benchmarks/models.py): the CNN (28x28x1, TF Privacy tutorial) and a 2-block transformer
(d=128, 4 heads, sequence 64), batch 256, float32, ``aggregate.mean()``.

Variants: no monitor; ``GradientMonitor()`` (statistics at every step); ``GradientMonitor(
every_n_steps=10)``. All run Keras's own compiled train function (``model.train_function`` on an
iterator over one fixed batch, built by a one-step ``fit``); the monitored ones also run the
monitor's per-batch callback work (reading the last step's statistics, quantiles; no CSV or
TensorBoard), as ``fit`` would. Each timing is a block of 10 consecutive steps (so that
``every_n_steps=10`` is charged its one monitored step in ten); warm-up excluded, variants
interleaved, the median block over repeats is reported per step.
Nothing here asserts on timings.

    python benchmarks/bench_monitor.py            # the table in docs/analysis.md
    python benchmarks/bench_monitor.py --quick    # batch 32, fewer repeats (a smoke test)
"""

from __future__ import annotations

import statistics
import time
import warnings

import keras

from pergrad.backend.lazy import tensorflow as tf
from pergrad.bench.models import MODELS, batch
from pergrad.bench.timing import script_main
from pergrad.keras import PerExampleModel
from pergrad.keras.monitor import GradientMonitor

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BATCH = 256


def _step_fn(name: str, monitor: GradientMonitor | None, size: int = BATCH):
    """One compiled training step of ``name`` (same initial weights for both variants)."""
    keras.utils.set_random_seed(0)
    model = PerExampleModel(MODELS[name](), monitor=monitor)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=LOSS)
    x, y = batch(name, size)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # derived-index warning: one fixed batch
        model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)
    iterator = iter(data)

    def step():
        logs = model.train_function(iterator)
        if monitor is not None:
            monitor.on_train_batch_end(0, logs)
        for value in tf.nest.flatten(logs):
            value.numpy()

    return step


BLOCK = 10


def run(quick: bool = False, models: tuple[str, ...] = ("cnn", "transformer")) -> list[dict]:
    """One dict per model: median seconds per step without the monitor, with it at every step
    and every 10th step, and the ratios to the step without it."""
    repeats, size = (2, 32) if quick else (7, BATCH)
    rows = []
    for name in models:
        variants = {
            "plain": _step_fn(name, None, size),
            "every_step": _step_fn(name, GradientMonitor(num_examples=size), size),
            "every_10": _step_fn(name, GradientMonitor(every_n_steps=BLOCK, num_examples=size),
                                 size),
        }
        for fn in variants.values():
            fn()  # warm-up
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(repeats):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for key in order:
                start = time.perf_counter()
                for _ in range(BLOCK):
                    variants[key]()
                times[key].append((time.perf_counter() - start) / BLOCK)
        plain, every, every_10 = (statistics.median(times[k]) for k in variants)
        rows.append({"model": name, "batch": size, "plain_s": plain, "monitor_s": every,
                     "ratio": every / plain, "monitor_every_10_s": every_10,
                     "ratio_every_10": every_10 / plain, "repeats": repeats})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | step, no monitor (s) | monitor every step (s) | ratio "
             "| monitor every 10 steps (s) | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['batch']} | {r['plain_s']:.4f} | {r['monitor_s']:.4f} "
              f"| {r['ratio']:.2f}x | {r['monitor_every_10_s']:.4f} | {r['ratio_every_10']:.2f}x |"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__.splitlines()[0], run, markdown, argv, quick_help="batch 32, fewer repeats")


if __name__ == "__main__":
    raise SystemExit(main())
