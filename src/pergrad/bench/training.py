"""Benchmark: one ``PerExampleModel`` training step (``mean``, ``clip_mean``, ``dp_mean``)
against a plain Keras training step of the same model; by default the CNN and the 2-block
transformer at batch 256.

Every variant is compiled with SGD and sparse categorical cross-entropy (from logits) and timed
with ``model.train_on_batch`` on the same tensors, after two warm-up calls (tracing). Variants
are timed in interleaved rounds, in shuffled order, so that they share the machine's state; the
table reports the median time per step, its ratio to the plain Keras step and, for ``dp_mean``,
its ratio to the ``clip_mean`` step, all measured in the same run. ``mean`` is the default
aggregator: the batch gradient through the layer rules (no norms). ``clip_mean`` and ``dp_mean``
run the same per-example clipping, so the second ratio is the DP step's own cost (drawing the
Gaussian noise, its key, the division by the batch size). Nothing here asserts on timings.

Any model of :mod:`pergrad.bench.models` can be chosen with ``--models``; each runs at the largest
of its default batch sizes (``DEFAULT_BATCH``: 256 for cnn and transformer, 128 for resnet,
mobilenet and gru, 256 for text_cnn and embedding_bag) unless ``--batch-size`` is given.

Usage:
  .venv/bin/python benchmarks/bench_training.py [--quick] [--models cnn,transformer]
                                                [--batch-size N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import keras

from pergrad import aggregate
from pergrad.backend.lazy import tensorflow as tf
from pergrad.bench.models import DEFAULT_BATCH, MODELS, batch
from pergrad.keras import PerExampleModel

DEFAULT_MODELS = ("cnn", "transformer")
VARIANTS = {
    "keras": None,
    "mean": lambda: aggregate.mean(),
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


def run(quick: bool = False, models: tuple[str, ...] = DEFAULT_MODELS,
        batch_size: int | None = None) -> list[dict]:
    """Median seconds per training step for every (model, variant); ``quick`` uses batch 32 and
    fewer rounds (a smoke test of the script). ``batch_size=None``: 32 when ``quick``, else the
    largest of the model's ``DEFAULT_BATCH``."""
    rounds = 3 if quick else 10
    rows = []
    for name in models:
        size = batch_size or (32 if quick else max(DEFAULT_BATCH[name]))
        x, y = batch(name, size)
        x, y = tf.constant(x), tf.constant(y)
        compiled = {variant: _compiled(name, variant) for variant in VARIANTS}
        for model in compiled.values():
            for _ in range(2):
                model.train_on_batch(x, y)
        times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for _ in range(rounds):
            order = list(VARIANTS)
            random.shuffle(order)
            for variant in order:
                start = time.perf_counter()
                compiled[variant].train_on_batch(x, y)
                times[variant].append(time.perf_counter() - start)
        medians = {variant: statistics.median(times[variant]) for variant in VARIANTS}
        for variant in VARIANTS:
            rows.append({"model": name, "batch": size, "variant": variant,
                         "median_s": medians[variant],
                         "ratio_to_keras": medians[variant] / medians["keras"],
                         "ratio_to_clip_mean": (medians[variant] / medians["clip_mean"]
                                                if variant == "dp_mean" else None)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | train step | median (ms) | x plain Keras | x clip_mean |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        to_clip = r.get("ratio_to_clip_mean")
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | "
                     f"{1000 * r['median_s']:.1f} | {r['ratio_to_keras']:.2f} | "
                     f"{'-' if to_clip is None else f'{to_clip:.2f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 32, 3 rounds")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma list from {','.join(MODELS)} "
                             f"(default: {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="one batch size for every model (default: per model, the largest of "
                             "its DEFAULT_BATCH: 256 for cnn, transformer, text_cnn, "
                             "embedding_bag; 128 for resnet, mobilenet, gru; --quick: 32)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    unknown = [m for m in models if m not in MODELS]
    if unknown or (args.batch_size is not None and args.batch_size < 1):
        parser.error(f"unknown models {unknown}" if unknown else "--batch-size must be positive")
    rows = run(quick=args.quick, models=models, batch_size=args.batch_size)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
