"""Tests for pergrad.privacy (accounting, Poisson sampling), PrivacyCallback and `pergrad privacy`."""

from __future__ import annotations

import argparse
import logging
import math

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import optimize, stats

import pergrad
from pergrad.cli.privacy import add_parser, run
from pergrad.keras.privacy_callback import PrivacyCallback
from pergrad.privacy import (
    dp_sgd_steps,
    epsilon,
    epsilon_for_steps,
    max_steps_for,
    noise_multiplier_for,
    poisson_batches,
)
from pergrad.privacy.accounting import MAX_STEPS_SEARCHED, _quiet_accountant
from pergrad.privacy.sampling import default_max_batch_size

tf = pytest.importorskip("tensorflow", reason="needs tensorflow (pip install pergrad[tensorflow])")
TF_DATA = pytest.mark.tensorflow_only(reason=(
    "poisson_batches builds a tf.data pipeline (TensorFlow whatever the Keras backend), checked "
    "here through its element specs, cardinality, tf.errors or a tf.function"))
NOT_YET_FIT = pytest.mark.tensorflow_only(reason=(
    "not yet run on JAX/PyTorch: PrivacyCallback on Keras fit() fed by poisson_batches' tf.data "
    "pipeline; would need needs_tensorflow and a run of the JAX and PyTorch trainers on tf.data "
    "input"))

MNIST = dict(num_examples=60000, batch_size=150, epochs=15, delta=1e-5)


def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact epsilon of one Gaussian mechanism (sensitivity 1), Balle & Wang 2018, Theorem 8.

    delta(eps) = Phi(1/(2 sigma) - eps sigma) - exp(eps) Phi(-1/(2 sigma) - eps sigma).
    """

    def gap(eps: float) -> float:
        a = stats.norm.cdf(0.5 / sigma - eps * sigma)
        b = math.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma)
        return a - b - delta

    return optimize.brentq(gap, 0.0, 100.0, xtol=1e-12)


def dp_sgd_event(q: float, sigma: float, steps: int) -> dp_accounting.DpEvent:
    """The DP-SGD event, built here independently of pergrad."""
    sampled = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    return dp_accounting.SelfComposedDpEvent(sampled, steps)


def rdp_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """Epsilon from a fresh ``dp_accounting`` RDP accountant, without going through pergrad."""
    accountant = RdpAccountant()
    return accountant.compose(dp_sgd_event(q, sigma, steps)).get_epsilon(delta)


# --------------------------------------------------------------------------- accounting


def test_known_value_rdp():
    # q = 0.0025, 6000 steps, sigma 1.3: the value TensorFlow Privacy's RDP accounting reports.
    assert epsilon(noise_multiplier=1.3, **MNIST) == pytest.approx(0.7242, abs=5e-5)


def test_pld_is_tighter_than_rdp_and_close():
    rdp = epsilon(noise_multiplier=1.3, **MNIST, accountant="rdp")
    pld = epsilon(noise_multiplier=1.3, **MNIST, accountant="pld")
    assert pld < rdp
    assert pld > 0.8 * rdp
    assert pld == pytest.approx(0.6401, abs=5e-4)


@pytest.mark.parametrize("sigma, steps", [(1.0, 1), (2.0, 1), (5.0, 25)])
def test_full_batch_gaussian_matches_closed_form(sigma, steps):
    # With q = 1 every step is a Gaussian mechanism, and k of them compose exactly into one
    # Gaussian mechanism with noise sigma / sqrt(k). PLD is (numerically) exact, RDP an upper bound.
    exact = exact_gaussian_epsilon(sigma / math.sqrt(steps), 1e-5)
    pld = epsilon_for_steps(1.0, sigma, steps, 1e-5, accountant="pld")
    rdp = epsilon_for_steps(1.0, sigma, steps, 1e-5, accountant="rdp")
    assert pld == pytest.approx(exact, rel=2e-3)
    assert pld >= exact - 1e-9  # the PLD accountant discretizes pessimistically
    assert rdp >= exact


def test_step_count_convention():
    # steps = floor(E) * ceil(N / B) + ceil(frac(E) * N / B).
    # 0.5 epochs of 1000 at 300: ceil(166.7 / 100) = 2 steps; 3 epochs: 3 * ceil(3.33) = 12 steps.
    assert dp_sgd_steps(1000, 300, 0.5) == 2
    assert dp_sgd_steps(1000, 300, 3) == 12
    assert epsilon(1000, 300, 1.1, 0.5, 1e-5) == epsilon_for_steps(0.3, 1.1, 2, 1e-5)
    assert epsilon(1000, 300, 1.1, 3, 1e-5) == epsilon_for_steps(0.3, 1.1, 12, 1e-5)
    assert epsilon(1000, 300, 1.1, 3, 1e-5) != epsilon_for_steps(0.3, 1.1, 10, 1e-5)


@pytest.mark.parametrize(
    "n, b, epochs, steps",
    [
        (1797, 64, 5, 145),  # 5 * 29, where ceil(5 * 1797 / 64) would be 141
        (1797, 64, 2.5, 73),  # 2 * 29 + ceil(0.5 * 1797 / 64) = 58 + 15
        (1797, 64, 0.5, 15),
        (60000, 150, 15, 6000),
        (30, 1, 0.1, 3),  # 0.1 is read as one tenth, not the float just above it
        (100, 7, 1e-9, 1),  # any positive fraction of an epoch is at least one step
        (10, 10, 3, 3),
    ],
)
def test_dp_sgd_steps_values(n, b, epochs, steps):
    assert dp_sgd_steps(n, b, epochs) == steps
    expected = rdp_epsilon(b / n, 1.1, steps, 1e-5)
    assert epsilon(n, b, 1.1, epochs, 1e-5) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n, b", [(60000, 150), (1000, 50), (64, 32), (12, 3)])
@pytest.mark.parametrize("epochs", [1, 2, 7, 0.5, 2.25])
def test_dp_sgd_steps_is_tf_privacy_when_batch_divides(n, b, epochs):
    assert dp_sgd_steps(n, b, epochs) == math.ceil(epochs * n / b)


def test_epsilon_counts_whole_epochs_of_batches():
    # 5 epochs of 1797 examples at batch 64 are 5 * ceil(1797 / 64) = 145 steps, as many as
    # poisson_batches yields and PrivacyCallback counts, not TF Privacy's ceil(5 * 1797 / 64) = 141.
    assert epsilon(1797, 64, 1.1, 5, 1e-5) == pytest.approx(rdp_epsilon(64 / 1797, 1.1, 145, 1e-5))
    assert epsilon(1797, 64, 1.1, 5, 1e-5) > rdp_epsilon(64 / 1797, 1.1, 141, 1e-5)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_monotone_in_sigma_and_epochs(accountant):
    setting = dict(num_examples=10000, batch_size=100, delta=1e-5, accountant=accountant)
    by_sigma = [epsilon(noise_multiplier=s, epochs=5, **setting) for s in (0.8, 1.0, 1.5, 3.0)]
    by_epochs = [epsilon(noise_multiplier=1.0, epochs=e, **setting) for e in (1, 2, 5, 10)]
    assert (np.diff(by_sigma) < 0).all()
    assert (np.diff(by_epochs) > 0).all()


def test_edge_values():
    assert epsilon_for_steps(0.01, 0.0, 10, 1e-5) == math.inf
    assert epsilon(100, 10, 0.0, 1, 1e-5, accountant="pld") == math.inf
    assert epsilon_for_steps(0.01, 1.0, 0, 1e-5) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_examples=100, batch_size=101), "batch_size"),
        (dict(num_examples=0, batch_size=1), "num_examples"),
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(epochs=0), "epochs"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(accountant="gdp"), "accountant"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(num_examples=100, batch_size=10, noise_multiplier=1.0, epochs=1, delta=1e-5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        epsilon(**args)


def test_calibration_round_trip_rdp():
    sigma = noise_multiplier_for(1.0, **MNIST)
    eps = epsilon(noise_multiplier=sigma, **MNIST)
    assert eps <= 1.0
    assert eps == pytest.approx(1.0, abs=1e-4)
    # It is the smallest such sigma: a little less noise overspends.
    assert epsilon(noise_multiplier=sigma - 1e-3, **MNIST) > 1.0
    # Monotone: a bigger budget needs less noise.
    sigmas = [noise_multiplier_for(t, **MNIST) for t in (0.5, 1.0, 2.0, 8.0)]
    assert (np.diff(sigmas) < 0).all()
    assert sigmas[1] == pytest.approx(sigma)


def test_calibration_round_trip_pld():
    setting = dict(num_examples=1000, batch_size=50, epochs=2, delta=1e-5)
    sigma_pld = noise_multiplier_for(2.0, **setting, accountant="pld")
    sigma_rdp = noise_multiplier_for(2.0, **setting, accountant="rdp")
    eps = epsilon(noise_multiplier=sigma_pld, **setting, accountant="pld")
    assert eps <= 2.0
    assert eps == pytest.approx(2.0, abs=1e-3)
    assert sigma_pld < sigma_rdp  # the tighter accountant needs less noise


def test_calibration_errors():
    with pytest.raises(ValueError, match="target_epsilon"):
        noise_multiplier_for(0.0, **MNIST)
    with pytest.raises(ValueError, match="too large"):
        noise_multiplier_for(1e9, **MNIST)


# --------------------------------------------------------------------------- sampling


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = {"a": rng.normal(size=(n, 3)).astype("float32"), "b": rng.integers(0, 9, size=(n, 2))}
    y = (rng.normal(size=(n, 1)).astype("float32"), rng.integers(0, 5, size=(n,)))
    w = rng.uniform(0.5, 2.0, size=(n,)).astype("float32")
    return x, y, w


@TF_DATA
def test_batches_are_static_padded_and_index_back():
    x, y, w = _data()
    ds = poisson_batches(
        x, y, batch_size=8, sample_weight=w, seed=3, epochs=2, max_batch_size=25, with_indices=True
    )
    assert int(ds.cardinality()) == 2 * math.ceil(40 / 8)
    for spec in tf.nest.flatten(ds.element_spec):
        assert spec.shape.is_fully_defined() and spec.shape[0] == 25
    n_batches = 0
    for xb, yb, wb, ib in ds.as_numpy_iterator():
        n_batches += 1
        real = ib >= 0
        k = int(real.sum())
        assert real[:k].all() and not real[k:].any()  # real rows first, then padding
        idx = ib[:k]
        assert len(set(idx)) == k  # no example twice in a batch
        np.testing.assert_array_equal(xb["a"][:k], x["a"][idx])
        np.testing.assert_array_equal(xb["b"][:k], x["b"][idx])
        np.testing.assert_array_equal(yb[0][:k], y[0][idx])
        np.testing.assert_array_equal(yb[1][:k], y[1][idx])
        np.testing.assert_array_equal(wb[:k], w[idx])
        assert (wb[k:] == 0).all()
        assert (xb["a"][k:] == 0).all() and (yb[1][k:] == 0).all()
    assert n_batches == 10


@TF_DATA
def test_default_weights_and_no_labels():
    x = np.arange(30, dtype="float32").reshape(10, 3)
    xb, yb, wb = next(iter(poisson_batches(x, batch_size=5, seed=0, max_batch_size=10)))
    assert yb is None
    k = int(tf.reduce_sum(wb))
    np.testing.assert_array_equal(wb.numpy(), [1.0] * k + [0.0] * (10 - k))


@TF_DATA
def test_inclusion_is_poisson():
    n, b, steps_per_epoch, epochs = 200, 20, 10, 50  # q = 0.1, 500 steps
    q = b / n
    x = np.arange(n, dtype="float32")
    ds = poisson_batches(x, batch_size=b, seed=11, epochs=epochs, with_indices=True)
    counts = np.zeros(n, dtype=int)
    sizes = []
    for *_, ib in ds:  # not as_numpy_iterator: TensorFlow <= 2.19 cannot give the None y slot
        ib = ib.numpy()
        idx = ib[ib >= 0]
        counts[idx] += 1
        sizes.append(len(idx))
    steps = steps_per_epoch * epochs
    assert len(sizes) == steps
    # Each example is included Binomial(steps, q) times; bound every one (Bonferroni, 1e-6 total).
    lo = stats.binom.ppf(1e-6 / (2 * n), steps, q)
    hi = stats.binom.isf(1e-6 / (2 * n), steps, q)
    assert counts.min() >= lo and counts.max() <= hi
    # Total inclusions ~ Binomial(n * steps, q).
    total = counts.sum()
    assert abs(total - n * steps * q) < 5 * math.sqrt(n * steps * q * (1 - q))
    # Batch sizes vary like Binomial(n, q) (variance n q (1 - q) = 18), unlike fixed-size batches.
    var = np.var(sizes, ddof=1)
    chi2 = (steps - 1) * var / (n * q * (1 - q))
    assert stats.chi2.ppf(1e-6, steps - 1) < chi2 < stats.chi2.isf(1e-6, steps - 1)


@TF_DATA
def test_deterministic_with_seed_and_fresh_each_pass():
    x, y, _ = _data()

    def passes(seed):
        ds = poisson_batches(x, y, batch_size=8, seed=seed, with_indices=True)
        return [[ib.tolist() for *_, ib in ds.as_numpy_iterator()] for _ in range(2)]

    first, again, other = passes(5), passes(5), passes(6)
    assert first == again  # same seed: same batches, pass for pass
    assert first[0] != first[1]  # a new pass (a new Keras epoch) draws new batches
    assert first != other


@TF_DATA
def test_overflow_raises_instead_of_truncating():
    x = np.zeros((100, 2), "float32")
    ds = poisson_batches(x, batch_size=50, seed=0, max_batch_size=10)
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_batch_size=10"):
        for _ in ds:
            pass


def test_default_max_batch_size():
    m = default_max_batch_size(60000, 0.0025, steps=400)
    assert m == 227
    assert stats.binom.sf(m, 60000, 0.0025) <= 1e-6 / 400 < stats.binom.sf(m - 1, 60000, 0.0025)
    assert default_max_batch_size(10, 0.3) == 10  # never above N


@TF_DATA
def test_sampling_bad_arguments():
    x = np.zeros((10, 2), "float32")
    with pytest.raises(ValueError, match="num_examples"):
        poisson_batches(x, batch_size=2, num_examples=11)
    with pytest.raises(ValueError, match="batch_size"):
        poisson_batches(x, batch_size=11)
    with pytest.raises(ValueError, match="same number of examples"):
        poisson_batches(x, np.zeros(9), batch_size=2)
    with pytest.raises(ValueError, match="sample_weight"):
        poisson_batches(x, batch_size=2, sample_weight=np.ones(9))


@TF_DATA
def test_no_retracing_and_padding_contributes_nothing():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 4)).astype("float32")
    y = rng.normal(size=(50,)).astype("float32")
    wvec = tf.constant(rng.normal(size=(4,)).astype("float32"))
    traces = []

    @tf.function
    def weighted_grad(xb, yb, wb):
        traces.append(1)
        with tf.GradientTape() as tape:
            tape.watch(wvec)
            loss = tf.reduce_sum(wb * (tf.linalg.matvec(xb, wvec) - yb) ** 2)
        return tape.gradient(loss, wvec)

    for xb, yb, wb, ib in poisson_batches(x, y, batch_size=10, seed=2, epochs=3, with_indices=True):
        idx = ib.numpy()[ib.numpy() >= 0]
        expected = 2 * x[idx].T @ (x[idx] @ wvec.numpy() - y[idx])
        np.testing.assert_allclose(
            weighted_grad(xb, yb, wb).numpy(), expected, rtol=1e-4, atol=1e-5
        )
    assert len(traces) == 1


# --------------------------------------------------------------------------- callback


def _tiny_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


@NOT_YET_FIT
def test_privacy_callback_history():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 3)).astype("float32")
    y = rng.normal(size=(128, 1)).astype("float32")
    ds = poisson_batches(x, y, batch_size=8, seed=0)  # 16 steps per epoch
    cb = PrivacyCallback(num_examples=128, batch_size=8, noise_multiplier=1.5, delta=1e-5)
    history = _tiny_model().fit(ds, epochs=2, callbacks=[cb], verbose=0, shuffle=False)
    eps = history.history["epsilon"]
    assert len(eps) == 2 and eps[0] < eps[1]
    assert cb.steps == 32
    assert eps[0] == epsilon_for_steps(8 / 128, 1.5, 16, 1e-5)
    assert eps[1] == epsilon_for_steps(8 / 128, 1.5, 32, 1e-5)
    assert eps[1] == pytest.approx(epsilon(128, 8, 1.5, 2, 1e-5))


@NOT_YET_FIT
def test_privacy_callback_counts_actual_steps():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 3)).astype("float32")
    y = rng.normal(size=(128, 1)).astype("float32")
    ds = poisson_batches(x, y, batch_size=8, seed=0).repeat()
    cb = PrivacyCallback(128, 8, 1.5, 1e-5, accountant="pld")
    model = _tiny_model()
    model.fit(ds, epochs=2, steps_per_epoch=3, callbacks=[cb], verbose=0, shuffle=False)
    assert cb.steps == 6
    history = model.fit(ds, epochs=1, steps_per_epoch=5, callbacks=[cb], verbose=0, shuffle=False)
    assert cb.steps == 11  # a second fit on the same data keeps spending
    assert history.history["epsilon"] == [epsilon_for_steps(8 / 128, 1.5, 11, 1e-5, "pld")]


def test_privacy_callback_validates_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        PrivacyCallback(10, 20, 1.0, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        PrivacyCallback(10, 2, 1.0, 2.0)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyCallback(10, 2, 1.0, 1e-5, accountant="moments")


# --------------------------------------------------------------------------- CLI


def _cli(argv):
    parser = argparse.ArgumentParser(prog="pergrad")
    add_parser(parser.add_subparsers(dest="command"))
    return run(parser.parse_args(["privacy", *argv]))


BASE = ["--num-examples", "60000", "--batch-size", "150", "--epochs", "15", "--delta", "1e-5"]


def test_cli_epsilon(capsys):
    assert _cli([*BASE, "--noise-multiplier", "1.3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "epsilon: 0.724223"
    assert "steps = 15 * ceil(60000 / 150) = 6000" in out
    assert _cli([*BASE, "--noise-multiplier", "1.3", "--accountant", "pld"]) == 0
    assert capsys.readouterr().out.startswith("epsilon: 0.640")
    assert _cli([*BASE, "--noise-multiplier", "0"]) == 0
    assert capsys.readouterr().out.startswith("epsilon: inf")


def test_cli_target_epsilon(capsys):
    assert _cli([*BASE, "--target-epsilon", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    name, value = first.split(": ")
    assert name == "noise_multiplier"
    sigma = float(value)
    # The printed (rounded) value itself meets the target.
    assert 0.999 < epsilon(noise_multiplier=sigma, **MNIST) <= 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*BASE[2:], "--num-examples", "-5", "--noise-multiplier", "1"], "--num-examples"),
        ([*BASE[2:], "--num-examples", "100", "--noise-multiplier", "1"], "must not exceed"),
        ([*BASE[:-1], "1.5", "--noise-multiplier", "1"], "--delta"),
        ([*BASE[:-1], "0", "--noise-multiplier", "1"], "--delta"),
        ([*BASE, "--noise-multiplier", "-1"], "--noise-multiplier"),
        ([*BASE, "--noise-multiplier", "1", "--target-epsilon", "1"], "not allowed with"),
        (BASE, "one of the arguments"),
        ([*BASE, "--noise-multiplier", "1", "--accountant", "moments"], "--accountant"),
        ([*BASE, "--target-epsilon", "1e9"], "too large"),
    ],
)
def test_cli_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        _cli(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]


def test_cli_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        _cli(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in [
        "--num-examples",
        "--batch-size",
        "--epochs",
        "--delta",
        "--noise-multiplier",
        "--target-epsilon",
        "--accountant",
    ]:
        assert option in text


@pytest.mark.parametrize(
    "epochs, formula",
    [
        ("5", "steps = 5 * ceil(1797 / 64) = 145"),
        ("2.5", "steps = 2 * ceil(1797 / 64) + ceil(0.5 * 1797 / 64) = 73"),
        ("0.5", "steps = ceil(0.5 * 1797 / 64) = 15"),
    ],
)
def test_cli_prints_the_step_count_behind_epsilon(epochs, formula, capsys):
    argv = ["--num-examples", "1797", "--batch-size", "64", "--epochs", epochs, "--delta", "1e-5"]
    assert _cli([*argv, "--noise-multiplier", "1.1"]) == 0
    out = capsys.readouterr().out
    assert formula in out
    steps = int(formula.rsplit("= ", 1)[1])
    assert out.splitlines()[0] == f"epsilon: {rdp_epsilon(64 / 1797, 1.1, steps, 1e-5):.6g}"


# --------------------------------------------------------------------------- one step count


@pytest.mark.parametrize(
    "n, b, epochs",
    [(1797, 64, 5), (1797, 64, 2.5), (1797, 64, 0.3), (100, 7, 3), (100, 7, 1.75), (50, 50, 2)],
)
@TF_DATA
def test_poisson_batches_yields_dp_sgd_steps_batches(n, b, epochs):
    x = np.zeros((n, 1), "float32")
    ds = poisson_batches(x, batch_size=b, seed=0, epochs=epochs)
    assert int(ds.cardinality()) == dp_sgd_steps(n, b, epochs)
    assert sum(1 for _ in ds) == dp_sgd_steps(n, b, epochs)


def _regression_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


@NOT_YET_FIT
def test_callback_after_fit_equals_epsilon_for_whole_epochs():
    # The example: 5 epochs over poisson_batches(batch_size=64) on N = 1797.
    n, b, sigma, delta = 1797, 64, 1.1, 1e-5
    x, y = _regression_data(n)
    cb = PrivacyCallback(n, b, sigma, delta)
    model = _tiny_model()
    model.fit(poisson_batches(x, y, batch_size=b, seed=0), epochs=5, callbacks=[cb], verbose=0, shuffle=False)
    assert cb.steps == int(model.optimizer.iterations) == dp_sgd_steps(n, b, 5) == 145
    assert cb.epsilon == epsilon(n, b, sigma, 5, delta)
    assert cb.epsilon == pytest.approx(rdp_epsilon(b / n, sigma, 145, delta), rel=1e-12)


@NOT_YET_FIT
def test_callback_after_dp_fit_equals_epsilon_for_fractional_epochs():
    n, b, sigma, delta, epochs = 300, 32, 1.1, 1e-5, 2.5
    x, y = _regression_data(n)
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model = pergrad.keras.PerExampleModel(
        inner, aggregator=pergrad.aggregate.dp_mean(1.0, sigma, expected_batch_size=b, seed=0)
    )
    model.compile(optimizer="sgd", loss="mse")
    cb = PrivacyCallback(n, b, sigma, delta)
    ds = poisson_batches(x, y, batch_size=b, seed=0, epochs=epochs)
    model.fit(ds, epochs=1, callbacks=[cb], verbose=0, shuffle=False)
    steps = 2 * math.ceil(300 / 32) + math.ceil(0.5 * 300 / 32)  # 20 + 5
    assert cb.steps == dp_sgd_steps(n, b, epochs) == steps == 25
    assert cb.epsilon == epsilon(n, b, sigma, epochs, delta)
    assert cb.epsilon == pytest.approx(rdp_epsilon(b / n, sigma, steps, delta), rel=1e-12)


# --------------------------------------------------------------------------- accountant warnings

README_DP = dict(num_examples=64, batch_size=32, noise_multiplier=1.1, epochs=1, delta=1e-5)


def _not_converged(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if "failed to converge" in r.getMessage()]


def test_readme_example_does_not_spam_accountant_warnings(caplog, capfd):
    # Control: dp_accounting itself warns for this event (q = 0.5, sigma = 1.1, orders 1.1-1.8) ...
    with caplog.at_level(logging.WARNING):
        expected = rdp_epsilon(0.5, 1.1, 2, 1e-5)
    assert _not_converged(caplog.records)
    caplog.clear()
    capfd.readouterr()
    # ... pergrad does not, neither for epsilon nor for calibration, and returns the same number.
    with caplog.at_level(logging.WARNING):
        eps = epsilon(**README_DP)
        sigma = noise_multiplier_for(8.0, 64, 32, 1, 1e-5)
    assert not _not_converged(caplog.records)
    captured = capfd.readouterr()
    assert "failed to converge" not in captured.err + captured.out
    assert eps == expected
    assert epsilon(64, 32, sigma, 1, 1e-5) <= 8.0
    # The silencing is scoped to pergrad's calls: dp_accounting warns again afterwards.
    with caplog.at_level(logging.WARNING):
        rdp_epsilon(0.5, 1.1, 2, 1e-5)
    assert _not_converged(caplog.records)


def test_skipped_orders_do_not_change_epsilon():
    # The orders that fail to converge (alpha < 2 here) are skipped as infinite; they are never
    # the minimizer, so restricting the accountant to orders >= 2 gives the same epsilon.
    full = RdpAccountant()
    converging = RdpAccountant([a for a in full._orders if a >= 2])
    event = dp_sgd_event(0.5, 1.1, 2)
    eps, order = full.compose(event).get_epsilon_and_optimal_order(1e-5)
    assert order >= 2
    assert converging.compose(event).get_epsilon(1e-5) == eps == epsilon(**README_DP)


def test_quiet_accountant_lets_other_warnings_through(caplog):
    absl_logger = logging.getLogger("absl")
    with caplog.at_level(logging.WARNING), _quiet_accountant():
        absl_logger.warning("_compute_log_a_frac failed to converge after %d iterations", 1000)
        absl_logger.warning("Negative Renyi divergence of %s", -1.0)
        logging.getLogger("other").warning("_compute_log_a_frac failed to converge")
    messages = [r.getMessage() for r in caplog.records]
    assert "Negative Renyi divergence of -1.0" in messages
    assert "_compute_log_a_frac failed to converge" in messages  # not from absl: kept
    assert len(_not_converged(caplog.records)) == 1


# --------------------------------------------------------------------------- budget


@pytest.mark.slow(reason="a search over steps, each an accounting of its own: 12-15 s")
def test_max_steps_for_is_exact():
    q, sigma, delta = 64 / 1797, 1.1, 1e-5
    for target in (1.5, 2.0, 3.0):
        steps = max_steps_for(target, q, sigma, delta)
        assert rdp_epsilon(q, sigma, steps, delta) <= target < rdp_epsilon(q, sigma, steps + 1, delta)
    assert max_steps_for(1.0, q, sigma, delta) == 0  # one step already spends 1.15
    assert max_steps_for(1.0, q, 0.0, delta) == 0
    assert max_steps_for(1.0, 0.001, 1e4, delta) == MAX_STEPS_SEARCHED
    pld = max_steps_for(2.0, q, sigma, delta, accountant="pld")
    assert pld > max_steps_for(2.0, q, sigma, delta)  # the tighter accountant allows more
    assert epsilon_for_steps(q, sigma, pld, delta, "pld") <= 2.0
    assert epsilon_for_steps(q, sigma, pld + 1, delta, "pld") > 2.0


def test_budget_first_calibration_route():
    # Budget first: pick (epsilon, delta), calibrate sigma for the planned run, train with it.
    n, b, epochs, delta, target = 1797, 64, 5, 1e-5, 3.0
    sigma = noise_multiplier_for(target, n, b, epochs, delta)
    steps = dp_sgd_steps(n, b, epochs)
    assert rdp_epsilon(b / n, sigma, steps, delta) <= target
    assert rdp_epsilon(b / n, sigma - 1e-4, steps, delta) > target
    # A callback with that budget allows exactly the planned steps, or a few more when rounding
    # sigma up leaves slack, never fewer.
    cb = PrivacyCallback(n, b, sigma, delta, target_epsilon=target)
    assert cb.max_steps >= steps


def _budget_setting(allowed: int) -> tuple[int, int, float, float, float]:
    """(N, B, sigma, delta, target) whose budget allows exactly ``allowed`` steps."""
    n, b, sigma, delta = 128, 8, 1.5, 1e-5
    below, above = (rdp_epsilon(b / n, sigma, s, delta) for s in (allowed, allowed + 1))
    return n, b, sigma, delta, (below + above) / 2


@pytest.mark.parametrize("allowed", [7, 20])  # mid first epoch; mid second epoch (16 per epoch)
@NOT_YET_FIT
def test_budget_stops_training_after_exactly_the_allowed_steps(allowed, capsys):
    n, b, sigma, delta, target = _budget_setting(allowed)
    x, y = _regression_data(n)
    cb = PrivacyCallback(n, b, sigma, delta, target_epsilon=target)
    assert cb.max_steps == allowed and not cb.budget_exhausted
    model = _tiny_model()
    ds = poisson_batches(x, y, batch_size=b, seed=0)
    history = model.fit(ds, epochs=50, callbacks=[cb], verbose=0, shuffle=False)
    assert cb.steps == int(model.optimizer.iterations) == allowed
    assert cb.budget_exhausted
    assert cb.epsilon == pytest.approx(rdp_epsilon(b / n, sigma, allowed, delta), rel=1e-12)
    assert cb.epsilon <= target
    assert history.history["epsilon"][-1] == cb.epsilon
    assert len(history.history["epsilon"]) == math.ceil(allowed / 16)
    lines = [line for line in capsys.readouterr().out.splitlines() if "privacy budget" in line]
    assert lines == [
        f"privacy budget reached: epsilon={cb.epsilon:.8g} after {allowed} steps "
        f"(target_epsilon={target:g}); training stopped"
    ]
    with pytest.raises(RuntimeError, match="privacy budget spent"):
        model.fit(ds, epochs=1, callbacks=[cb], verbose=0, shuffle=False)
    assert int(model.optimizer.iterations) == allowed  # the refused fit ran no step


@NOT_YET_FIT
def test_budget_spans_fit_calls():
    n, b, sigma, delta, target = _budget_setting(7)
    x, y = _regression_data(n)
    cb = PrivacyCallback(n, b, sigma, delta, target_epsilon=target, verbose=0)
    model = _tiny_model()
    ds = poisson_batches(x, y, batch_size=b, seed=0).repeat()
    model.fit(ds, epochs=1, steps_per_epoch=5, callbacks=[cb], verbose=0, shuffle=False)
    assert cb.steps == 5 and not cb.budget_exhausted and not model.stop_training
    model.fit(ds, epochs=3, steps_per_epoch=5, callbacks=[cb], verbose=0, shuffle=False)
    assert cb.steps == int(model.optimizer.iterations) == 7 and cb.budget_exhausted
    with pytest.raises(RuntimeError, match="budget"):
        model.fit(ds, epochs=1, steps_per_epoch=5, callbacks=[cb], verbose=0, shuffle=False)


@NOT_YET_FIT
def test_budget_refuses_a_step_when_stop_training_is_cleared():
    n, b, sigma, delta, target = _budget_setting(3)
    x, y = _regression_data(n)

    class Restart(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = False  # a misbehaving callback after ours

    cb = PrivacyCallback(n, b, sigma, delta, target_epsilon=target, verbose=0)
    model = _tiny_model()
    with pytest.raises(RuntimeError, match="privacy budget spent"):
        model.fit(poisson_batches(x, y, batch_size=b, seed=0), epochs=2, callbacks=[cb, Restart()],
                  verbose=0, shuffle=False)
    assert cb.steps == int(model.optimizer.iterations) == 3


@NOT_YET_FIT
def test_budget_too_small_for_one_step():
    x, y = _regression_data(128)
    cb = PrivacyCallback(128, 8, 0.5, 1e-5, target_epsilon=0.01)
    assert cb.max_steps == 0
    model = _tiny_model()
    with pytest.raises(RuntimeError, match="a single step spends"):
        model.fit(poisson_batches(x, y, batch_size=8, seed=0), callbacks=[cb], verbose=0, shuffle=False)
    assert int(model.optimizer.iterations) == 0


@NOT_YET_FIT
def test_budget_refuses_steps_per_execution():
    n, b, sigma, delta, target = _budget_setting(7)
    x, y = _regression_data(n)
    cb = PrivacyCallback(n, b, sigma, delta, target_epsilon=target)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    with pytest.raises(ValueError, match="steps_per_execution"):
        model.fit(poisson_batches(x, y, batch_size=b, seed=0), callbacks=[cb], verbose=0, shuffle=False)
    assert int(model.optimizer.iterations) == 0


@NOT_YET_FIT
def test_callback_without_budget_never_stops():
    x, y = _regression_data(128)
    cb = PrivacyCallback(128, 8, 1.5, 1e-5)
    _tiny_model().fit(poisson_batches(x, y, batch_size=8, seed=0), epochs=2, callbacks=[cb],
                      verbose=0, shuffle=False)
    assert cb.max_steps is None and not cb.budget_exhausted and cb.steps == 32


# --------------------------------------------------------------------------- input types


@TF_DATA
def test_numpy_scalars_accepted():
    reference = epsilon(1797, 64, float(np.float32(1.1)), 5, 1e-5)
    assert epsilon(np.int64(1797), np.int64(64), np.float32(1.1), 5, 1e-5) == reference
    assert epsilon(np.int32(1797), np.uint16(64), np.float32(1.1), np.int8(5), np.float64(1e-5)) \
        == reference
    assert epsilon(1797.0, 64.0, np.float32(1.1), np.float16(5), 1e-5) == reference
    assert dp_sgd_steps(np.int64(1797), np.int64(64), np.float64(2.5)) == 73
    assert epsilon_for_steps(np.float64(0.5), np.float32(2), np.int64(3), np.float32(1e-5)) \
        == epsilon_for_steps(0.5, 2.0, 3, float(np.float32(1e-5)))
    assert noise_multiplier_for(np.float32(2.0), np.int64(1000), np.int64(50), np.int64(2), 1e-5) \
        == noise_multiplier_for(2.0, 1000, 50, 2, 1e-5)
    assert max_steps_for(np.float64(2.0), np.float32(0.25), np.int64(2), 1e-5) \
        == max_steps_for(2.0, float(np.float32(0.25)), 2.0, 1e-5)
    ds = poisson_batches(np.zeros((40, 2), "float32"), batch_size=np.int64(8),
                         num_examples=np.int64(40), epochs=np.float64(1.5), seed=0,
                         max_batch_size=np.int32(30))
    assert int(ds.cardinality()) == 8
    cb = PrivacyCallback(np.int64(128), np.int64(8), np.float32(1.5), np.float64(1e-5),
                         target_epsilon=np.float32(2.0))
    assert cb.max_steps == max_steps_for(2.0, 8 / 128, float(np.float32(1.5)), 1e-5)


ARGS = dict(num_examples=1797, batch_size=64, noise_multiplier=1.1, epochs=5, delta=1e-5)


@pytest.mark.parametrize("name", sorted(ARGS))
@pytest.mark.parametrize("bad", [True, np.bool_(False), "5", None, np.array([1.0]), 1 + 2j])
def test_non_numbers_and_bools_refused(name, bad):
    with pytest.raises(TypeError, match=name):
        epsilon(**{**ARGS, name: bad})


@pytest.mark.parametrize("name", ["num_examples", "batch_size", "noise_multiplier", "delta"])
def test_callback_refuses_bools(name):
    args = {k: v for k, v in ARGS.items() if k != "epochs"}
    with pytest.raises(TypeError, match=name):
        PrivacyCallback(**{**args, name: True})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=2.5), "batch_size must be a positive integer"),
        (dict(num_examples=-3), "num_examples must be a positive integer"),
        (dict(epochs=float("nan")), "epochs"),
        (dict(epochs=float("inf")), "epochs"),
        (dict(epochs=-1), "epochs"),
        (dict(noise_multiplier=float("nan")), "noise_multiplier"),
        (dict(noise_multiplier=float("inf")), "noise_multiplier"),
        (dict(delta=float("nan")), "delta"),
    ],
)
def test_bad_values_have_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        epsilon(**{**ARGS, **kwargs})


@TF_DATA
def test_other_bad_inputs():
    with pytest.raises(TypeError, match="steps"):
        epsilon_for_steps(0.1, 1.0, True, 1e-5)
    with pytest.raises(ValueError, match="steps"):
        epsilon_for_steps(0.1, 1.0, 2.5, 1e-5)
    with pytest.raises(TypeError, match="sampling_probability"):
        epsilon_for_steps(False, 1.0, 1, 1e-5)
    with pytest.raises(TypeError, match="target_epsilon"):
        noise_multiplier_for(True, 1000, 50, 1, 1e-5)
    with pytest.raises(TypeError, match="target_epsilon"):
        PrivacyCallback(1000, 50, 1.0, 1e-5, target_epsilon="1")
    with pytest.raises(ValueError, match="target_epsilon"):
        PrivacyCallback(1000, 50, 1.0, 1e-5, target_epsilon=-1.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        max_steps_for(float("inf"), 0.1, 1.0, 1e-5)
    x = np.zeros((10, 2), "float32")
    with pytest.raises(TypeError, match="poisson_batches: batch_size"):
        poisson_batches(x, batch_size=True)
    with pytest.raises(TypeError, match="poisson_batches: epochs"):
        poisson_batches(x, batch_size=2, epochs=True)
    with pytest.raises(ValueError, match="poisson_batches: epochs"):
        poisson_batches(x, batch_size=2, epochs=0)
    with pytest.raises(ValueError, match="poisson_batches: max_batch_size"):
        poisson_batches(x, batch_size=2, max_batch_size=0)
