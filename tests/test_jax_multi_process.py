"""``PerExampleModel`` on two JAX processes (``keras.distribution.initialize`` on 127.0.0.1,
gloo collectives on CPU, ``DataParallel`` over both processes' devices) against one process.

Each process feeds its own half of every global batch (``auto_shard_dataset = False``); the
global batch is process 0's rows, then process 1's, so one process training on the whole batch
in that order must reach the same weights. The ``tf.data`` route (every process passes the same
dataset of global batches and Keras splits it, ``auto_shard_dataset = True``) must too. Both processes run in bounded time and are stopped
by their own process ids. The children always run JAX: these tests run once, in the PyTorch
run of the suite.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from pergrad.bench.multi_worker import free_ports

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import jax_children, run_bounded  # noqa: E402

pytestmark = jax_children(
    "its two JAX processes (keras.distribution.initialize, gloo "
    "collectives, a tf.data route)")

TIMEOUT = 150.0
_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
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
    x_all, y_all = x, y
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
    for name, agg in [("mean", aggregate.mean()), ("clip_mean", aggregate.clip_mean(0.5)),
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
    # The tf.data route: every process passes the same dataset of global batches and Keras
    # splits it (auto_shard_dataset on: process i takes rows [8 i, 8 i + 8) of each batch).
    import tensorflow as tf
    if mode == "two":
        distribution.auto_shard_dataset = True
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    inner.set_weights(init)
    model = PerExampleModel(inner, aggregate.dp_mean(0.5, 1.0, seed=9))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(16), epochs=1,
              verbose=0)
    out["dp_mean_dataset"] = [np.asarray(w).tolist() for w in inner.get_weights()]
    print("RESULT" + json.dumps(out), flush=True)
""")


def _run(script, mode: str) -> list[dict]:
    port = str(free_ports(1)[0])
    count = 2 if mode == "two" else 1
    results = run_bounded([[sys.executable, str(script), str(i), port, mode]
                           for i in range(count)], TIMEOUT, _ENV)
    outputs = []
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(_result_line(result.stdout))
    return outputs


def _result_line(stdout: str) -> dict:
    line = next(s for s in stdout.splitlines() if s.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q))))
               for p, q in zip(a, b, strict=True))


@pytest.mark.needs_tensorflow  # the children's tf.data route
def test_two_processes_equal_one_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (one,) = _run(script, "one")
    two = _run(script, "two")
    assert [out["devices"] for out in two] == [2, 2]
    for name in ("mean", "clip_mean", "dp_mean", "median", "dp_mean_dataset"):
        for out in two:  # both processes hold the same weights, equal to one process's
            assert _max_diff(out[name], one[name]) < 1e-5, name
    # The seeded noise is the same as on one process: drawn once per global step, not per
    # process (two draws would differ), and the stream advanced once per step.
    assert [out["dp_mean_noise_state"] for out in two] == [[9, 2], [9, 2]]
    assert one["dp_mean_noise_state"] == [9, 2]


# Faults. Three epochs of two global steps (Adam, seeded dp_mean) with DistributedBackup; in
# "kill" process 1 dies after the first step of epoch 1, in "stall" it stops (SIGSTOP) there;
# "resume" restarts both processes with the same command; "one" is the uninterrupted run on one
# process with the whole global batch.
FAULT_WORKER = textwrap.dedent(r"""
    import json, os, signal, sys
    os.environ["KERAS_BACKEND"] = "jax"
    index, port, mode, backup_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if mode != "one":
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index,
                                   heartbeat_timeout_seconds=HEARTBEAT)
    import keras
    import numpy as np
    from pergrad import aggregate
    from pergrad.keras import DistributedBackup, PerExampleModel, WorkerFailureError

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, size=32)
    if mode == "one":
        batch = 16
    else:
        distribution = keras.distribution.DataParallel(devices=jax.devices())
        distribution.auto_shard_dataset = False
        keras.distribution.set_distribution(distribution)
        rows = np.arange(32).reshape(2, 2, 8)[:, index].reshape(-1)
        x, y, batch = x[rows], y[rows], 8
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    model = PerExampleModel(inner, aggregate.dp_mean(0.5, 1.0, seed=9))
    model.compile(optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Fault(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
        def on_train_batch_end(self, batch, logs=None):
            if index == 1 and self.epoch == 1 and batch == 0:
                print("FAULT", flush=True)
                if mode == "kill":
                    os._exit(1)
                os.kill(os.getpid(), signal.SIGSTOP)

    callbacks = [DistributedBackup(backup_dir, delete_checkpoint=False, replay_same_batches=True)]
    if mode in ("kill", "stall"):
        callbacks.append(Fault())
    try:
        history = model.fit(x, y, batch_size=batch, epochs=3, shuffle=False, verbose=0,
                            callbacks=callbacks)
    except WorkerFailureError as error:
        print("FAILED" + json.dumps(str(error)), flush=True)
        os._exit(3)
    out = {"epochs": history.epoch,
           "weights": [np.asarray(w).tolist() for w in inner.get_weights()],
           "optimizer": [np.asarray(v.value).tolist() for v in model.optimizer.variables],
           "noise_state": np.asarray(model.noise_state).tolist()}
    print("RESULT" + json.dumps(out), flush=True)
""")
HEARTBEAT = 5


def _fault_script(tmp_path) -> Path:
    script = tmp_path / "fault_worker.py"
    script.write_text(FAULT_WORKER.replace("HEARTBEAT", str(HEARTBEAT)))
    return script


def _launch_faulty(script, mode: str, backup_dir) -> list:
    port = str(free_ports(1)[0])
    return run_bounded([[sys.executable, str(script), str(i), port, mode, str(backup_dir)]
                        for i in range(2)], TIMEOUT, _ENV)


def test_lost_process_is_reported_and_restart_resumes_exactly(tmp_path):
    script = _fault_script(tmp_path)
    backup_dir = tmp_path / "backup"
    killed = _launch_faulty(script, "kill", backup_dir)
    assert "FAULT" in killed[1].stdout and killed[1].returncode == 1
    # The survivor raised WorkerFailureError (exit 3), naming the epoch to resume from.
    assert killed[0].returncode == 3, killed[0].stderr[-3000:]
    message = json.loads(next(s for s in killed[0].stdout.splitlines()
                              if s.startswith("FAILED")).removeprefix("FAILED"))
    assert "resumes from epoch 1" in message and str(backup_dir) in message
    assert sorted(p.name for p in backup_dir.iterdir()) == ["process_0", "process_1"]

    resumed = _launch_faulty(script, "resume", backup_dir)
    (one,) = [_result_line(r.stdout) for r in run_bounded(
        [[sys.executable, str(script), "0", "0", "one", str(tmp_path / "one")]], TIMEOUT, _ENV)]
    assert one["epochs"] == [0, 1, 2] and one["noise_state"] == [9, 6]
    for result in resumed:
        assert result.returncode == 0, result.stderr[-3000:]
        out = _result_line(result.stdout)
        assert out["epochs"] == [1, 2]  # restarted at the checkpoint, not from the start
        assert _max_diff(out["weights"], one["weights"]) < 1e-5
        assert _max_diff(out["optimizer"], one["optimizer"]) < 1e-5  # iterations and moments
        # The stream resumed where the checkpoint left it: 6 keys in all, none drawn twice.
        assert out["noise_state"] == [9, 6]


def _wait_for(proc, marker: str, timeout: float = TIMEOUT) -> None:
    """Read ``proc``'s stdout until a line starts with ``marker`` (at most ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(marker):
                return
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"no {marker!r} line from process {proc.pid}")


def test_stalled_process_ends_training_within_the_heartbeat_timeout(tmp_path):
    script = _fault_script(tmp_path)
    port = str(free_ports(1)[0])
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, "stall",
                               str(tmp_path / "backup")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_ENV) for i in range(2)]
    try:
        _wait_for(procs[1], "FAULT")
        stopped = time.monotonic()
        # Collectives wait on the stopped peer; JAX's coordination service ends the survivor
        # once that peer has missed its heartbeats for HEARTBEAT seconds.
        _, stderr = procs[0].communicate(timeout=HEARTBEAT + 60)
        assert time.monotonic() - stopped < HEARTBEAT + 60
        assert procs[0].returncode != 0
        assert "heartbeat" in stderr.lower()
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
