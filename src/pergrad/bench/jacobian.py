"""Benchmark: compiled Jacobians (pergrad.jacobian) against the backend's own way to compute
per-example Jacobians, new inputs every call.

Cases (per-example Jacobians, ``batched=True``):
  cnn   a small CNN's input Jacobian, batch 32, input 16x16x3 (768 per example), 10 outputs.
  tall  8 inputs -> Dense(64, tanh) -> Dense(512, tanh), batch 64: 512 outputs per example.

Methods (the first two are the baselines every ratio is taken against):
  TensorFlow
    eager tape          GradientTape + tape.batch_jacobian, eagerly, every call.
    tf.function tape    the same wrapped in one tf.function (plain-TF best practice).
  JAX (KERAS_BACKEND=jax)
    jax.vmap(jacrev)    jax.jit(jax.vmap(jax.jacrev(one example's outputs))): the JAX idiom.
    jacrev of sum       jax.jit(jax.jacrev(outputs summed over the batch)), every example's
                        row j at once (examples independent), moved to (B, *out, *in).
    jax.vmap(jacfwd)    forward mode, the JAX idiom for few inputs (a method, not a baseline).
  PyTorch (KERAS_BACKEND=torch)
    autograd loop       one torch.autograd.grad per output element of the batch-summed
                        outputs, after one forward pass (no vectorization).
    torch.func jacrev   torch.func.jacrev of the batch-summed outputs (examples independent:
                        row j of every example's Jacobian at once), the torch.func idiom.
  pergrad rev/fwd/auto  pergrad.jacobian(model, mode=..., batched=True).

Each call gets a new input tensor of the same shape. Warm-up calls (tracing) are excluded;
methods are timed in interleaved rounds (shuffled order) so that they share the machine's
state, and the table reports the median time per call and ratios to the two baselines (the
tapes on TensorFlow; JAX's two jitted ``jacrev``; the autograd loop and ``torch.func.jacrev``
on PyTorch) measured in the same run. The JAX baselines read the weights as arguments of their
``jit``, as ``pergrad.jacobian`` does.
Nothing here asserts on timings.

Usage:
  [KERAS_BACKEND=jax|torch] .venv/bin/python benchmarks/bench_jacobian.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import time
from collections.abc import Callable

import keras
import numpy as np

from pergrad.backend import native
from pergrad.backend.lazy import tensorflow as tf
from pergrad.jacobian import jacobian


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


def _tensorflow_baselines(model: keras.Model) -> dict[str, Callable]:
    tf.get_logger().setLevel("ERROR")  # the eager tape's per-call pfor retracing warnings

    def tape_batch_jacobian(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=False)
        return tape.batch_jacobian(y, x)

    return {"eager tape": tape_batch_jacobian,
            "tf.function tape": tf.function(tape_batch_jacobian, reduce_retracing=True)}


def _jax_baselines(model: keras.Model) -> dict[str, Callable]:
    import jax
    import jax.numpy as jnp

    weights = ([v.value for v in model.trainable_variables],
               [v.value for v in model.non_trainable_variables])

    def outputs(w, x):
        y, _ = model.stateless_call(w[0], w[1], x, training=False)
        return y

    @jax.jit
    def vmap_jacrev(w, x):
        return jax.vmap(jax.jacrev(lambda xi: outputs(w, xi[None])[0]))(x)

    @jax.jit
    def vmap_jacfwd(w, x):
        return jax.vmap(jax.jacfwd(lambda xi: outputs(w, xi[None])[0]))(x)

    @jax.jit
    def summed_jacrev(w, x):
        j = jax.jacrev(lambda z: jnp.sum(outputs(w, z), axis=0))(x)  # (*out, B, *in)
        return jnp.moveaxis(j, j.ndim - x.ndim, 0)

    return {"jax.vmap(jacrev)": lambda x: vmap_jacrev(weights, x),
            "jacrev of sum": lambda x: summed_jacrev(weights, x),
            "jax.vmap(jacfwd)": lambda x: vmap_jacfwd(weights, x)}


def _torch_baselines(model: keras.Model) -> dict[str, Callable]:
    import torch

    def batch_sum(x):  # (B, *in) -> (*out): example b's outputs depend on x[b] alone
        return torch.sum(model(x, training=False), dim=0)

    def per_example(j, x):  # (*out, B, *in) -> (B, *out, *in)
        return torch.movedim(j, j.ndim - x.ndim, 0)

    def autograd_loop(x):
        x = x.detach().requires_grad_(True)
        y = batch_sum(x)
        flat = y.reshape(-1)
        rows = [torch.autograd.grad(flat[k], x, retain_graph=True)[0] for k in range(y.numel())]
        return per_example(torch.stack(rows).reshape(*y.shape, *x.shape), x)

    def func_jacrev(x):
        return per_example(torch.func.jacrev(batch_sum)(x), x)

    return {"autograd loop": autograd_loop, "torch.func jacrev": func_jacrev}


def _methods(model: keras.Model) -> dict[str, tuple[Callable, object]]:
    # A benchmark's baselines are each framework's own idiom: the one backend test on purpose
    baselines = {"jax": _jax_baselines, "torch": _torch_baselines}.get(
        keras.backend.backend(), _tensorflow_baselines)(model)
    methods: dict[str, tuple[Callable, object]] = {
        name: (fn, None) for name, fn in baselines.items()}
    for mode in ("rev", "fwd", "auto"):
        jac = jacobian(model, mode=mode, batched=True)
        methods[f"pergrad {mode}"] = (jac, jac)
    return methods


def _numpy(tensor) -> np.ndarray:
    return keras.ops.convert_to_numpy(tensor)


def _time_case(name: str, build: Callable, quick: bool) -> list[dict]:
    keras.utils.set_random_seed(0)
    model, in_shape, batch = build()
    methods = _methods(model)
    first, second = list(methods)[:2]  # the baselines
    rounds = 5 if quick else 21
    window = 0.01 if quick else 0.05  # seconds: fast methods repeat calls to fill one timing
    rng_inputs = np.random.default_rng(0)
    pool = [keras.ops.convert_to_tensor(  # a new input every call
        rng_inputs.normal(size=(batch, *in_shape)).astype("float32")) for _ in range(64)]

    results: dict[str, np.ndarray] = {}
    inner: dict[str, int] = {}
    for method, (fn, _) in methods.items():  # warm-up: trace/compile, check agreement
        results[method] = _numpy(fn(pool[0]))
        start = time.perf_counter()
        _numpy(fn(pool[1]))
        once = time.perf_counter() - start
        # Fast methods: several calls per timing, so that each timing spans >= `window`.
        inner[method] = max(1, min(200, int(window / max(once, 1e-6))))
    reference = results[second]

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
            _numpy(keras.tree.flatten(out)[0])  # wait for the last result
            times[method].append((time.perf_counter() - start) / len(xs))

    base_1 = statistics.median(times[first])
    base_2 = statistics.median(times[second])
    rows = []
    for method, (_, jac) in methods.items():
        med = statistics.median(times[method])
        rows.append(
            {
                "case": name,
                "method": method,
                "mode": getattr(jac, "mode", None),
                "median_ms": med * 1e3,
                "baselines": [first, second],
                "speedup_vs_baseline_1": base_1 / med,
                "speedup_vs_baseline_2": base_2 / med,
                "max_abs_diff_vs_baseline_2": float(np.max(np.abs(results[method] - reference))),
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
    first, second = rows[0]["baselines"]
    lines = [
        f"| case | method | median ms/call | x vs {first} | x vs {second} | max abs diff |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        method = r["method"] + (f" (chose {r['mode']})" if r["method"] == "pergrad auto" else "")
        lines.append(
            f"| {r['case']} | {method} | {r['median_ms']:.2f} | "
            f"{r['speedup_vs_baseline_1']:.1f} | {r['speedup_vs_baseline_2']:.2f} | "
            f"{r['max_abs_diff_vs_baseline_2']:.1e} |"
        )
    return "\n".join(lines)


#: Each backend's framework: its name in the report and its module.
_FRAMEWORKS = {"tensorflow": ("TensorFlow", "tensorflow"), "jax": ("JAX", "jax"),
               "torch": ("PyTorch", "torch")}


def header() -> str:
    """The report's first line: the framework and Keras versions, the CPUs."""
    name, module = _FRAMEWORKS[native().NAME]
    version = importlib.import_module(module).__version__
    return (f"{name} {version}, Keras {keras.__version__}, {os.cpu_count()} CPU(s); "
            "median per call on new inputs, warm-up excluded")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed calls")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = run(quick=args.quick)
    print(header())
    print()
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
