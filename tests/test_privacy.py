"""Tests for pergrad.privacy (accounting, Poisson sampling), PrivacyCallback and `pergrad privacy`."""

from __future__ import annotations

import argparse
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import optimize, stats

from pergrad.cli.privacy import add_parser, run
from pergrad.keras.privacy_callback import PrivacyCallback
from pergrad.privacy import epsilon, epsilon_for_steps, noise_multiplier_for, poisson_batches
from pergrad.privacy.sampling import default_max_batch_size

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
    # steps = ceil(epochs * N / B): 0.5 * 1000 / 300 = 1.67 -> 2 steps; 3 epochs -> 10 steps.
    assert epsilon(1000, 300, 1.1, 0.5, 1e-5) == epsilon_for_steps(0.3, 1.1, 2, 1e-5)
    assert epsilon(1000, 300, 1.1, 3, 1e-5) == epsilon_for_steps(0.3, 1.1, 10, 1e-5)
    assert epsilon(1000, 300, 1.1, 3, 1e-5) != epsilon_for_steps(0.3, 1.1, 9, 1e-5)


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


def test_default_weights_and_no_labels():
    x = np.arange(30, dtype="float32").reshape(10, 3)
    xb, yb, wb = next(iter(poisson_batches(x, batch_size=5, seed=0, max_batch_size=10)))
    assert yb is None
    k = int(tf.reduce_sum(wb))
    np.testing.assert_array_equal(wb.numpy(), [1.0] * k + [0.0] * (10 - k))


def test_inclusion_is_poisson():
    n, b, steps_per_epoch, epochs = 200, 20, 10, 50  # q = 0.1, 500 steps
    q = b / n
    x = np.arange(n, dtype="float32")
    ds = poisson_batches(x, batch_size=b, seed=11, epochs=epochs, with_indices=True)
    counts = np.zeros(n, dtype=int)
    sizes = []
    for _, _, _, ib in ds.as_numpy_iterator():
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


def test_deterministic_with_seed_and_fresh_each_pass():
    x, y, _ = _data()

    def passes(seed):
        ds = poisson_batches(x, y, batch_size=8, seed=seed, with_indices=True)
        return [[ib.tolist() for *_, ib in ds.as_numpy_iterator()] for _ in range(2)]

    first, again, other = passes(5), passes(5), passes(6)
    assert first == again  # same seed: same batches, pass for pass
    assert first[0] != first[1]  # a new pass (a new Keras epoch) draws new batches
    assert first != other


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
    assert "steps = ceil(15 * 60000 / 150) = 6000" in out
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
