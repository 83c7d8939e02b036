"""Per-example gradients, norms and clipped sums against the batch gradient and the baselines.

For each model and batch size this prints the median time of one ordinary batch gradient and, as a
ratio to it (measured in the same run), pergrad's ``gradients``, ``norms`` and ``clipped_sum``
under each strategy: ``auto`` (layer rules), ``auto+xla`` (the same with ``jit_compile=True``),
``vmap`` (tf.vectorized_map of the whole model, XLA), ``jacobian`` (tape.jacobian) and ``loop``
(one tape per example in a tf.while_loop). A measurement that fails is reported
as such (``OOM``, or ``failed`` for a baseline TensorFlow cannot build, such as ``vmap`` of a
GRU), not skipped silently. Without ``--batch-sizes`` each model runs at its own default batch
sizes (``pergrad.bench.models.DEFAULT_BATCH``: 64 and 256 for mlp, cnn and transformer).

    python benchmarks/bench_engine.py                 # the table in docs/benchmarks.md
    python benchmarks/bench_engine.py --quick         # under a minute
    python benchmarks/bench_engine.py --models resnet,mobilenet,text_cnn,gru,embedding_bag --strategies auto,auto+xla,vmap,loop
                                                      # the realistic models (see the docs)
"""

from __future__ import annotations

import argparse
import json
import sys

import keras

import pergrad
from pergrad.backend.lazy import tensorflow as tf
from pergrad.bench.models import DEFAULT_BATCH, MODELS, batch
from pergrad.bench.timing import median_seconds

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
METHODS = ("gradients", "norms", "clipped_sum")
# Whole-model baselines materialize everything: norms and clipped sums cost what gradients cost,
# so only `gradients` is timed for them.
BASELINE_METHODS = {"auto": METHODS, "auto+xla": METHODS, "vmap": METHODS,
                    "jacobian": ("gradients",), "loop": ("gradients",)}
ALL_STRATEGIES = tuple(BASELINE_METHODS)


def batch_gradient_fn(model):
    @tf.function(reduce_retracing=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(LOSS.call(y, model(x, training=False)))
        return tape.gradient(loss, model.trainable_variables)
    return step


def run(quick: bool = False, models: tuple[str, ...] = ("mlp", "cnn", "transformer"),
        batch_sizes: tuple[int, ...] | None = None, strategies: tuple[str, ...] | None = None,
        budget_s: float | None = None) -> list[dict]:
    """Time everything; one dict per (model, batch, strategy, method) with seconds and ratio.
    ``batch_sizes=None``: each model's ``DEFAULT_BATCH``."""
    if strategies is None:
        strategies = ("auto", "vmap") if quick else ALL_STRATEGIES
    budget = budget_s if budget_s is not None else (1.0 if quick else 8.0)
    repeats = 3 if quick else 7
    rows = []
    for name in models:
        keras.utils.set_random_seed(0)
        model = MODELS[name]()
        for size in batch_sizes or DEFAULT_BATCH[name]:
            x, y = batch(name, size)
            x, y = tf.constant(x), tf.constant(y)
            step = batch_gradient_fn(model)
            base, n = median_seconds(lambda s=step, x=x, y=y: s(x, y), repeats=repeats,
                                     budget_s=budget)
            rows.append(dict(model=name, batch=size, strategy="batch gradient",
                             method="-", seconds=base, ratio=1.0, calls=n))
            for strategy in strategies:
                pex = pergrad.PerExample(model, LOSS, strategy=strategy.split("+")[0],
                                         jit_compile=strategy.endswith("+xla"))
                calls = {"gradients": lambda p=pex, x=x, y=y: p.gradients(x, y),
                         "norms": lambda p=pex, x=x, y=y: p.norms(x, y),
                         "clipped_sum": lambda p=pex, x=x, y=y: p.clipped_sum(x, y, 1.0)}
                for method in BASELINE_METHODS[strategy]:
                    row = dict(model=name, batch=size, strategy=strategy, method=method)
                    try:
                        seconds, n = median_seconds(calls[method], repeats=repeats,
                                                    budget_s=budget)
                    except (tf.errors.ResourceExhaustedError, MemoryError) as error:
                        row.update(seconds=None, ratio=None, calls=0, error="out of memory")
                        print(f"  {name:11s} B={size:<4d} {strategy:8s} {method:12s} "
                              f"failed: {type(error).__name__}", flush=True)
                    except (TypeError, ValueError, NotImplementedError,
                            tf.errors.OpError) as error:
                        # A baseline TensorFlow cannot build for this model (tf.vectorized_map
                        # of a GRU's while loop): reported in the table, the run goes on.
                        # pergrad's own strategy failing is a bug: it raises.
                        if strategy.startswith("auto"):
                            raise
                        last = (str(error).strip().splitlines() or [""])[-1].strip()
                        if not last.startswith(type(error).__name__):
                            last = f"{type(error).__name__}: {last}"
                        row.update(seconds=None, ratio=None, calls=0, error=last[:200])
                        print(f"  {name:11s} B={size:<4d} {strategy:8s} {method:12s} "
                              f"failed: {row['error']}", flush=True)
                    else:
                        row.update(seconds=seconds, ratio=seconds / base, calls=n)
                        print(f"  {name:11s} B={size:<4d} {strategy:8s} {method:12s} "
                              f"{seconds * 1e3:9.2f} ms  {seconds / base:7.2f}x", flush=True)
                    rows.append(row)
    return rows


def _cell(row: dict) -> str:
    if row["ratio"] is not None:
        return f"{row['ratio']:.2f}x"
    return "OOM" if row.get("error") == "out of memory" else "failed"


def markdown(rows: list[dict]) -> str:
    """One line per (model, batch): batch gradient in ms, then ratios to it."""
    columns = [(s, m) for s in ALL_STRATEGIES for m in BASELINE_METHODS[s]]
    present = [c for c in columns if any((r["strategy"], r["method"]) == c for r in rows)]
    head = ["model", "batch", "batch gradient"] + [f"{s} {m}" for s, m in present]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, size in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        cell = {(r["strategy"], r["method"]): r for r in rows
                if r["model"] == name and r["batch"] == size}
        base = cell[("batch gradient", "-")]["seconds"]
        values = [name, str(size), f"{base * 1e3:.1f} ms"]
        values += [_cell(cell[c]) if c in cell else "-" for c in present]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="auto and vmap only, short budget")
    parser.add_argument("--models", default="mlp,cnn,transformer",
                        help=f"comma list from {','.join(MODELS)} (default: mlp,cnn,transformer)")
    parser.add_argument("--batch-sizes", default=None,
                        help="comma list (default: per model, 64,256 for mlp, cnn, transformer; "
                             + ", ".join(f"{m} {','.join(map(str, b))}"
                                         for m, b in DEFAULT_BATCH.items()
                                         if m not in ("mlp", "cnn", "transformer")) + ")")
    parser.add_argument("--strategies", default=None,
                        help=f"comma list from {','.join(ALL_STRATEGIES)} (default: all; "
                             "--quick: auto,vmap)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    rows = run(args.quick, tuple(args.models.split(",")),
               tuple(int(b) for b in args.batch_sizes.split(",")) if args.batch_sizes else None,
               tuple(args.strategies.split(",")) if args.strategies else None)
    print()
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
