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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "all_backends: runs on every Keras backend (KERAS_BACKEND=jax runs only these)")


def pytest_collection_modifyitems(config, items):
    """On a backend other than TensorFlow only the tests marked ``all_backends`` run; the rest
    test TensorFlow-only parts (tf.distribute, the monitor, Jacobians, the CLI) and are
    deselected."""
    if keras.backend.backend() == "tensorflow":
        return
    selected = [item for item in items if item.get_closest_marker("all_backends")]
    deselected = [item for item in items if not item.get_closest_marker("all_backends")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
