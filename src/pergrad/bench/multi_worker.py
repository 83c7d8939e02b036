"""Step time of data-parallel training on 1 and 2 worker processes on this machine (127.0.0.1).

Each configuration starts its workers as processes and trains the benchmark CNN (28x28x1, batch
256 global) with ``PerExampleModel``: on TensorFlow with ``fit_distributed`` under
``MultiWorkerMirroredStrategy`` (``TF_CONFIG`` on localhost ports), on JAX (``--backend jax``)
with ``fit`` under ``keras.distribution.DataParallel`` over ``jax.distributed`` processes (gloo
collectives). It reports the median time of a training step after one
warm-up epoch, for ``mean`` (one all-reduce of the P summed gradient entries per step),
``dp_mean`` (the same, plus noise drawn once) and ``median`` (an all-gather of B x P per-example
gradient rows). With 2 workers on one 2-core machine there is no speed-up to expect: the table
shows the cost of the collectives, not scaling. Nothing here is a pass/fail check.

    python benchmarks/bench_multi_worker.py [--quick] [--json PATH] [--backend jax]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

AGGREGATORS = ("mean", "dp_mean", "median")
GLOBAL_BATCH = 256


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports on 127.0.0.1 that are free now (bound once, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _compiled_model(aggregator: str):
    """The benchmark CNN in a ``PerExampleModel`` with ``aggregator``, compiled with SGD."""
    import keras

    from pergrad import aggregate
    from pergrad.bench.models import cnn
    from pergrad.keras import PerExampleModel

    make = {"mean": aggregate.mean, "median": aggregate.median,
            "dp_mean": lambda: aggregate.dp_mean(1.0, 1.0, seed=0)}[aggregator]
    keras.utils.set_random_seed(0)
    model = PerExampleModel(cnn(), make())
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _step_timer(times: list[float]):
    """A callback appending every training step's wall time to ``times``."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            times.append(time.perf_counter() - self.start)

    return StepTimer()


def _report_and_exit(index: int, times: list[float], steps: int, out: str) -> None:
    """Process 0 writes the median step time of the second epoch; every process exits."""
    if index == 0:
        import numpy as np
        with open(out, "w") as handle:
            json.dump({"median_s": float(np.median(times[steps:]))}, handle)
    sys.stdout.flush()
    os._exit(0)


def worker(index: int, ports: list[int], aggregator: str, steps: int, out: str) -> None:
    """One worker process: train, time each step, worker 0 writes the median to ``out``."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": index}})
    from pergrad.bench.models import batch
    from pergrad.keras import fit_distributed, multi_worker_strategy

    strategy = multi_worker_strategy(timeout_seconds=300)
    with strategy.scope():
        model = _compiled_model(aggregator)
    x, y = batch("cnn", GLOBAL_BATCH * steps)
    times: list[float] = []
    fit_distributed(model, x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                    callbacks=[_step_timer(times)], strategy=strategy)
    _report_and_exit(index, times, steps, out)


def jax_worker(index: int, count: int, port: int, aggregator: str, steps: int,
               out: str) -> None:
    """One JAX process of ``count``: its half of every global batch, timed as ``worker``."""
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if count > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=index)
    import keras
    import numpy as np

    from pergrad.bench.models import batch

    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    model = _compiled_model(aggregator)
    x, y = batch("cnn", GLOBAL_BATCH * steps)
    local = GLOBAL_BATCH // count
    rows = np.arange(len(x)).reshape(steps, count, local)[:, index].reshape(-1)
    times: list[float] = []
    model.fit(x[rows], y[rows], batch_size=local, epochs=2, shuffle=False, verbose=0,
              callbacks=[_step_timer(times)])
    _report_and_exit(index, times, steps, out)


def measure(workers: int, aggregator: str, steps: int, backend: str = "tensorflow") -> float:
    ports = free_ports(workers)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "time.json")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                   KERAS_BACKEND=backend)
        if backend == "jax":
            commands = [["--jax-worker", str(i), str(workers), str(ports[0])]
                        for i in range(workers)]
        else:
            commands = [["--worker", str(i), ",".join(map(str, ports))] for i in range(workers)]
        procs = [subprocess.Popen([sys.executable, "-m", "pergrad.bench.multi_worker", *command,
                                   aggregator, str(steps), out], env=env,
                                  stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for command in commands]
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=900)
                if proc.returncode != 0:
                    raise RuntimeError(f"worker failed:\n{err[-2000:]}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        with open(out) as handle:
            return json.load(handle)["median_s"]


def run(quick: bool = False, backend: str = "tensorflow") -> list[dict]:
    steps = 3 if quick else 10
    rows = []
    for aggregator in AGGREGATORS:
        one = measure(1, aggregator, steps, backend)
        two = measure(2, aggregator, steps, backend)
        rows.append({"aggregator": aggregator, "one_worker_ms": 1e3 * one,
                     "two_workers_ms": 1e3 * two, "ratio": two / one})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| aggregator | 1 worker, ms/step | 2 workers, ms/step | 2 / 1 |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['aggregator']} | {r['one_worker_ms']:.0f} | "
                     f"{r['two_workers_ms']:.0f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        index, ports, aggregator, steps, out = argv[1:6]
        worker(int(index), [int(p) for p in ports.split(",")], aggregator, int(steps), out)
        return 0
    if argv and argv[0] == "--jax-worker":
        index, count, port, aggregator, steps, out = argv[1:7]
        jax_worker(int(index), int(count), int(port), aggregator, int(steps), out)
        return 0
    from pergrad.bench.timing import script_main

    def backend_option(parser) -> None:
        parser.add_argument("--backend", choices=("tensorflow", "jax"), default="tensorflow",
                            help="fit_distributed on TensorFlow, or DataParallel on JAX")

    return script_main("Data-parallel step time on 1 and 2 local worker processes.", run,
                       markdown, argv, quick_help="3 steps per epoch",
                       add_arguments=backend_option)


if __name__ == "__main__":
    sys.exit(main())
