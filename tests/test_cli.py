"""The command line end to end, in subprocesses, with tiny settings.

The in-process ``pergrad analyze`` tests run on every backend; the subprocess tests are marked
to run once: from the TensorFlow run, except those whose children run JAX (``jax_child``), from
the PyTorch run, the shortest suite."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from processes import jax_children

from pergrad.demo import detection_scores, flip_labels


def jax_child(test):
    """A test whose children run JAX whatever this run's backend: once, from the PyTorch run."""
    for mark in jax_children("its KERAS_BACKEND=jax children"):
        test = mark(test)
    return test


def pergrad(*args: str, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "pergrad", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)


@pytest.mark.tensorflow_only(reason=(
    "subprocess test: `python -m pergrad analyze` in a child that inherits this run's "
    "KERAS_BACKEND; the CLI's children are launched once, from the TensorFlow run (the JAX child "
    "is test_analyze_on_the_jax_backend)"))
def test_analyze_writes_the_report_and_finds_flipped_labels(tmp_path):
    out = tmp_path / "report"
    done = pergrad("analyze", "--epochs", "3", "--label-noise", "0.2", "--out", str(out),
                   "--seed", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("metrics.csv", "examples.csv", "label_issues.csv", "report.png",
                 "flagged_examples.png", "influence.png", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    for name in ("report.png", "flagged_examples.png", "influence.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["rows"] == 1797
    assert summary["training_rows"] == 1437 and summary["held_out_rows"] == 360
    detection = summary["label_noise_detection"]["default"]
    assert detection["k"] == round(0.2 * 1797)
    from pergrad import demo  # flips are listed by their row in scikit-learn's digits
    _, clean = demo.load_digits_images()
    noisy, flipped = demo.flip_labels(clean, 0.2, seed=1)
    assert summary["flipped"] == [{"row": int(i), "given": int(noisy[i]), "true": int(clean[i])}
                                  for i in np.flatnonzero(flipped)]
    assert detection["roc_auc"] > 0.7, detection  # random ranking gives 0.5
    rows = (out / "examples.csv").read_text().splitlines()
    assert rows[0].startswith("rank,row,split,given,true,suggested,flagged_by,seen,default,loss")
    assert len(rows) == 1 + 1797
    ranked = [int(r.split(",")[1]) for r in rows[1:17]]
    assert ranked == [s["row"] for s in summary["most_suspect"]]
    assert [len(e["most_helpful"]) for e in summary["influence"]] == [4] * 4
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"step", "loss", "noise_scale", "fraction_against_rest", "norm_p50"} <= set(header)
    assert "epoch" in done.stdout and "ROC AUC" in done.stdout


@jax_child
def test_analyze_on_the_jax_backend(tmp_path):
    """``KERAS_BACKEND=jax pergrad analyze``: the monitor, the label-error scores and TracIn on
    JAX (its own process, whatever backend this one runs: once, in the PyTorch run)."""
    out = tmp_path / "report"
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, "-m", "pergrad", "analyze", "--epochs", "2",
                           "--batch-size", "128", "--label-noise", "0.2", "--folds", "0",
                           "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["training_rows"] == 1437
    detection = summary["label_noise_detection"]
    assert detection["default"]["k"] == round(0.2 * 1797)
    assert detection["default"]["roc_auc"] > 0.7, detection  # random ranking gives 0.5
    assert set(summary["final"]) >= {"loss", "accuracy", "noise_scale", "fraction_against_rest"}
    rows = [r.split(",") for r in (out / "examples.csv").read_text().splitlines()]
    assert len(rows) == 1 + 1797
    seen = [int(r[7]) for r in rows[1:] if r[2] == "train"]
    assert seen == [2] * 1437  # every example in one batch per epoch, tracked by its index
    metrics = (out / "metrics.csv").read_text().splitlines()
    assert len(metrics) == 1 + 2 * 12  # one row per step: 12 batches of 128 per epoch
    for name in ("report.png", "flagged_examples.png", "influence.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [len(e["most_helpful"]) for e in summary["influence"]] == [4] * 4
    assert "ROC AUC" in done.stdout


@pytest.mark.tensorflow_only(reason=(
    "subprocess test: `python -m pergrad analyze --aggregator dp` in a child that inherits this "
    "run's KERAS_BACKEND; the CLI's children are launched once, from the TensorFlow run (no "
    "JAX/PyTorch DP analyze child yet)"))
def test_analyze_dp_reports_epsilon(tmp_path):
    done = pergrad("analyze", "--epochs", "1", "--aggregator", "dp", "--batch-size", "128",
                   "--folds", "0", "--out", str(tmp_path))
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
@pytest.mark.tensorflow_only(reason=(
    "subprocess test: `python -m pergrad <bad arguments>` in a child that inherits this run's "
    "KERAS_BACKEND; the CLI's children are launched once, from the TensorFlow run"))
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    done = pergrad(*args)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr


@pytest.mark.tensorflow_only(reason=(
    "subprocess test: `python -m pergrad privacy / analyze --help` in a child that inherits this "
    "run's KERAS_BACKEND; the CLI's children are launched once, from the TensorFlow run"))
def test_privacy_and_help():
    done = pergrad("privacy", "--num-examples", "60000", "--batch-size", "150",
                   "--noise-multiplier", "1.3", "--epochs", "15", "--delta", "1e-5")
    assert done.returncode == 0 and "0.72" in done.stdout, done.stdout + done.stderr
    helped = pergrad("analyze", "--help")
    for option in ("--epochs", "--batch-size", "--aggregator", "--label-noise", "--out", "--seed"):
        assert option in helped.stdout


@pytest.mark.tensorflow_only(reason=(
    "subprocess test: `python -m pergrad bench --quick` in a child that inherits this run's "
    "KERAS_BACKEND; the CLI's children are launched once, from the TensorFlow run (on TensorFlow "
    "the engine suite; JAX's is test_bench_on_the_jax_backend)"))
def test_bench_quick_runs_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    done = pergrad("bench", "--quick", "--models", "mlp", "--batch-sizes", "16",
                   "--json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(path.read_text())["engine"]
    assert {(r["strategy"], r["method"]) for r in rows} >= {("batch gradient", "-"),
                                                             ("auto", "norms"), ("vmap", "gradients")}
    assert "| mlp | 16 |" in done.stdout


@jax_child
def test_bench_on_the_jax_backend(tmp_path):
    """``pergrad bench --backend jax``: the JAX engine suite, DP step included, from the CLI
    (its own process, whatever backend this one runs: once, in the PyTorch run)."""
    path = tmp_path / "jax.json"
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, "-m", "pergrad", "bench", "--backend", "jax",
                           "--quick", "--models", "mlp", "--batch-sizes", "16", "--json",
                           str(path)], capture_output=True, text=True, timeout=300,
                          env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(path.read_text())["engine"]
    measured = {r["what"] for r in rows if r["ms"] is not None}
    assert {"batch gradient", "pergrad norms", "pergrad clipped_sum", "vmap gradients",
            "keras step", "pergrad dp_mean step"} <= measured
    assert "| mlp | 16 |" in done.stdout and "JAX" in done.stdout
    refused = subprocess.run([sys.executable, "-m", "pergrad", "bench", "--backend", "jax",
                              "--suites", "training"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert refused.returncode == 2 and "only the engine suite" in refused.stderr


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
@pytest.mark.tensorflow_only(reason=(
    "subprocess test: launches its KERAS_BACKEND=tensorflow, jax and torch `pergrad bench "
    "--suites real-models` children once, from the TensorFlow run"))
@pytest.mark.slow(reason="a benchmark run in a child process, 20-35 s")
def test_bench_real_models_on_every_backend(backend, tmp_path):
    """``pergrad bench --suites real-models``: a KerasHub BERT with LoRA, its norms, clipped sum
    and DP step against its batch gradient and plain Keras step, on each backend (a process of
    its own); a model of another suite is refused."""
    pytest.importorskip("keras_hub")
    path = tmp_path / "real.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND=backend)
    done = subprocess.run([sys.executable, "-m", "pergrad", "bench", "--suites", "real-models",
                           "--quick", "--models", "bert_lora", "--json", str(path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(path.read_text())["real-models"]
    assert row["model"] == "bert_lora" and row["backend"] == backend
    assert all(row[k] > 0 for k in ("batch_gradient_s", "norms", "clipped_sum", "dp_step"))
    assert f"| bert_lora | {backend} | 8 |" in done.stdout
    refused = subprocess.run([sys.executable, "-m", "pergrad", "bench", "--suites",
                              "real-models", "--models", "cnn"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert refused.returncode == 2 and "unknown models ['cnn']" in refused.stderr


@pytest.mark.tensorflow_only(reason=(
    "subprocess test: the TensorFlow benchmark suites (training, monitor, jacobian: their report "
    "names the tf.function tape) in a child launched once, from the TensorFlow run"))
@pytest.mark.slow(reason="three benchmark suites in a child process, ~35 s")
def test_bench_runs_every_suite(tmp_path):
    """The quick training, monitor and jacobian suites; on the CNN only, unless
    PERGRAD_FULL_TESTS=1 asks for every default model (the transformer's traces double the
    time)."""
    path = tmp_path / "suites.json"
    models = [] if os.environ.get("PERGRAD_FULL_TESTS") == "1" else ["--models", "cnn"]
    done = pergrad("bench", "--quick", "--suites", "training,monitor,jacobian", *models,
                   "--json", str(path), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(path.read_text())
    assert set(results) == {"training", "monitor", "jacobian"}
    assert all(results[suite] for suite in results)
    expected = {"cnn"} if models else {"cnn", "transformer"}
    assert {row["model"] for row in results["training"]} == expected
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


def _in_process(*args: str) -> int:
    """``pergrad ARGS`` in this process (no second TensorFlow start-up), output discarded."""
    from pergrad.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        return main(list(args))


def _tiny_classifier(path, inputs, classes: int, compiled: bool = True) -> None:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(inputs), keras.layers.Flatten(),
                              keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(classes)])
    if compiled:
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.save(path)


def test_analyze_your_own_model_and_arrays(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + 2 * (x[:, 1] > 0)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    _tiny_classifier(tmp_path / "model.keras", (4,), 4)
    out = tmp_path / "report"
    assert _in_process("analyze", "--model", str(tmp_path / "model.keras"), "--data",
                       str(tmp_path / "train.npz"), "--epochs", "2", "--batch-size", "16",
                       "--label-noise", "0.1", "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["training_rows"] == 48 and len(summary["flipped"]) == 6  # 10% of 60 rows
    rows = (out / "examples.csv").read_text().splitlines()
    assert len(rows) == 61 and rows[0].startswith("rank,row,split,given,true,suggested")
    assert not (out / "flagged_examples.png").exists()  # tabular data: no pictures of inputs
    assert len(summary["influence"]) == 4


def test_analyze_a_folder_of_images_reports_paths(tmp_path):
    import keras

    rng = np.random.default_rng(1)
    for name in ("cat", "dog"):
        (tmp_path / "images" / name).mkdir(parents=True)
        for k in range(6):
            pixels = rng.integers(0, 255, size=(6, 6, 1)).astype("uint8")
            keras.utils.save_img(tmp_path / "images" / name / f"{k}.png", pixels, scale=False)
    _tiny_classifier(tmp_path / "model.keras", (6, 6, 1), 2, compiled=False)
    out = tmp_path / "report"
    assert _in_process("analyze", "--model", str(tmp_path / "model.keras"), "--data",
                       str(tmp_path / "images"), "--loss", "sparse_categorical_crossentropy",
                       "--from-logits", "--epochs", "1", "--batch-size", "4", "--folds", "0",
                       "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert all(s["path"].endswith(".png") and s["given"] in ("cat", "dog")
               for s in summary["most_suspect"])
    assert summary["influence"][0]["most_helpful"][0]["path"].endswith(".png")
    assert (out / "flagged_examples.png").exists() and (out / "influence.png").exists()
    header = (out / "examples.csv").read_text().splitlines()[0]
    assert header.startswith("rank,row,path,split,given,suggested,flagged_by,seen")


def test_analyze_refuses_bad_data_in_one_line(tmp_path):
    from pergrad.cli import main

    (tmp_path / "table.csv").write_text("a,b,label\n1,2,x\n3,4,y\n")
    _tiny_classifier(tmp_path / "plain.keras", (2,), 2, compiled=False)
    cases = [
        (["--data", str(tmp_path / "table.csv")], "--data needs --model"),
        (["--model", str(tmp_path / "plain.keras"), "--data", str(tmp_path / "table.csv"),
          "--loss", "sparse_categorical_crossentropy"], "--label"),
        (["--model", str(tmp_path / "plain.keras"), "--data", str(tmp_path / "table.csv"),
          "--loss", "sparse_categorical_crossentropy", "--label", "c"], "no column 'c'"),
        (["--model", str(tmp_path / "plain.keras"), "--loss", "mse", "--from-logits"],
         "--from-logits does not apply"),
        (["--model", str(tmp_path / "plain.keras"), "--data", str(tmp_path / "table.csv"),
          "--label", "label"], "not compiled"),
        (["--model", str(tmp_path / "missing.keras")], "cannot load"),
    ]
    for args, message in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["analyze", *args, "--out", str(tmp_path / "out")])
        assert code == 2 and message in err.getvalue(), (args, err.getvalue())


def test_analyze_a_csv_table_with_named_classes(tmp_path):
    rng = np.random.default_rng(2)
    features = rng.normal(size=(40, 3))
    species = np.where(features[:, 0] > 0, "setosa", "virginica")
    lines = ["a,species,b,c"] + [f"{f[0]:.4f},{s},{f[1]:.4f},{f[2]:.4f}"
                                  for f, s in zip(features, species, strict=True)]
    (tmp_path / "table.csv").write_text("\n".join(lines) + "\n")
    _tiny_classifier(tmp_path / "model.keras", (3,), 2)
    out = tmp_path / "report"
    assert _in_process("analyze", "--model", str(tmp_path / "model.keras"), "--data",
                       str(tmp_path / "table.csv"), "--label", "species", "--epochs", "1",
                       "--batch-size", "8", "--test-fraction", "0", "--folds", "0",
                       "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 40 and "influence" not in summary  # nothing held out
    assert {s["given"] for s in summary["most_suspect"]} <= {"setosa", "virginica"}
    rows = (out / "examples.csv").read_text().splitlines()
    assert len(rows) == 41 and rows[0].startswith("rank,row,split,given,suggested")


# Runs each argv (a json list of argv lists) through pergrad.cli.main in one fresh interpreter
# and prints one JSON line per argv: the exit code, stderr, and the frameworks loaded so far.
_FRAMEWORKS = ("tensorflow", "keras", "jax", "torch")
_CHILD = """
import contextlib, io, json, sys
from pergrad.cli import main
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    loaded = sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
    print(json.dumps({"code": code, "err": err.getvalue(), "frameworks": loaded}))
"""


def test_analyze_file_errors_answer_before_any_framework_is_imported(tmp_path):
    """A missing or unreadable --model or --data, a .npz without x and y, a CSV without the
    named columns: one line, exit code 2, and neither TensorFlow, Keras, JAX nor PyTorch was
    imported (the check runs before them; only the loaded modules are asserted, not a time)."""
    import zipfile

    model = tmp_path / "model.keras"  # a zip archive passes the file check; never loaded here
    with zipfile.ZipFile(model, "w") as archive:
        archive.writestr("config.json", "{}")
    (tmp_path / "junk.keras").write_text("not a zip")
    (tmp_path / "model.pb").write_text("a TensorFlow graph")
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    np.save(tmp_path / "plain.npy", np.zeros(3))
    os.replace(tmp_path / "plain.npy", tmp_path / "plain.npz")
    (tmp_path / "table.csv").write_text("a,b,label\n1,2,x\n3,4,y\n")
    (tmp_path / "notes.txt").write_text("1,2\n")
    m, csv = str(model), str(tmp_path / "table.csv")
    cases = [
        (["--model", m, "--data", str(tmp_path / "missing.csv")],
         "cannot read the data " + str(tmp_path / "missing.csv") + ": no such file"),
        (["--model", str(tmp_path / "missing.keras")], "no such file"),
        (["--data", csv], "--data needs --model"),
        (["--model", str(tmp_path / "junk.keras")], "not a .keras file"),
        (["--model", str(tmp_path / "model.pb")], "saved as .keras"),
        (["--model", m, "--data", str(tmp_path / "other.npz")], "needs 'x' (inputs) and 'y'"),
        (["--model", m, "--data", str(tmp_path / "plain.npz")], "not a readable .npz file"),
        (["--model", m, "--data", csv], "--label COLUMN"),
        (["--model", m, "--data", csv, "--label", "c"], "no column 'c'"),
        (["--model", m, "--data", csv, "--label", "label", "--id", "c"], "no column 'c'"),
        (["--model", m, "--data", str(tmp_path / "notes.txt")], "give a .npz file"),
    ]
    argvs = [["analyze", *args, "--out", str(tmp_path / "out")] for args, _ in cases]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argvs),
                           json.dumps(_FRAMEWORKS)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.strip().splitlines()[-len(cases):]]
    for (args, message), result in zip(cases, results, strict=True):
        lines = result["err"].strip().splitlines()
        assert result["code"] == 2 and len(lines) == 1 and message in lines[0], (args, result)
        assert lines[0].startswith("pergrad analyze: error: "), (args, result)
        assert result["frameworks"] == [], (args, result)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.tensorflow_only(reason=(
    "subprocess test: launches its KERAS_BACKEND=jax child (jax blocked) once, from the "
    "TensorFlow run"))
def test_a_missing_backend_is_one_line_that_names_its_extra():
    """Keras imports its backend when first imported: with that backend not installed (here
    JAX, blocked in the child) the command says which extra installs it, in one line."""
    code = ("import sys; sys.modules['jax'] = None\n"
            "from pergrad.cli import main\n"
            "sys.exit(main(['analyze', '--epochs', '1', '--folds', '0']))\n")
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("pergrad")]
    assert lines == ["pergrad: error: jax is not installed (the Keras backend here is jax): "
                     "pip install 'pergrad[jax]', or set KERAS_BACKEND to an installed "
                     "backend"], done.stderr[-3000:]
