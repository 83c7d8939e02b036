"""pergrad on the JAX backend against JAX's own batch gradient and ``jit(vmap(grad))``.

Run with ``KERAS_BACKEND=jax``. For each model and batch size this prints the median time of one
ordinary batch gradient (``jax.jit(jax.grad)`` of the summed loss through
``model.stateless_call``) and, as ratios to it measured in the same run:

* pergrad's ``norms``, ``clipped_sum`` and ``gradients`` (``strategy="auto"``: layer rules, one
  backward pass to the taps);
* the whole-model baseline ``jax.jit(jax.vmap(jax.grad(one example's loss)))`` and, built on it,
  its norms and clipped sum: how JAX Privacy's Keras API computes per-example gradients (it
  clips what ``vmap`` materializes).

and one training step (``train_on_batch``, SGD) as a ratio to a plain Keras step of the same
model: ``PerExampleModel(dp_mean)``, and, when ``jax-privacy`` is installed, JAX Privacy 2.0's
``keras_api.make_private`` with its two gradient methods (``microbatch_size=None``: one
``vmap`` over the batch; ``microbatch_size=32``: ``vmap`` over 32 examples at a time, in
sequence). DP noise keys are 64-bit, so the script turns on ``jax_enable_x64`` first.

    KERAS_BACKEND=jax python benchmarks/bench_jax.py            # docs/benchmarks.md, JAX
    KERAS_BACKEND=jax python benchmarks/bench_jax.py --quick    # two models, batch 64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import keras

import pergrad
from pergrad.bench.models import DEFAULT_BATCH, MODELS, batch, twin

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP = 1.0
DEFAULT_MODELS = ("mlp", "cnn", "transformer", "resnet", "mobilenet", "text_cnn",
                  "embedding_bag", "gru")


def median_seconds(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Median of up to ``repeats`` timed calls after one untimed call (compilation)."""
    jax.block_until_ready(fn())
    times: list[float] = []
    while len(times) < repeats and (sum(times) < budget_s or not times):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _baselines(model):
    """``(batch gradient, vmap gradients, vmap norms, vmap clipped sum)`` as jitted functions of
    ``(trainable values, non-trainable values, x, y)``."""

    def example_loss(values, frozen, xi, yi):
        predictions, _ = model.stateless_call(values, frozen, xi[None])
        return jnp.sum(LOSS.call(yi[None], predictions))

    def total_loss(values, frozen, x, y):
        predictions, _ = model.stateless_call(values, frozen, x)
        return jnp.sum(LOSS.call(y, predictions))

    per_example = jax.vmap(jax.grad(example_loss), in_axes=(None, None, 0, 0))

    def norms_of(grads):
        return jnp.sqrt(sum(jnp.sum(jnp.reshape(g, (g.shape[0], -1)) ** 2, axis=1)
                            for g in grads))

    def vmap_norms(values, frozen, x, y):
        return norms_of(per_example(values, frozen, x, y))

    def vmap_clipped_sum(values, frozen, x, y):
        grads = per_example(values, frozen, x, y)
        factors = jnp.minimum(1.0, CLIP / jnp.maximum(norms_of(grads), 1e-30))
        return [jnp.tensordot(factors, g, axes=1) for g in grads]

    return (jax.jit(jax.grad(total_loss)), jax.jit(per_example), jax.jit(vmap_norms),
            jax.jit(vmap_clipped_sum))


def _timings(model, x, y) -> dict[str, Callable[[], object]]:
    """What one row times, by its column label, all on the same weights and batch."""
    values = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]
    batch_grad, vmap_grads, vmap_norms, vmap_clipped = _baselines(model)
    pex = pergrad.PerExample(model, LOSS)
    timings = {
        "batch gradient": lambda: batch_grad(values, frozen, x, y),
        "pergrad norms": lambda: pex.norms(x, y),
        "pergrad clipped_sum": lambda: pex.clipped_sum(x, y, CLIP),
        "pergrad gradients": lambda: pex.gradients(x, y),
        "vmap norms": lambda: vmap_norms(values, frozen, x, y),
        "vmap clipped_sum": lambda: vmap_clipped(values, frozen, x, y),
        "vmap gradients": lambda: vmap_grads(values, frozen, x, y),
    }
    return {**timings, **_step_timings(model, x, y)}


def _step_timings(model, x, y) -> dict[str, Callable[[], object]]:
    """One SGD ``train_on_batch`` of copies of ``model`` with the same weights."""
    size = int(x.shape[0])

    plain = twin(model)
    private = pergrad.keras.PerExampleModel(
        twin(model), pergrad.aggregate.dp_mean(CLIP, 1.0, expected_batch_size=size))
    steps = {"keras step": plain, "pergrad dp_mean step": private}
    try:
        from jax_privacy import keras_api
    except ImportError:
        keras_api = None
    if keras_api is not None:
        for label, micro in (("jax_privacy step", None), ("jax_privacy micro32 step", 32)):
            config = keras_api.DPKerasConfig(
                epsilon=8.0, delta=1e-5, clipping_norm=CLIP, batch_size=size,
                gradient_accumulation_steps=1, train_steps=1000, train_size=1000 * size,
                noise_multiplier=1.0, microbatch_size=micro if micro and micro < size else None)
            steps[label] = keras_api.make_private(twin(model), config)
    for m in steps.values():
        m.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS)
    return {label: (lambda m=m: m.train_on_batch(x, y)) for label, m in steps.items()}


def run(quick: bool = False, models: tuple[str, ...] | None = None,
        batch_sizes: tuple[int, ...] | None = None, skip: tuple[str, ...] = ()) -> list[dict]:
    """Time every column of every row; ``skip``: column labels not to run (reported as
    ``skipped``), for baselines that take minutes on a model (JAX Privacy on MobileNet)."""
    if keras.backend.backend() != "jax":
        raise SystemExit("Run with KERAS_BACKEND=jax.")
    models = models or (("mlp", "cnn") if quick else DEFAULT_MODELS)
    repeats, budget = (3, 1.0) if quick else (7, 6.0)
    rows = []
    for name in models:
        keras.utils.set_random_seed(0)
        model = MODELS[name]()
        for size in batch_sizes or ((64,) if quick else DEFAULT_BATCH[name][-1:]):
            x, y = batch(name, size)
            timings = _timings(model, jnp.asarray(x), jnp.asarray(y))
            base = None
            for label, fn in timings.items():
                if label in skip:
                    rows.append({"model": name, "batch": size, "what": label, "ms": None,
                                 "ratio": None, "error": "skipped"})
                    continue
                try:
                    seconds = median_seconds(fn, repeats, budget)
                except Exception as error:  # noqa: BLE001 - reported in the table, not hidden
                    rows.append({"model": name, "batch": size, "what": label,
                                 "ms": None, "ratio": None, "error": type(error).__name__})
                    print(f"{name} {size} {label}: failed: {type(error).__name__}: "
                          f"{str(error).splitlines()[0][:200]}", file=sys.stderr, flush=True)
                    continue
                if label in ("batch gradient", "keras step"):
                    base = seconds
                rows.append({"model": name, "batch": size, "what": label, "ms": 1e3 * seconds,
                             "ratio": None if base is None else seconds / base})
                print(f"{name} {size} {label}: {1e3 * seconds:.2f} ms", file=sys.stderr,
                      flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    columns = ["pergrad norms", "pergrad clipped_sum", "pergrad gradients", "vmap norms",
               "vmap clipped_sum", "vmap gradients"]
    steps = ["pergrad dp_mean step", "jax_privacy step", "jax_privacy micro32 step"]
    device = jax.devices()[0]
    lines = [f"JAX {jax.__version__}, Keras {keras.__version__}, {device.platform} "
             f"({getattr(device, 'device_kind', '')}; {platform.machine()})", "",
             "| model | batch | batch gradient | " + " | ".join(columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    step_lines = ["", "| model | batch | Keras step | " + " | ".join(steps) + " |",
                  "|---|---|---|" + "---|" * len(steps)]
    keys = sorted({(r["model"], r["batch"]) for r in rows},
                  key=lambda k: (DEFAULT_MODELS.index(k[0]) if k[0] in DEFAULT_MODELS else 99,
                                 k[1]))
    for model, size in keys:
        cells = {r["what"]: r for r in rows if (r["model"], r["batch"]) == (model, size)}
        base = cells.get("batch gradient", {})
        row = [model, str(size), "failed" if base.get("ms") is None else f"{base['ms']:.2f} ms"]
        lines.append("| " + " | ".join(row + [_ratio(cells, c) for c in columns]) + " |")
        step = cells.get("keras step", {})
        step_row = [model, str(size), "failed" if step.get("ms") is None else f"{step['ms']:.2f} ms"]
        step_lines.append("| " + " | ".join(step_row + [_ratio(cells, c) for c in steps]) + " |")
    return "\n".join(lines + step_lines)


def _ratio(cells: dict, column: str) -> str:
    cell = cells.get(column, {})
    if cell.get("ratio") is None:
        return cell.get("error", "n/a")
    return f"{cell['ratio']:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="mlp and cnn at batch 64")
    parser.add_argument("--models", default=None, help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes")
    parser.add_argument("--skip", default="", help="comma-separated column labels not to run")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows = run(args.quick, tuple(args.models.split(",")) if args.models else None,
               tuple(int(b) for b in args.batch_sizes.split(",")) if args.batch_sizes else None,
               tuple(s for s in args.skip.split(",") if s))
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
