"""pergrad against PyTorch ``torch.func``, Opacus and JAX: per-example gradients and their norms.

The same two models are built in every framework with the same initial weights (drawn once with
NumPy in Keras layout and converted), and fed the same random float32 batch with integer labels;
the loss is softmax cross-entropy from logits:

* ``mlp``: 784-512-512-10, ReLU (669,706 parameters);
* ``cnn``: 28x28x1 -> Conv2D(16, 8, stride 2, same, ReLU) -> MaxPool(2, stride 1) ->
  Conv2D(32, 4, stride 2, valid, ReLU) -> MaxPool(2, stride 1) -> Flatten -> Dense(32, ReLU) ->
  Dense(10) (26,010 parameters). TensorFlow's "same" padding here is symmetric, (3, 3) on each
  side of 28 (pad total = (14 - 1) * 2 + 8 - 28 = 6), so PyTorch uses ``padding=3`` and JAX
  ``"SAME"``; PyTorch is NCHW, so its first Dense kernel is the Keras one with its rows permuted
  from (h, w, c) to (c, h, w) order. The cross-framework check below confirms the models agree.

For each model and batch size, each framework's worker times (median of ``--repeats`` >= 5 calls
after untimed warm-up calls, which include tracing / jit / XLA compilation):

* its own plain batch gradient of the mean loss (pergrad: ``pergrad.bench.engine``'s
  ``batch_gradient_fn``, a ``tf.function``; PyTorch and Opacus: ``torch.autograd.grad`` on the
  unwrapped module; JAX: ``jax.jit(jax.grad(f))``);
* per-example gradient norms ``||grad l_i||`` and per-example gradients ``grad l_i``:
  pergrad ``PerExample(model, loss).norms / .gradients`` (default strategy, and again with
  ``jit_compile=True``); ``torch.func``: ``vmap(grad(f))`` over ``functional_call`` (norms are
  taken from its result); Opacus: ``GradSampleModule`` (``grad_sample``; norms taken from it as
  its optimizer does) and, for norms, ``GradSampleModuleFastGradientClipping`` with ghost
  clipping (``get_norm_sample()`` after one backward); JAX: ``jax.jit(jax.vmap(jax.grad(f)))``
  and the same with the norms computed inside the jitted function.

Every per-example result is reported as a ratio to that framework's own batch gradient, measured
in the same process, and in milliseconds. Before timing, each worker checks its per-example norms
(and the norms of its per-example gradients) against its own loop of single-example gradients for
the first 4 examples (relative error < 1e-3), and the driver checks that those norms agree across
frameworks (same weights, same data), so all columns compute the same numbers.

Threads: PyTorch ``torch.set_num_threads(2)`` (and 1 inter-op thread); TensorFlow and XLA (JAX)
use their defaults, which on this 2-core machine are 2 threads. The workers run one after the
other, never in parallel.

Each framework runs in its own subprocess: pergrad with the project's interpreter, PyTorch /
Opacus / JAX with a separate virtual environment, e.g. ::

    python3 -m venv /tmp/fwvenv && /tmp/fwvenv/bin/pip install torch==2.13.0 opacus jax jaxlib numpy
    .venv/bin/python benchmarks/compare_frameworks.py                      # the Markdown table
    .venv/bin/python benchmarks/compare_frameworks.py --batch-sizes 4 --repeats 1   # smoke test
    .venv/bin/python benchmarks/compare_frameworks.py --framework jax      # one worker, JSON rows

This script is a stand-alone benchmark: no test imports it and CI does not need it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

FRAMEWORKS = ("pergrad", "torch", "opacus", "jax")
MODEL_NAMES = ("mlp", "cnn")
CHECK = 4  # examples checked against a per-example loop
TOLERANCE = 1e-3
MARKER = "COMPARE_FRAMEWORKS_JSON "
Row = dict[str, Any]

# (framework, method) columns of the table, in order, with their headers.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("pergrad", "batch", "pergrad batch grad"),
    ("pergrad", "norms", "pergrad norms"),
    ("pergrad", "gradients", "pergrad grads"),
    ("pergrad", "norms+xla", "pergrad norms (XLA)"),
    ("pergrad", "gradients+xla", "pergrad grads (XLA)"),
    ("torch", "batch", "torch batch grad"),
    ("torch", "norms", "torch.func norms"),
    ("torch", "gradients", "torch.func grads"),
    ("opacus", "batch", "opacus batch grad"),
    ("opacus", "norms", "opacus GSM norms"),
    ("opacus", "gradients", "opacus GSM grads"),
    ("opacus", "norms+ghost", "opacus ghost norms"),
    ("jax", "batch", "jax batch grad"),
    ("jax", "norms", "jax norms"),
    ("jax", "gradients", "jax grads"),
)


# -- shared, NumPy only ---------------------------------------------------------------------------


def _row(framework: str, model: str, batch: int, method: str, seconds: float, calls: int) -> dict:
    """One timing row, as every worker reports it."""
    return dict(
        framework=framework, model=model, batch=batch, method=method, seconds=seconds, calls=calls
    )


def init_params(name: str, seed: int = 0) -> list[np.ndarray]:
    """He-normal kernels and small random biases in Keras layout (Dense ``(in, out)``, Conv2D
    ``(kh, kw, in, out)``), in ``model.trainable_variables`` order."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        kernels = [(784, 512), (512, 512), (512, 10)]
    elif name == "cnn":
        kernels = [(8, 8, 1, 16), (4, 4, 16, 32), (4 * 4 * 32, 32), (32, 10)]
    else:
        raise ValueError(f"unknown model {name!r}")
    params = []
    for shape in kernels:
        fan_in = int(np.prod(shape[:-1]))
        params.append((rng.normal(size=shape) * np.sqrt(2.0 / fan_in)).astype("float32"))
        params.append((0.01 * rng.normal(size=shape[-1])).astype("float32"))
    return params


def make_batch(name: str, size: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Random float32 inputs (NHWC for the CNN) and int64 labels; the first rows do not depend on
    ``size``, so the checked examples are the same at every batch size."""
    rng = np.random.default_rng(seed)
    shape = (size, 784) if name == "mlp" else (size, 28, 28, 1)
    x = rng.normal(size=shape).astype("float32")
    y = np.random.default_rng(seed + 1).integers(0, 10, size).astype("int64")
    return x, y


def median_time(
    fn: Callable[[], Any], block: Callable[[Any], Any], repeats: int, warmup: int
) -> tuple[float, int]:
    """Median seconds of ``block(fn())`` over ``repeats`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def check(framework: str, model: str, what: str, fast: np.ndarray, loop: np.ndarray) -> None:
    """Assert ``fast`` (per-example norms) matches the per-example loop's norms."""
    error = float(np.max(np.abs(fast - loop) / np.maximum(np.abs(loop), 1e-12)))
    if not error < TOLERANCE:
        raise AssertionError(
            f"{framework} {model} {what}: relative error {error:.2e} against the "
            f"per-example loop (norms {fast} vs {loop})"
        )


def grads_norms(grads: Sequence[np.ndarray]) -> np.ndarray:
    """Per-example L2 norms of a list of ``(B, ...)`` per-example gradient arrays."""
    return np.sqrt(
        sum(np.sum(np.reshape(g, (g.shape[0], -1)).astype("float64") ** 2, axis=1) for g in grads)
    )


# -- workers --------------------------------------------------------------------------------------
def worker_pergrad(
    models: Sequence[str], sizes: Sequence[int], repeats: int, warmup: int
) -> tuple[list[Row], dict[str, Any]]:
    import keras
    import tensorflow as tf

    import pergrad
    from pergrad.bench import models as bench_models
    from pergrad.bench.engine import batch_gradient_fn
    from pergrad.bench.timing import median_seconds

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows: list[Row] = []
    info: dict[str, Any] = {
        "versions": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "pergrad": getattr(pergrad, "__version__", "?"),
        },
        "check_norms": {},
    }
    for name in models:
        model = {"mlp": bench_models.mlp, "cnn": bench_models.cnn}[name]()
        model.set_weights(init_params(name))
        for size in sizes:
            # Fresh functions per batch size, as bench_engine.py does: a second batch size would
            # retrace them with the batch dimension relaxed to None (reduce_retracing=True), and
            # pergrad's Dense rule then loses the static number of positions and materializes
            # (MLP norms at batch 256: ~2 ms fresh, ~55 ms after a batch-64 call).
            step = batch_gradient_fn(model)
            fast = pergrad.PerExample(model, loss)
            xla = pergrad.PerExample(model, loss, jit_compile=True)
            xs, ys = make_batch(name, size)
            x, y = tf.constant(xs), tf.constant(ys)
            if size >= CHECK:
                loop = grads_norms(
                    [
                        np.stack(z)
                        for z in zip(
                            *[
                                [g.numpy() for g in step(x[i : i + 1], y[i : i + 1])]
                                for i in range(CHECK)
                            ],
                            strict=True,
                        )
                    ]
                )
                for label, pex in (("", fast), ("+xla", xla)):
                    check("pergrad", name, "norms" + label, pex.norms(x, y).numpy()[:CHECK], loop)
                    check(
                        "pergrad",
                        name,
                        "gradients" + label,
                        grads_norms([g.numpy()[:CHECK] for g in pex.gradients(x, y)]),
                        loop,
                    )
                info["check_norms"][name] = loop.tolist()
            calls = {
                "batch": lambda x=x, y=y, f=step: f(x, y),
                "norms": lambda x=x, y=y, p=fast: p.norms(x, y),
                "gradients": lambda x=x, y=y, p=fast: p.gradients(x, y),
                "norms+xla": lambda x=x, y=y, p=xla: p.norms(x, y),
                "gradients+xla": lambda x=x, y=y, p=xla: p.gradients(x, y),
            }
            for method, fn in calls.items():
                seconds, n = median_seconds(
                    fn, repeats=repeats, budget_s=float("inf"), warmup=warmup
                )
                rows.append(_row("pergrad", name, size, method, seconds, n))
    return rows, info


def _torch_model(name: str):
    import torch
    from torch import nn

    params = init_params(name)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        converted = [p.T if p.ndim == 2 else p for p in params]
    else:
        model = nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=3),
            nn.ReLU(),
            nn.MaxPool2d(2, stride=1),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.ReLU(),
            nn.MaxPool2d(2, stride=1),
            nn.Flatten(),
            nn.Linear(4 * 4 * 32, 32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )
        k1, b1, k2, b2, d1, c1, d2, c2 = params
        d1 = d1.reshape(4, 4, 32, 32).transpose(2, 0, 1, 3).reshape(512, 32)  # (h,w,c)->(c,h,w)
        converted = [k1.transpose(3, 2, 0, 1), b1, k2.transpose(3, 2, 0, 1), b2, d1.T, c1, d2.T, c2]
    with torch.no_grad():
        for p, value in zip(model.parameters(), converted, strict=True):
            assert tuple(p.shape) == value.shape, (p.shape, value.shape)
            p.copy_(torch.from_numpy(np.ascontiguousarray(value)))
    return model


def _torch_batch(name: str, size: int):
    import torch

    xs, ys = make_batch(name, size)
    if name == "cnn":
        xs = xs.transpose(0, 3, 1, 2)  # NHWC -> NCHW
    # Copy into a fresh tensor with standard NCHW strides: with one channel, NumPy's transpose is
    # "C-contiguous" yet has strides that PyTorch reads as channels_last, which makes the convs
    # run channels_last and Opacus 1.6's Conv2d grad sampler (as_strided in unfold2d) silently
    # wrong.
    x = torch.empty(xs.shape, dtype=torch.float32)
    x.copy_(torch.from_numpy(np.ascontiguousarray(xs)))
    return x, torch.from_numpy(ys)


def worker_torch(
    models: Sequence[str], sizes: Sequence[int], repeats: int, warmup: int, opacus: bool
) -> tuple[list[Row], dict[str, Any]]:
    import copy

    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    torch.set_num_threads(2)
    torch.set_num_interop_threads(1)
    framework = "opacus" if opacus else "torch"
    info: dict[str, Any] = {
        "versions": {"torch": torch.__version__},
        "threads": torch.get_num_threads(),
        "check_norms": {},
    }
    if opacus:
        import opacus as opacus_lib
        from opacus.grad_sample import GradSampleModule

        info["versions"]["opacus"] = opacus_lib.__version__
        try:
            from opacus.grad_sample import GradSampleModuleFastGradientClipping
        except ImportError:
            GradSampleModuleFastGradientClipping = None
    rows: list[Row] = []

    def block(result: Any) -> None:  # CPU tensors are ready when returned
        return None

    for name in models:
        model = _torch_model(name)
        params = [p for p in model.parameters()]

        def batch_grad(x, y, model=model, params=params):
            return torch.autograd.grad(F.cross_entropy(model(x), y), params)

        def loop_norms(x, y, batch_grad=batch_grad) -> np.ndarray:
            grads = [
                [g.numpy() for g in batch_grad(x[i : i + 1], y[i : i + 1])] for i in range(CHECK)
            ]
            return grads_norms([np.stack(z) for z in zip(*grads, strict=True)])

        calls: dict[str, Callable[[Any, Any], Any]] = {"batch": batch_grad}
        if not opacus:
            named = {k: v.detach() for k, v in model.named_parameters()}

            def example_loss(p, x, y, model=model):
                return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

            per_example = vmap(grad(example_loss), in_dims=(None, 0, 0))

            def func_grads(x, y, per_example=per_example, named=named):
                return per_example(named, x, y)

            def func_norms(x, y, func_grads=func_grads):
                g = func_grads(x, y)
                return torch.stack([v.flatten(1).norm(dim=1) for v in g.values()]).norm(dim=0)

            calls.update(
                norms=func_norms, gradients=lambda x, y, f=func_grads: list(f(x, y).values())
            )
        else:
            gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
            gsm.train()

            def gsm_grads(x, y, gsm=gsm):
                for p in gsm.parameters():
                    p.grad_sample = None
                    p.grad = None
                F.cross_entropy(gsm(x), y, reduction="sum").backward()
                return [p.grad_sample for p in gsm.parameters()]

            def gsm_norms(x, y, gsm_grads=gsm_grads):
                g = gsm_grads(x, y)
                return torch.stack([v.flatten(1).norm(dim=1) for v in g]).norm(dim=0)

            calls.update(norms=gsm_norms, gradients=gsm_grads)
            if GradSampleModuleFastGradientClipping is not None:
                ghost = GradSampleModuleFastGradientClipping(
                    copy.deepcopy(model), loss_reduction="sum", use_ghost_clipping=True
                )
                ghost.train()

                def ghost_norms(x, y, ghost=ghost):
                    for p in ghost.parameters():
                        p.grad = None
                    F.cross_entropy(ghost(x), y, reduction="sum").backward()
                    return ghost.get_norm_sample()

                calls["norms+ghost"] = ghost_norms
        for size in sizes:
            x, y = _torch_batch(name, size)
            if size >= CHECK:
                loop = loop_norms(x, y)
                for method, fn in calls.items():
                    if method.startswith("norms"):
                        fast = fn(x, y).detach().numpy()[:CHECK]
                    elif method == "gradients":
                        fast = grads_norms([g.detach().numpy()[:CHECK] for g in fn(x, y)])
                    else:
                        continue
                    check(framework, name, method, fast, loop)
                info["check_norms"][name] = loop.tolist()
            for method, fn in calls.items():
                seconds, n = median_time(lambda fn=fn, x=x, y=y: fn(x, y), block, repeats, warmup)
                rows.append(_row(framework, name, size, method, seconds, n))
    return rows, info


def worker_jax(
    models: Sequence[str], sizes: Sequence[int], repeats: int, warmup: int
) -> tuple[list[Row], dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import jaxlib

    info: dict[str, Any] = {
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__},
        "devices": [str(d) for d in jax.devices()],
        "check_norms": {},
    }
    rows: list[Row] = []

    def forward(name: str, p: list, x: jax.Array) -> jax.Array:
        if name == "mlp":
            h = jax.nn.relu(x @ p[0] + p[1])
            h = jax.nn.relu(h @ p[2] + p[3])
            return h @ p[4] + p[5]
        dims = ("NHWC", "HWIO", "NHWC")

        def pool(h: jax.Array) -> jax.Array:
            return jax.lax.reduce_window(
                h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "VALID"
            )

        h = jax.lax.conv_general_dilated(x, p[0], (2, 2), "SAME", dimension_numbers=dims)
        h = pool(jax.nn.relu(h + p[1]))
        h = jax.lax.conv_general_dilated(h, p[2], (2, 2), "VALID", dimension_numbers=dims)
        h = pool(jax.nn.relu(h + p[3]))
        h = h.reshape(h.shape[0], -1)
        h = jax.nn.relu(h @ p[4] + p[5])
        return h @ p[6] + p[7]

    def losses(name: str, p: list, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = forward(name, p, x)
        return (
            jax.nn.logsumexp(logits, axis=-1)
            - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        )

    def block(result: Any) -> None:
        jax.block_until_ready(result)

    for name in models:
        params = [jnp.asarray(p) for p in init_params(name)]
        batch_grad = jax.jit(jax.grad(lambda p, x, y, n=name: jnp.mean(losses(n, p, x, y))))
        one = jax.grad(lambda p, x, y, n=name: losses(n, p, x[None], y[None])[0])
        per_example = jax.jit(jax.vmap(one, in_axes=(None, 0, 0)))

        def norms_fn(p, x, y, one=one):
            g = jax.vmap(one, in_axes=(None, 0, 0))(p, x, y)
            return jnp.sqrt(sum(jnp.sum(v.reshape(v.shape[0], -1) ** 2, axis=1) for v in g))

        norms = jax.jit(norms_fn)
        calls = {"batch": batch_grad, "norms": norms, "gradients": per_example}
        for size in sizes:
            xs, ys = make_batch(name, size)
            x, y = jnp.asarray(xs), jnp.asarray(ys.astype("int32"))
            if size >= CHECK:
                loop = grads_norms(
                    [
                        np.stack(z)
                        for z in zip(
                            *[
                                [
                                    np.asarray(g)
                                    for g in batch_grad(params, x[i : i + 1], y[i : i + 1])
                                ]
                                for i in range(CHECK)
                            ],
                            strict=True,
                        )
                    ]
                )
                check("jax", name, "norms", np.asarray(norms(params, x, y))[:CHECK], loop)
                check(
                    "jax",
                    name,
                    "gradients",
                    grads_norms([np.asarray(g)[:CHECK] for g in per_example(params, x, y)]),
                    loop,
                )
                info["check_norms"][name] = loop.tolist()
            for method, fn in calls.items():
                seconds, n = median_time(
                    lambda fn=fn, x=x, y=y, p=params: fn(p, x, y), block, repeats, warmup
                )
                rows.append(_row("jax", name, size, method, seconds, n))
    return rows, info


def run_worker(
    framework: str, models: Sequence[str], sizes: Sequence[int], repeats: int, warmup: int
) -> tuple[list[Row], dict[str, Any]]:
    if framework == "pergrad":
        return worker_pergrad(models, sizes, repeats, warmup)
    if framework in ("torch", "opacus"):
        return worker_torch(models, sizes, repeats, warmup, opacus=framework == "opacus")
    if framework == "jax":
        return worker_jax(models, sizes, repeats, warmup)
    raise ValueError(f"unknown framework {framework!r}")


# -- driver ---------------------------------------------------------------------------------------
def spawn(framework: str, python: str, args: argparse.Namespace) -> tuple[list[Row], dict]:
    """Run one worker in a subprocess and parse its JSON line."""
    command = [
        python,
        os.path.abspath(__file__),
        "--framework",
        framework,
        "--models",
        args.models,
        "--batch-sizes",
        args.batch_sizes,
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
    print(f"running {framework} worker ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"{framework} worker failed ({done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    payload = json.loads(lines[-1][len(MARKER) :])
    return payload["rows"], payload["info"]


def cross_check(infos: dict[str, dict]) -> list[str]:
    """The loop norms of the first examples must agree across frameworks (same model)."""
    notes = []
    reference = infos.get("pergrad", {}).get("check_norms", {})
    for framework, info in infos.items():
        for name, norms in info.get("check_norms", {}).items():
            if name in reference:
                ref = np.asarray(reference[name])
                error = float(np.max(np.abs(np.asarray(norms) - ref) / ref))
                if not error < TOLERANCE:
                    raise AssertionError(
                        f"{framework} {name}: norms {norms} differ from "
                        f"pergrad's {ref.tolist()} ({error:.2e})"
                    )
                notes.append(f"{framework}/{name}: {error:.1e}")
    return notes


def markdown(rows: list[Row]) -> str:
    """One line per (model, batch); per framework its batch gradient in ms, then per-example
    results as ratio to that batch gradient and in ms."""
    present = [c for c in COLUMNS if any((r["framework"], r["method"]) == c[:2] for r in rows)]
    head = ["model", "batch"] + [c[2] for c in present]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, size in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        cell = {
            (r["framework"], r["method"]): r["seconds"]
            for r in rows
            if r["model"] == name and r["batch"] == size
        }
        values = [name, str(size)]
        for framework, method, _ in present:
            seconds = cell.get((framework, method))
            base = cell.get((framework, "batch"))
            if seconds is None:
                values.append("-")
            elif method == "batch":
                values.append(f"{seconds * 1e3:.2f} ms")
            else:
                values.append(f"{seconds / base:.2f}x ({seconds * 1e3:.1f} ms)")
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default=None,
        help="worker mode: run one framework and print its JSON rows",
    )
    parser.add_argument(
        "--frameworks", default=",".join(FRAMEWORKS), help="driver: the workers to run, in order"
    )
    parser.add_argument("--pergrad-python", default=sys.executable)
    parser.add_argument("--other-python", default="/tmp/fwvenv/bin/python")
    parser.add_argument("--models", default=",".join(MODEL_NAMES))
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls (compilation)")
    parser.add_argument("--json", default=None, help="driver: also write rows and info here")
    args = parser.parse_args(argv)
    models = tuple(args.models.split(","))
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))

    if args.framework is not None:
        rows, info = run_worker(args.framework, models, sizes, args.repeats, args.warmup)
        print(MARKER + json.dumps({"rows": rows, "info": info}), flush=True)
        return 0

    all_rows: list[Row] = []
    infos: dict[str, dict] = {}
    for framework in args.frameworks.split(","):
        python = args.pergrad_python if framework == "pergrad" else args.other_python
        rows, infos[framework] = spawn(framework, python, args)
        all_rows += rows
    agreement = cross_check(infos)
    versions = {k: v for info in infos.values() for k, v in info.get("versions", {}).items()}
    print(markdown(all_rows))
    print()
    print("Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(
        f"Timing: median of {args.repeats} calls after {args.warmup} untimed warm-up calls; "
        "torch threads: "
        + str(infos.get("torch", infos.get("opacus", {})).get("threads", "-"))
        + "; TensorFlow/XLA default threads."
    )
    if agreement:
        print(
            "Per-example norms of the first 4 examples vs pergrad's (max relative error): "
            + ", ".join(agreement)
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": all_rows, "info": infos}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
