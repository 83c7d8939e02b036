"""pergrad on the PyTorch backend (CPU or CUDA): norms, clipped sum and gradients against torch's own
batch gradient of the same Keras model, and against the ``torch.func.vmap(grad)`` baseline;
then ``PerExampleModel`` training steps against a plain Keras step.

    KERAS_BACKEND=torch python benchmarks/bench_torch.py [--models mlp,cnn] [--batch 256]
        [--threads 1] [--skip-engine]

Training steps: ``train_on_batch`` of a plain ``keras.Model`` compiled with Adam, against the
same weights and data under ``PerExampleModel`` with ``aggregate.mean()``, ``clip_mean`` and
``dp_mean`` (``l2_norm_clip=1``, ``noise_multiplier=1``), each step timed whole.

Each ratio is against the batch gradient measured in the same run: ``torch.autograd.grad`` of
the summed loss through one ordinary (eager) call of the model. *vmap* is pergrad's
``strategy="vmap"``: ``torch.func.vmap(torch.func.grad(one example's loss))`` through
``model.stateless_call``, its norms and clipped sum from the materialized gradients. Median of
``--repeats`` calls after two untimed ones.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402

import pergrad  # noqa: E402
from pergrad.bench import models  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _finished(result) -> None:
    """Wait for the kernels behind ``result`` on a GPU (CUDA runs them asynchronously)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        _finished(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _finished(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _row(name: str, size: int, repeats: int) -> list[str]:
    keras.utils.set_random_seed(0)
    model = models.MODELS[name]()
    x, y = models.batch(name, size)
    auto = pergrad.PerExample(model, LOSS)
    vmap = pergrad.PerExample(model, LOSS, strategy="vmap")
    xt, yt, _ = auto.prepare(x, y)
    weights = [v.value for v in model.trainable_variables]

    def batch_gradient():
        loss = torch.sum(LOSS.call(yt, model(xt)))
        return torch.autograd.grad(loss, weights)

    base = _median_ms(batch_gradient, repeats)
    cells = [name, str(size), f"{base:.2f} ms"]
    runs = [lambda: auto.norms(xt, yt), lambda: auto.clipped_sum(xt, yt, 1.0),
            lambda: auto.gradients(xt, yt), lambda: vmap.norms(xt, yt),
            lambda: vmap.clipped_sum(xt, yt, 1.0), lambda: vmap.gradients(xt, yt)]
    for run in runs:
        try:
            cells.append(f"{_median_ms(run, repeats) / base:.2f}x")
        except NotImplementedError:
            cells.append("n/a")
    return cells


def _training_row(name: str, size: int, repeats: int) -> list[str]:
    from pergrad import aggregate

    x, y = models.batch(name, size)

    def step_of(aggregator):
        keras.utils.set_random_seed(0)
        model = models.MODELS[name]()
        if aggregator is not None:
            model = pergrad.keras.PerExampleModel(model, aggregator)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
        return lambda: model.train_on_batch(x, y)

    base = _median_ms(step_of(None), repeats)
    cells = [name, str(size), f"{base:.2f} ms"]
    for aggregator in (aggregate.mean(), aggregate.clip_mean(1.0),
                       aggregate.dp_mean(1.0, 1.0, expected_batch_size=size)):
        cells.append(f"{_median_ms(step_of(aggregator), repeats) / base:.2f}x")
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-engine", action="store_true",
                        help="only the training-step table")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if keras.backend.backend() != "torch":
        parser.error("run with KERAS_BACKEND=torch")
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"{platform.machine()}, {torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, Keras {keras.__version__}, {device}\n")
    if not args.skip_engine:
        print("| model | batch | batch gradient | pergrad norms | pergrad clipped_sum | "
              "pergrad gradients | vmap norms | vmap clipped_sum | vmap gradients |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in args.models.split(","):
            print("| " + " | ".join(_row(name, args.batch, args.repeats)) + " |", flush=True)
        print()
    print("| model | batch | Keras step | mean step | clip_mean step | DP step (dp_mean) |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        print("| " + " | ".join(_training_row(name, args.batch, args.repeats)) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
