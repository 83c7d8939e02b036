"""Two real worker processes on 127.0.0.1 under MultiWorkerMirroredStrategy (``fit_distributed``):
the same update as one process with the same global batch for mean, clip_mean, dp_mean and
median; DP noise added once per global step with std ``C sigma / B``; a worker killed in the
middle of an epoch is reported, and a restart resumes to exactly the uninterrupted result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import multi_worker_script as script  # noqa: E402
from processes import run_bounded  # noqa: E402

from pergrad import aggregate  # noqa: E402
from pergrad.bench.multi_worker import free_ports  # noqa: E402
from pergrad.keras.distributed import fit_distributed  # noqa: E402

pytestmark = pytest.mark.tensorflow_only(reason=(
    "tf.distribute.MultiWorkerMirroredStrategy (fit_distributed, TensorFlow only) over two worker "
    "processes, and fit_distributed's checks of its tf.data inputs"))

TIMEOUT = 150  # seconds per mode for one launch of both workers
FIRST_MODES = ("train", "sequence", "crash")  # crash last: worker 1 leaves in it


def _launch(modes: tuple[str, ...], out: Path) -> list[subprocess.CompletedProcess]:
    """Both workers, running ``modes`` one after another; each worker is stopped by its own
    process id when time runs out."""
    ports = ",".join(map(str, free_ports(2)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    return run_bounded([[sys.executable, str(HERE / "multi_worker_script.py"), str(i), ports,
                         ",".join(modes), str(out)] for i in range(2)],
                       TIMEOUT * len(modes), env)


def _results(launch, mode: str) -> dict:
    """Worker 0's results for ``mode``, or the workers' errors if it wrote none."""
    out, done = launch
    path = out / f"{mode}.json"
    assert path.exists(), "\n".join(f"worker {i} exit {p.returncode}: {p.stderr[-3000:]}"
                                     for i, p in enumerate(done))
    return json.loads(path.read_text())


def _single_process(aggregator, epochs: int = 1, **fit) -> list[np.ndarray]:
    x, y, w = script.data()
    model = script.compiled(aggregator)
    model.fit(x, y, sample_weight=w, batch_size=script.BATCH, epochs=epochs, shuffle=False,
              verbose=0, **fit)
    return model.model.get_weights()


@pytest.mark.slow(reason="two worker processes train, lose a worker and resume: ~2 min")
def test_two_workers_train_as_one_process_and_resume_after_a_lost_worker(tmp_path):
    """One launch of both workers runs the three modes one after another (TensorFlow's start
    and the cluster's set-up are paid once); each mode's checks follow."""
    launch = (tmp_path, _launch(FIRST_MODES, tmp_path))
    _check_equal_to_one_process_with_noise_added_once(_results(launch, "train"))
    _check_models_trained_one_after_another(_results(launch, "sequence"))
    _check_lost_worker_reported_and_resumed(launch, _results(launch, "crash"))


def _check_equal_to_one_process_with_noise_added_once(trained: dict) -> None:
    """mean, clip_mean, dp_mean and median: the weights after one epoch (3 global steps of 16,
    8 examples per worker) equal one process's; the DP noise has std ``C sigma / B`` per step."""
    assert trained["replicas"] == 2
    assert "fit_distributed" in trained["fit_refused"]  # Keras's fit cannot; says what can
    for name in ("mean", "clip_mean", "dp_mean", "median"):
        expected = _single_process(script.AGGREGATORS[name]())
        for got, want in zip(trained[name]["weights"], expected, strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6,
                                       err_msg=name)
    # Three SGD steps: the noisy and noiseless runs differ by lr * sum_t z_t C sigma / B with z_t
    # standard normal, std lr C sigma sqrt(3) / B per entry (sqrt(2) times larger if each
    # worker added its own noise).
    noisy = np.concatenate([np.ravel(v) for v in trained["dp_mean"]["weights"]])
    plain = np.concatenate([np.ravel(v) for v in _single_process(aggregate.dp_mean(0.5, 0.0))])
    expected_std = script.LR * 0.5 * 1.0 * np.sqrt(script.N // script.BATCH) / script.BATCH
    assert abs(np.std(noisy - plain) / expected_std - 1) < 0.2, np.std(noisy - plain)


def _check_models_trained_one_after_another(trained: dict) -> None:
    """clip_mean, dp_mean(expected_batch_size=10) and trimmed_mean trained one after another in
    the same two processes, with Adam (slots made before the step is traced), sample weights and
    shuffled arrays: each ends at one process's weights. Before ``fit_distributed`` built every
    variable first, the second worker's step failed on a placeholder of a lifted initializer."""
    import tensorflow as tf

    x, y, w = script.data()
    for name, make in script.SEQUENCE.items():
        model = script.compiled(make(), optimizer="adam")
        fit_distributed(model, x, y, sample_weight=w, batch_size=script.BATCH, epochs=2,
                        shuffle=True, seed=1, strategy=tf.distribute.get_strategy())
        for got, want in zip(trained[name]["weights"], model.model.get_weights(), strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=name)


def _check_lost_worker_reported_and_resumed(launch, first: dict) -> None:
    """Worker 1 leaves in the middle of epoch 2: worker 0 reports it; launched again, both
    resume from the last checkpoint to exactly the uninterrupted run's state."""
    out, crashed = launch
    assert crashed[1].returncode == 3  # worker 1 left in the middle of epoch 2
    assert crashed[0].returncode == 0, crashed[0].stderr[-3000:]
    assert "A worker stopped responding" in first["failure"]
    assert "(epoch 1, step 2)" in first["failure"]  # saved just before worker 1 left
    resumed = _launch(("resume",), out)
    for proc in resumed:
        assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads((out / "resume.json").read_text())["dp_run"]
    # The uninterrupted run, on one process with the same global batches and noise keys.
    reference = script.dp_run_on_one_process(str(out / "one"))
    for got, want in zip(after["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert after["noise_state"] == reference["noise_state"] == [7, 9]  # 3 epochs x 3 steps
    assert after["iterations"] == reference["iterations"] == 9
    # Every step charged once: the privacy count follows the restored noise stream.
    assert after["privacy_steps"] == reference["privacy_steps"] == 9


def test_fit_distributed_refuses_bad_calls():
    from pergrad.keras.distributed import fit_distributed

    x, y, _ = script.data()
    model = script.compiled(script.AGGREGATORS["mean"]())
    with pytest.raises(ValueError, match="batch_size"):
        fit_distributed(model, x, y)
    with pytest.raises(ValueError, match="epochs"):
        fit_distributed(model, x, y, batch_size=8, epochs=0)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        fit_distributed(model, x, y, batch_size=8, checkpoint_every_n_steps=2)
    import tensorflow as tf

    endless = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    with pytest.raises(ValueError, match="known, finite length"):
        fit_distributed(model, endless)
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="Compile"):
        fit_distributed(plain, x, y, batch_size=8)


def test_fit_distributed_on_one_device_equals_fit():
    """Under the default strategy, fit_distributed with a dataset is Keras's fit."""
    import tensorflow as tf

    from pergrad.keras.distributed import fit_distributed

    x, y, w = script.data()
    model = script.compiled(script.AGGREGATORS["clip_mean"]())
    data = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(script.BATCH)
    history = fit_distributed(model, data, epochs=2)
    expected = _single_process(script.AGGREGATORS["clip_mean"](), epochs=2)
    for got, want in zip(model.model.get_weights(), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert len(history.history["loss"]) == 2
