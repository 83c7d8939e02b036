"""Median wall-clock timing with warm-up and a time budget, shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], *, repeats: int = 7, budget_s: float = 10.0,
                   warmup: int = 1) -> tuple[float, int]:
    """Median time of ``fn()`` over up to ``repeats`` calls after ``warmup`` untimed calls
    (tracing, XLA compilation), stopping early once ``budget_s`` seconds are spent.
    Returns ``(median seconds, number of timed calls)``."""
    for _ in range(warmup):
        _to_host(fn())
    times: list[float] = []
    spent = 0.0
    while len(times) < repeats and (spent < budget_s or not times):
        start = time.perf_counter()
        _to_host(fn())
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times), len(times)


def alternating_medians(calls: dict[str, Callable[[], object]],
                        rounds: int) -> dict[str, float]:
    """Median seconds of each of ``calls`` after one untimed call each, timed in turn round
    after round, so that every call sees the same machine state (A/B comparisons in one
    process). Each result is copied to the host before the clock stops."""
    for call in calls.values():
        _to_host(call())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            _to_host(call())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def print_ratios(title: str, medians: dict[str, float], base: str) -> None:
    """``title``, then each median in milliseconds and as a ratio to ``medians[base]``."""
    print(title)
    for name, seconds in medians.items():
        print(f"  {name:28s} {seconds * 1e3:8.2f} ms  {seconds / medians[base]:5.2f}x")


def _to_host(result) -> None:
    """Wait for ``result``: on an accelerator until its kernels are done (JAX's
    ``block_until_ready``, CUDA's synchronize), copying nothing; on the CPU by viewing it as
    NumPy arrays, without copying where the backend allows (TensorFlow and PyTorch CPU
    tensors; JAX arrays wait for their computation).

    Not ``tensor.numpy()``: on TensorFlow that copies, and a timed call that returns per-example
    gradients (686 MB for the MLP at batch 256) then measured mostly the copy (docs/benchmarks.md,
    "Route measurements"). On a GPU the same copy would cross the bus."""
    import keras
    import numpy as np

    backend = keras.backend.backend()  # a benchmark helper: each backend waits its own way
    if backend == "jax":
        import jax

        jax.block_until_ready(result)
        return
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            return
    keras.tree.map_structure(np.asarray, result)


def script_main(description: str, run: Callable[..., list[dict]],
                markdown: Callable[[list[dict]], str], argv: list[str] | None = None,
                quick_help: str = "fewer repeats",
                add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """The command line of a benchmark module: ``[--quick] [--json PATH]`` and the options
    ``add_arguments`` adds (passed to ``run`` as keywords); prints the table."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    if add_arguments is not None:
        add_arguments(parser)
    args = vars(parser.parse_args(argv))
    path = args.pop("json")
    rows = run(**args)
    print(markdown(rows))
    if path:
        with open(path, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0
