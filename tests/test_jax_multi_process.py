"""``PerExampleModel`` on two JAX processes (``keras.distribution.initialize`` on 127.0.0.1,
gloo collectives on CPU, ``DataParallel`` over both processes' devices) against one process.

Each process feeds its own half of every global batch (``auto_shard_dataset = False``); the
global batch is process 0's rows, then process 1's, so one process training on the whole batch
in that order must reach the same weights. Both processes run in bounded time and are stopped
by their own process ids. The children always run JAX: this test runs once, in the TensorFlow
run of the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from pergrad.bench.multi_worker import free_ports

TIMEOUT = 150.0
GLOBAL_BATCH, PER_PROCESS = 16, 8

WORKER = textwrap.dedent(r"""
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    index, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras
    import numpy as np
    if mode == "two":
        keras.distribution.initialize(job_addresses=f"127.0.0.1:{port}", num_processes=2,
                                      process_id=index)
    from pergrad import aggregate
    from pergrad.keras import PerExampleModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, size=32)
    keras.utils.set_random_seed(0)
    init = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)]).get_weights()
    if mode == "two":
        distribution = keras.distribution.DataParallel(devices=jax.devices())
        distribution.auto_shard_dataset = False  # each process feeds its own rows
        keras.distribution.set_distribution(distribution)
        # Global batch b is rows [16 b, 16 b + 16): process i holds its half of each.
        rows = np.arange(32).reshape(2, 2, 8)[:, index].reshape(-1)
        x, y, batch = x[rows], y[rows], 8
    else:
        batch = 16
    out = {"devices": len(jax.devices())}
    for name, agg in [("clip_mean", aggregate.clip_mean(0.5)),
                      ("dp_mean", aggregate.dp_mean(0.5, 1.0, seed=9)),
                      ("median", aggregate.median())]:
        inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3)])
        inner.set_weights(init)
        model = PerExampleModel(inner, agg)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        out[name] = [np.asarray(w).tolist() for w in inner.get_weights()]
        if model.noise_state is not None:
            out[name + "_noise_state"] = np.asarray(model.noise_state).tolist()
    print("RESULT" + json.dumps(out), flush=True)
""")


def _run(script, mode: str) -> list[dict]:
    port = str(free_ports(1)[0])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    count = 2 if mode == "two" else 1
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for i in range(count)]
    deadline = time.monotonic() + TIMEOUT
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, stderr[-3000:]
            line = next(s for s in stdout.splitlines() if s.startswith("RESULT"))
            outputs.append(json.loads(line.removeprefix("RESULT")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
    return outputs


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q))))
               for p, q in zip(a, b, strict=True))


def test_two_processes_equal_one_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (one,) = _run(script, "one")
    two = _run(script, "two")
    assert [out["devices"] for out in two] == [2, 2]
    for name in ("clip_mean", "dp_mean", "median"):
        for out in two:  # both processes hold the same weights, equal to one process's
            assert _max_diff(out[name], one[name]) < 1e-5, name
    # The seeded noise is the same as on one process: drawn once per global step, not per
    # process (two draws would differ), and the stream advanced once per step.
    assert [out["dp_mean_noise_state"] for out in two] == [[9, 2], [9, 2]]
    assert one["dp_mean_noise_state"] == [9, 2]
