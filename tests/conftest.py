import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if os.environ.get("KERAS_BACKEND") == "jax":
    # The float64 oracle comparisons need float64 arrays, which JAX gives only with x64 on.
    import jax

    jax.config.update("jax_enable_x64", True)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _set_floatx(dtype: str) -> None:
    # Keras caches the global dtype policy from floatx on first use: reset both.
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)


@pytest.fixture
def float64():
    """Build models in float64 for the 1e-6 oracle comparisons."""
    previous = keras.config.floatx()
    _set_floatx("float64")
    keras.utils.set_random_seed(1234)
    yield
    _set_floatx(previous)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# TensorFlow is an extra (pergrad[tensorflow]): on JAX and PyTorch it may be absent.
HAVE_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "all_backends: runs on every Keras backend (KERAS_BACKEND=jax runs only these)")
    config.addinivalue_line(
        "markers", "needs_tensorflow: an all_backends test that uses TensorFlow itself (tf.data, "
                   "TensorBoard's event files): skipped where TensorFlow is not installed")


# Where PyTorch support is tested (the engine, pergrad.jacobian): here a NotImplementedError is
# a failure like any other.
_TORCH_PORTED = ("test_engine_oracle.py", "test_backends.py", "test_rules_", "test_losses.py",
                 "test_aggregate_backends.py", "test_stats.py", "test_jacobian.py")
# The entry points documented as not ported to PyTorch: only their refusal becomes a skip.
_NOT_PORTED_TO_TORCH = ("pergrad.keras.fit_distributed",)


def pytest_collection_modifyitems(config, items):
    """On a backend other than TensorFlow only the tests marked ``all_backends`` run; the rest
    test TensorFlow-only parts (tf.distribute, TF-specific fast paths and graphs, the
    subprocess tests, which launch their JAX children from the TensorFlow run) and are
    deselected."""
    if not HAVE_TENSORFLOW:
        skip = pytest.mark.skip(reason="needs tensorflow (pip install pergrad[tensorflow])")
        for item in items:
            if item.get_closest_marker("needs_tensorflow"):
                item.add_marker(skip)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return
    selected = [item for item in items if item.get_closest_marker("all_backends")]
    deselected = [item for item in items if not item.get_closest_marker("all_backends")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On PyTorch, a marked test outside the ported modules that stops at a documented gap (a
    ``NotImplementedError`` naming the backend, as ``fit_distributed`` raises) is reported as
    skipped with that error as its reason; every other error fails."""
    outcome = yield
    report = outcome.get_result()
    if (keras.backend.backend() != "torch" or call.excinfo is None or report.when != "call"
            or item.path.name.startswith(_TORCH_PORTED)
            or not call.excinfo.errisinstance(NotImplementedError)):
        return
    message = str(call.excinfo.value)
    if "'torch'" in message and "docs/backends.md" in message \
            and message.startswith(_NOT_PORTED_TO_TORCH):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"Skipped: not ported to PyTorch: {message.splitlines()[0][:200]}")
