"""The command line end to end, in subprocesses, with tiny settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pergrad.demo import detection_scores, flip_labels


def pergrad(*args: str, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "pergrad", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)


def test_analyze_writes_the_report_and_finds_flipped_labels(tmp_path):
    out = tmp_path / "report"
    done = pergrad("analyze", "--epochs", "3", "--label-noise", "0.2", "--out", str(out),
                   "--seed", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("metrics.csv", "report.png", "conflicting_examples.png", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["examples"] == 1437
    detection = summary["label_noise_detection"]["conflict_with_rest"]
    assert detection["k"] == round(0.2 * 1437)
    from pergrad import demo  # the flips are listed, as the demo made them from the clean labels
    (_, clean), _ = demo.load_digits_split(seed=1)
    noisy, flipped = demo.flip_labels(clean, 0.2, seed=1)
    assert summary["flipped"] == [{"index": int(i), "given": int(noisy[i]), "true": int(clean[i])}
                                  for i in np.flatnonzero(flipped)]
    assert detection["roc_auc"] > 0.7, detection  # random ranking gives 0.5
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"step", "loss", "noise_scale", "fraction_against_rest", "norm_p50"} <= set(header)
    assert "epoch" in done.stdout and "ROC AUC" in done.stdout


def test_analyze_dp_reports_epsilon(tmp_path):
    done = pergrad("analyze", "--epochs", "1", "--aggregator", "dp", "--batch-size", "128",
                   "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 < summary["final"]["epsilon"] < 100
    assert "epsilon" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["analyze", "--epochs", "0"], "--epochs"),
    (["analyze", "--label-noise", "0.9"], "--label-noise"),
    (["analyze", "--aggregator", "adam"], "--aggregator"),
    (["bench", "--batch-sizes", "a,b"], "--batch-sizes"),
    (["privacy", "--num-examples", "100", "--batch-size", "10", "--epochs", "1",
      "--delta", "1e-5"], "noise-multiplier"),
    (["nonsense"], "invalid choice"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    done = pergrad(*args)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_privacy_and_help():
    done = pergrad("privacy", "--num-examples", "60000", "--batch-size", "150",
                   "--noise-multiplier", "1.3", "--epochs", "15", "--delta", "1e-5")
    assert done.returncode == 0 and "0.72" in done.stdout, done.stdout + done.stderr
    helped = pergrad("analyze", "--help")
    for option in ("--epochs", "--batch-size", "--aggregator", "--label-noise", "--out", "--seed"):
        assert option in helped.stdout


def test_bench_quick_runs_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    done = pergrad("bench", "--quick", "--models", "mlp", "--batch-sizes", "16",
                   "--json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(path.read_text())["engine"]
    assert {(r["strategy"], r["method"]) for r in rows} >= {("batch gradient", "-"),
                                                             ("auto", "norms"), ("vmap", "gradients")}
    assert "| mlp | 16 |" in done.stdout


def test_bench_runs_every_suite(tmp_path):
    path = tmp_path / "suites.json"
    done = pergrad("bench", "--quick", "--suites", "training,monitor,jacobian", "--json", str(path),
                   timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(path.read_text())
    assert set(results) == {"training", "monitor", "jacobian"}
    assert all(results[suite] for suite in results)
    assert "x plain Keras" in done.stdout and "tf.function tape" in done.stdout


def test_flip_labels_and_detection_scores():
    labels = np.arange(100) % 10
    noisy, flipped = flip_labels(labels, 0.25, seed=3)
    assert flipped.sum() == 25 and np.all(noisy[flipped] != labels[flipped])
    assert np.all(noisy[~flipped] == labels[~flipped])
    perfect = detection_scores(flipped.astype(float), flipped)
    assert perfect == {"precision_at_k": 1.0, "roc_auc": 1.0, "k": 25}
    inverted = detection_scores(-flipped.astype(float), flipped)
    assert inverted["roc_auc"] == 0.0 and inverted["precision_at_k"] == 0.0
