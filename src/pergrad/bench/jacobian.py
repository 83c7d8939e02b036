"""Benchmark: compiled Jacobians (pergrad.jacobian) against GradientTape, new inputs every call.

Cases (per-example Jacobians, ``batched=True``):
  cnn   a small CNN's input Jacobian, batch 32, input 16x16x3 (768 per example), 10 outputs.
  tall  8 inputs -> Dense(64, tanh) -> Dense(512, tanh), batch 64: 512 outputs per example.

Methods:
  eager tape          GradientTape + tape.batch_jacobian, eagerly, every call.
  tf.function tape    the same wrapped in one tf.function (plain-TF best practice).
  pergrad rev/fwd/auto  pergrad.jacobian(model, mode=..., batched=True).

Each call gets a new input tensor of the same shape. Warm-up calls (tracing) are excluded;
methods are timed in interleaved rounds (shuffled order) so that they share the machine's
state, and the table reports the median time per call and ratios to the two tape baselines
measured in the same run.
Nothing here asserts on timings.

Usage:
  .venv/bin/python benchmarks/bench_jacobian.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable

import keras
import numpy as np

from pergrad.backend.lazy import tensorflow as tf
from pergrad.jacobian import jacobian

tf.get_logger().setLevel("ERROR")  # the eager tape's per-call pfor retracing warnings


def _cnn() -> tuple[keras.Model, tuple[int, ...], int]:
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    return model, (16, 16, 3), 32


def _tall() -> tuple[keras.Model, tuple[int, ...], int]:
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(512, activation="tanh"),
        ]
    )
    return model, (8,), 64


CASES: dict[str, Callable[[], tuple[keras.Model, tuple[int, ...], int]]] = {
    "cnn (B=32, 768 in -> 10 out)": _cnn,
    "tall (B=64, 8 in -> 512 out)": _tall,
}


def _methods(model: keras.Model) -> dict[str, tuple[Callable[[tf.Tensor], tf.Tensor], object]]:
    def tape_batch_jacobian(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=False)
        return tape.batch_jacobian(y, x)

    methods: dict[str, tuple[Callable[[tf.Tensor], tf.Tensor], object]] = {
        "eager tape": (tape_batch_jacobian, None),
        "tf.function tape": (tf.function(tape_batch_jacobian, reduce_retracing=True), None),
    }
    for mode in ("rev", "fwd", "auto"):
        jac = jacobian(model, mode=mode, batched=True)
        methods[f"pergrad {mode}"] = (jac, jac)
    return methods


def _time_case(name: str, build: Callable, quick: bool) -> list[dict]:
    tf.random.set_seed(0)
    model, in_shape, batch = build()
    methods = _methods(model)
    rounds = 5 if quick else 21
    window = 0.01 if quick else 0.05  # seconds: fast methods repeat calls to fill one timing
    pool = [tf.random.normal((batch, *in_shape)) for _ in range(64)]  # a new input every call

    results: dict[str, np.ndarray] = {}
    inner: dict[str, int] = {}
    for method, (fn, _) in methods.items():  # warm-up: trace/compile, check agreement
        results[method] = np.asarray(fn(pool[0]))
        start = time.perf_counter()
        np.asarray(fn(pool[1]))
        once = time.perf_counter() - start
        # Fast methods: several calls per timing, so that each timing spans >= `window`.
        inner[method] = max(1, min(200, int(window / max(once, 1e-6))))
    reference = results["tf.function tape"]

    times: dict[str, list[float]] = {m: [] for m in methods}
    call = 0
    order = list(methods)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)  # no method always runs right after the same (cache-cold) one
        for method in order:
            fn = methods[method][0]
            xs = [pool[2 + (call + i) % (len(pool) - 2)] for i in range(inner[method])]
            call += inner[method]
            start = time.perf_counter()
            for x in xs:
                out = fn(x)
            np.asarray(tf.nest.flatten(out)[0])  # wait for the last result
            times[method].append((time.perf_counter() - start) / len(xs))

    eager = statistics.median(times["eager tape"])
    compiled = statistics.median(times["tf.function tape"])
    rows = []
    for method, (_, jac) in methods.items():
        med = statistics.median(times[method])
        rows.append(
            {
                "case": name,
                "method": method,
                "mode": getattr(jac, "mode", None),
                "median_ms": med * 1e3,
                "speedup_vs_eager_tape": eager / med,
                "speedup_vs_tf_function_tape": compiled / med,
                "max_abs_diff_vs_tape": float(np.max(np.abs(results[method] - reference))),
                "calls_timed": len(times[method]) * inner[method],
            }
        )
    return rows


def run(quick: bool = False) -> list[dict]:
    """Times every case and method; returns one row (a dict) per (case, method)."""
    rows: list[dict] = []
    for name, build in CASES.items():
        rows.extend(_time_case(name, build, quick))
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (speedups: >1 means faster than that baseline)."""
    lines = [
        "| case | method | median ms/call | x vs eager tape | x vs tf.function tape | max abs diff |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        method = r["method"] + (f" (chose {r['mode']})" if r["method"] == "pergrad auto" else "")
        lines.append(
            f"| {r['case']} | {method} | {r['median_ms']:.2f} | "
            f"{r['speedup_vs_eager_tape']:.1f} | {r['speedup_vs_tf_function_tape']:.2f} | "
            f"{r['max_abs_diff_vs_tape']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed calls")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = run(quick=args.quick)
    print(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU(s); "
        "median per call on new inputs, warm-up excluded"
    )
    print()
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
