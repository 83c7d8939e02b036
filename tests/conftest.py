import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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
