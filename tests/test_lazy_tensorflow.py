"""TensorFlow is imported on first use only: pergrad on JAX never loads it."""

from __future__ import annotations

import os
import pathlib
import sys

import keras
import pytest
from processes import run_bounded

from pergrad.backend.lazy import LazyModule

HERE = pathlib.Path(__file__).parent


def test_lazy_module_imports_on_first_attribute():
    json = LazyModule("json")
    assert json._module is None
    assert json.dumps([1]) == "[1]"
    assert json._module is sys.modules["json"]
    assert "loads" in dir(json)


def test_lazy_module_does_not_import_for_dunder_probes():
    missing = LazyModule("pergrad_no_such_module")
    assert not hasattr(missing, "__wrapped__")  # copy, pickle and inspect probe these
    with pytest.raises(ModuleNotFoundError):
        missing.anything  # noqa: B018


def test_a_missing_module_says_how_to_install_it(tmp_path, monkeypatch):
    missing = LazyModule("pergrad_no_such_module", install="pip install pergrad[no_such_extra]")
    with pytest.raises(ModuleNotFoundError, match=r"pip install pergrad\[no_such_extra\]") as err:
        missing.anything  # noqa: B018
    assert err.value.name == "pergrad_no_such_module"
    # A module that is there but misses one of its own imports: that error, unchanged.
    (tmp_path / "pergrad_broken_module.py").write_text("import pergrad_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = LazyModule("pergrad_broken_module", install="pip install pergrad[no_such_extra]")
    with pytest.raises(ModuleNotFoundError,
                       match="^No module named 'pergrad_no_such_dependency'$"):
        broken.anything  # noqa: B018


@pytest.mark.only_on("jax", "torch", reason=(
    "checks that the JAX and PyTorch workflows never import TensorFlow: on TensorFlow there is "
    "nothing to check"))
@pytest.mark.slow(reason="runs the workflows in a fresh process: ~20 s")
def test_workflows_on_this_backend_never_import_tensorflow():
    """In a fresh process on this suite's backend (JAX or PyTorch): PerExample, the
    aggregators, PerExampleModel.fit with dp_mean and the privacy callback; on JAX also stats,
    the monitor, accounting and Jacobians (tests/without_tensorflow.py)."""
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    [result] = run_bounded([[sys.executable, str(HERE / "without_tensorflow.py")]],
                           timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "tensorflow not imported" in result.stdout
