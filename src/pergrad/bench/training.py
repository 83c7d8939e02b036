"""Benchmark: one ``PerExampleModel`` training step (``clip_mean``, ``dp_mean``) against a plain
Keras training step of the same model, on the CNN and the 2-block transformer at batch 256.

Every variant is compiled with SGD and sparse categorical cross-entropy (from logits) and timed
with ``model.train_on_batch`` on the same tensors, after two warm-up calls (tracing). Variants
are timed in interleaved rounds, in shuffled order, so that they share the machine's state; the
table reports the median time per step and its ratio to the plain Keras step measured in the same
run. Nothing here asserts on timings.

Usage:
  .venv/bin/python benchmarks/bench_training.py [--quick] [--json PATH]
"""

from __future__ import annotations

import random
import statistics
import time

import keras
import tensorflow as tf

from pergrad import aggregate
from pergrad.bench.models import batch, cnn, transformer
from pergrad.bench.timing import script_main
from pergrad.keras import PerExampleModel

MODELS = {"cnn": cnn, "transformer": transformer}
VARIANTS = {
    "keras": None,
    "clip_mean": lambda: aggregate.clip_mean(1.0),
    "dp_mean": lambda: aggregate.dp_mean(1.0, 1.1, seed=0),
}


def _compiled(name: str, variant: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    inner = MODELS[name]()
    model = inner if VARIANTS[variant] is None else PerExampleModel(inner, VARIANTS[variant]())
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run(quick: bool = False) -> list[dict]:
    """Median seconds per training step for every (model, variant); ``quick`` uses batch 32 and
    fewer rounds (a smoke test of the script)."""
    size, rounds = (32, 3) if quick else (256, 10)
    rows = []
    for name in MODELS:
        x, y = batch(name, size)
        x, y = tf.constant(x), tf.constant(y)
        models = {variant: _compiled(name, variant) for variant in VARIANTS}
        for model in models.values():
            for _ in range(2):
                model.train_on_batch(x, y)
        times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for _ in range(rounds):
            order = list(VARIANTS)
            random.shuffle(order)
            for variant in order:
                start = time.perf_counter()
                models[variant].train_on_batch(x, y)
                times[variant].append(time.perf_counter() - start)
        base = statistics.median(times["keras"])
        for variant in VARIANTS:
            median = statistics.median(times[variant])
            rows.append({"model": name, "batch": size, "variant": variant,
                         "median_s": median, "ratio_to_keras": median / base})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | train step | median (ms) | x plain Keras |",
             "|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | "
                     f"{1000 * r['median_s']:.1f} | {r['ratio_to_keras']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__.splitlines()[0], run, markdown, argv, quick_help="batch 32, 3 rounds")


if __name__ == "__main__":
    raise SystemExit(main())
