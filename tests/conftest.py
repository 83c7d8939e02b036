import importlib.util
import os
import shutil
import tempfile
import uuid

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _jax_cache_dir(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"pergrad-tests-jax-cache-{run_id}")


if os.environ.get("KERAS_BACKEND") == "jax":
    # The float64 oracle comparisons need float64 arrays, which JAX gives only with x64 on.
    import jax

    jax.config.update("jax_enable_x64", True)
    # Many tests compile the same programs (a zoo model's engine, the oracle's loop): JAX's
    # persistent compilation cache, in a folder of this run's own (pytest-xdist's run id, set by
    # pytest_configure below; this process's id without xdist) that both workers share and
    # the run removes at its end, compiles each once.
    jax.config.update("jax_compilation_cache_dir", _jax_cache_dir(
        os.environ.get("PYTEST_XDIST_TESTRUNUID", f"pid{os.getpid()}")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

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
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput") \
            and getattr(config.option, "testrunuid", "") is None:
        # The run id pytest-xdist hands its workers (PYTEST_XDIST_TESTRUNUID): chosen here so
        # that pytest_unconfigure knows which JAX cache folder to remove.
        config.option.testrunuid = uuid.uuid4().hex
    # One worker may read a cache entry while the other is still writing it: JAX then warns
    # and compiles the program itself, the same result.
    config.addinivalue_line(
        "filterwarnings", "ignore:Error reading persistent compilation cache entry:UserWarning")
    config.addinivalue_line(
        "markers", "tensorflow_only(reason): runs on TensorFlow only, deselected on JAX and "
                   "PyTorch; reason (required, non-empty) says what TensorFlow-only thing it "
                   "exercises, or starts 'not yet run on JAX/PyTorch:' and says what it would "
                   "need")
    config.addinivalue_line(
        "markers", "only_on(*backends, reason): runs on the named Keras backends only, "
                   "deselected on the others; reason (required) says why the others cannot "
                   "run it")
    config.addinivalue_line(
        "markers", "slow(reason): a check that starts processes (docs pages, several workers, "
                   "benchmark runs) or takes over ~15 s of one worker; left out of the default "
                   "run (pyproject.toml: -m 'not slow'), run by `pytest -m slow` and by CI on "
                   "every backend; reason (required) says what makes it slow")
    config.addinivalue_line(
        "markers", "needs_tensorflow: a test run on every backend that uses TensorFlow itself "
                   "(tf.data, TensorBoard's event files): skipped where TensorFlow is not "
                   "installed")


def pytest_unconfigure(config):
    if hasattr(config, "workerinput"):
        return  # the controller (or the only process) removes the run's JAX cache folder
    run_id = getattr(config.option, "testrunuid", None) or f"pid{os.getpid()}"
    shutil.rmtree(_jax_cache_dir(run_id), ignore_errors=True)


_BAD_MARKER = pytest.StashKey[str]()
#: Modules whose tests start processes and take a minute or more: run first.
LONG_TESTS_FIRST = frozenset({
    "test_docs.py", "test_multi_worker.py", "test_keras_distributed.py",
    "test_jax_multi_process.py", "test_jax_distribution.py", "test_cli.py",
    "test_analyze_rows.py", "test_lazy_tensorflow.py"})


#: The float64-oracle grids: many parametrized cases of the same backend-neutral rule math,
#: each compiled anew. The TensorFlow and JAX runs each take every other case of a test, in turn
#: (TensorFlow the even ones, JAX the odd ones; a test of one case runs on both), PyTorch's run
#: (the shortest) every case: each case runs in CI on PyTorch and on TensorFlow or JAX.
#: ``PERGRAD_FULL_TESTS=1`` runs every case on every backend.
GRID_MODULES = frozenset({
    "test_engine_oracle.py", "test_rules_conv.py", "test_rules_conv_transpose.py",
    "test_rules_depthwise.py", "test_rules_keras_hub.py", "test_rules_lora.py",
    "test_rules_recurrent.py"})
_GRID_HALF = {"tensorflow": 0, "jax": 1}


def _off_grid_half(items, backend: str) -> set[str]:
    """The node ids of the grid cases this backend's run leaves to the others
    (:data:`GRID_MODULES`), counted in collection order over every collected case."""
    half = _GRID_HALF.get(backend)
    if half is None or os.environ.get("PERGRAD_FULL_TESTS") == "1":
        return set()
    cases: dict[tuple, list[str]] = {}
    for item in items:
        if item.path.name in GRID_MODULES and hasattr(item, "callspec"):
            key = (item.path.name, getattr(item.cls, "__name__", None), item.originalname)
            cases.setdefault(key, []).append(item.nodeid)
    return {nodeid for ids in cases.values() if len(ids) > 1
            for index, nodeid in enumerate(ids) if index % 2 != half}


def _checked_reason(item, marker) -> None:
    """A usage error unless ``marker`` has a non-empty ``reason`` keyword."""
    reason = marker.kwargs.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.{marker.name} needs reason=\"...\" (a non-empty "
            f"string, as a keyword) saying why the test cannot run on the other backends; got "
            f"args={marker.args!r}, kwargs={marker.kwargs!r}")


def _runs_on(item, backend: str) -> bool:
    """Whether ``item`` runs on ``backend``: not where its ``tensorflow_only`` or ``only_on``
    markers (its own, its class's or its module's; a test's own marker may give a more
    specific reason than its module's) exclude it. A marker without a non-empty ``reason``
    keyword is a usage error, on every backend."""
    runs = True
    for marker in item.iter_markers("tensorflow_only"):
        _checked_reason(item, marker)
        if marker.args:
            raise pytest.UsageError(f"{item.nodeid}: tensorflow_only takes reason= only")
        runs = runs and backend == "tensorflow"
    for marker in item.iter_markers("only_on"):
        _checked_reason(item, marker)
        unknown = set(marker.args) - {"tensorflow", "jax", "torch"}
        if not marker.args or unknown:
            raise pytest.UsageError(f"{item.nodeid}: only_on names Keras backends "
                                    f"(tensorflow, jax, torch), got {marker.args!r}")
        runs = runs and backend in marker.args
    for marker in item.iter_markers("slow"):
        _checked_reason(item, marker)
    return runs


# Where PyTorch support is tested (the engine, pergrad.jacobian): here a NotImplementedError is
# a failure like any other.
_TORCH_PORTED = ("test_engine_oracle.py", "test_backends.py", "test_rules_", "test_losses.py",
                 "test_aggregate_backends.py", "test_stats.py", "test_jacobian.py")
# The entry points documented as not ported to PyTorch: only their refusal becomes a skip.
_NOT_PORTED_TO_TORCH = ("pergrad.keras.fit_distributed",)


def pytest_collection_modifyitems(config, items):
    """Every test runs on every Keras backend, except those marked ``tensorflow_only(reason=...)``
    (tf.distribute, tf.function graphs and retracing, TF-specific fast paths, and the tests not
    yet run elsewhere), deselected on JAX and PyTorch, and those marked
    ``only_on(*backends, reason=...)``, deselected on the backends not named."""
    if not HAVE_TENSORFLOW:
        skip = pytest.mark.skip(reason="needs tensorflow (pip install pergrad[tensorflow])")
        for item in items:
            if item.get_closest_marker("needs_tensorflow"):
                item.add_marker(skip)
    backend = keras.backend.backend()
    off_half = _off_grid_half(items, backend)
    runs = []
    for item in items:  # every marker's reason is checked, on every backend
        try:
            runs.append(_runs_on(item, backend))
        except pytest.UsageError as error:
            if not hasattr(config, "workerinput"):
                raise
            # A pytest-xdist worker's UsageError ends the run as an INTERNALERROR without its
            # message: there the test is kept (on every backend) and fails with it instead.
            item.stash[_BAD_MARKER] = str(error)
            runs.append(True)
        if item.nodeid in off_half:
            runs[-1] = False
    selected = [item for item, run in zip(items, runs, strict=True) if run]
    deselected = [item for item, run in zip(items, runs, strict=True) if not run]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    # The modules of long tests (subprocesses: docs pages, CLI runs, several processes) first,
    # so that pytest-xdist spreads them over its workers at the start instead of leaving one
    # to finish them alone at the end; the order within each group is kept.
    items.sort(key=lambda item: item.path.name not in LONG_TESTS_FIRST)


def pytest_runtest_setup(item):
    if _BAD_MARKER in item.stash:
        pytest.fail(item.stash[_BAD_MARKER], pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On PyTorch, a test outside the ported modules that stops at a documented gap (a
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
