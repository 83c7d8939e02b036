"""The folded route for strided convolutions against the patch route, in one process.

Two ``PerExample`` objects over the same model and batch: one traced as usual, one traced with
``pergrad.rules.conv.folded_products_win`` replaced by a function that always refuses (the
patch route). Their norms and clipped sums and the batch gradient are timed alternately, so
that both routes see the same machine state; medians are printed as ratios to the batch
gradient.

    python benchmarks/ab_folded.py                    # the benchmark CNN, batch 256
    python benchmarks/ab_folded.py --model cnn --batch 64 --rounds 40
"""

from __future__ import annotations

import argparse
import time

import keras
import numpy as np

import pergrad
from pergrad.backend.lazy import tensorflow as tf
from pergrad.bench.engine import LOSS, batch_gradient_fn
from pergrad.bench.models import MODELS, batch
from pergrad.rules import conv


def _traced(model, x, y, folded: bool):
    original = conv.folded_products_win
    if not folded:
        conv.folded_products_win = lambda *args, **kwargs: False
    try:
        pex = pergrad.PerExample(model, LOSS)
        pex.norms(x, y)
        pex.clipped_sum(x, y, 1.0)
    finally:
        conv.folded_products_win = original
    return pex


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    model = MODELS[args.model]()
    x, y = (tf.constant(t) for t in batch(args.model, args.batch))
    step = batch_gradient_fn(model)
    calls = {"batch gradient": lambda: step(x, y)}
    for label, folded in (("patches", False), ("folded", True)):
        pex = _traced(model, x, y, folded)
        calls[f"{label} norms"] = lambda p=pex: p.norms(x, y)
        calls[f"{label} clipped_sum"] = lambda p=pex: p.clipped_sum(x, y, 1.0)
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            tf.nest.map_structure(lambda t: np.asarray(t), call())
            times[name].append(time.perf_counter() - start)
    base = np.median(times["batch gradient"])
    print(f"{args.model}, batch {args.batch}, {args.rounds} rounds (medians)")
    for name, values in times.items():
        print(f"  {name:22s} {np.median(values) * 1e3:8.2f} ms  {np.median(values) / base:5.2f}x")


if __name__ == "__main__":
    main()
