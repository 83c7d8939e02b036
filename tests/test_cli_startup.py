"""The command line starts without a deep-learning framework where it needs none.

``pergrad privacy`` (pure accounting with ``dp_accounting``), every ``--help`` and argument errors
must not import TensorFlow, Keras, JAX or PyTorch: each is a fresh interpreter (a subprocess),
whose modules are listed after the command. Only which modules are loaded is checked, never how
long anything takes. Backend-neutral: no backend is imported, in the child or for the check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

FRAMEWORKS = ("tensorflow", "keras", "jax", "torch")

# Runs argv (json) through pergrad.cli.main in a fresh interpreter, then prints one JSON line:
# the exit code, what was printed, and the frameworks among the loaded modules.
_CHILD = """
import contextlib, io, json, sys
from pergrad.cli import main
argv = json.loads(sys.argv[1])
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
frameworks = sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                  "frameworks": frameworks}))
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=120)


def _cli(argv: list[str]) -> dict:
    done = _python(_CHILD, json.dumps(argv), json.dumps(FRAMEWORKS))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


MNIST = ["--num-examples", "60000", "--batch-size", "150", "--epochs", "15", "--delta", "1e-5"]


def test_privacy_epsilon_imports_no_framework():
    result = _cli(["privacy", *MNIST, "--noise-multiplier", "1.3"])
    assert result["code"] == 0, result["err"]
    assert result["out"].splitlines()[0] == "epsilon: 0.724223"
    assert result["frameworks"] == []


def test_privacy_target_epsilon_imports_no_framework():
    result = _cli(["privacy", "--num-examples", "1000", "--batch-size", "100", "--epochs", "2",
                   "--delta", "1e-5", "--target-epsilon", "3", "--accountant", "pld"])
    assert result["code"] == 0, result["err"]
    assert result["out"].startswith("noise_multiplier: ")
    assert result["frameworks"] == []


@pytest.mark.parametrize("argv, code, stream, text", [
    ([], 2, "out", "COMMAND"),
    (["--help"], 0, "out", "COMMAND"),
    (["analyze", "--help"], 0, "out", "--model"),
    (["bench", "--help"], 0, "out", "--suites"),
    (["privacy", "--help"], 0, "out", "--noise-multiplier"),
    (["no-such-command"], 2, "err", "invalid choice"),
    (["privacy", "--num-examples", "0"], 2, "err", "must be a positive integer"),
    (["privacy", *MNIST], 2, "err", "one of the arguments"),
    (["privacy", "--num-examples", "10", "--batch-size", "20", "--epochs", "1", "--delta",
      "1e-5", "--noise-multiplier", "1"], 2, "err", "must not exceed"),
    (["bench", "--batch-sizes", "x"], 2, "err", "comma-separated"),
    (["analyze", "--epochs", "zero"], 2, "err", "positive integer"),
])
def test_help_and_argument_errors_import_no_framework(argv, code, stream, text):
    result = _cli(argv)
    assert result["code"] == code, result
    assert text in result[stream], result
    assert result["frameworks"] == []


def test_building_the_parser_imports_no_framework():
    code = ("import json, sys\n"
            "import pergrad, pergrad.cli, pergrad.privacy\n"
            "pergrad.cli.build_parser().format_help()\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:]))))")
    done = _python(code, *FRAMEWORKS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_accounting_through_the_package_imports_no_framework():
    code = ("import json, sys\n"
            "import pergrad\n"
            "eps = pergrad.privacy.epsilon(60000, 150, 1.3, 15, 1e-5)\n"
            "steps = pergrad.privacy.dp_sgd_steps(60000, 150, 15)\n"
            "print(json.dumps([eps, steps, "
            "sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:]))]))")
    done = _python(code, *FRAMEWORKS)
    assert done.returncode == 0, done.stderr[-3000:]
    eps, steps, frameworks = json.loads(done.stdout.strip().splitlines()[-1])
    assert eps == pytest.approx(0.724223, abs=5e-7)
    assert steps == 6000
    assert frameworks == []


def test_every_public_privacy_name_resolves():
    import pergrad.privacy
    from pergrad.privacy import (  # noqa: F401  (the imports are the test)
        accounting,
        dp_sgd_steps,
        epsilon,
        epsilon_for_steps,
        max_steps_for,
        noise_multiplier_for,
        poisson_batches,
        sampling,
    )
    from pergrad.privacy import sampling as sampling_module

    for name in pergrad.privacy.__all__:
        assert callable(getattr(pergrad.privacy, name)), name
        assert name in dir(pergrad.privacy), name
    assert poisson_batches is sampling_module.poisson_batches
    assert pergrad.privacy.sampling is sampling_module
    assert epsilon is accounting.epsilon
    with pytest.raises(AttributeError, match="no_such_name"):
        pergrad.privacy.no_such_name  # noqa: B018
