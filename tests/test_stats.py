"""pergrad.stats against the same quantities computed in numpy from materialized float64 gradients."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import zoo
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_close, keras_loss, loop_gradients

import pergrad
from pergrad import backend
from pergrad.rules import forms
from pergrad.stats import BATCH_STATISTICS, batch_statistics, gradient_statistics, gram


def reference(flat: np.ndarray, active: np.ndarray) -> dict[str, float]:
    """Every statistic, written out in numpy from the (B, P) matrix of per-example gradients."""
    g = flat[active]
    n = len(g)
    mean = g.mean(axis=0)
    mean_sq = mean @ mean
    cov_trace = np.trace(np.cov(g, rowvar=False, ddof=1)) if flat.shape[1] > 1 else g.var(ddof=1)
    dots = g @ mean
    projections = g - np.outer(dots / mean_sq, mean)
    norms = np.linalg.norm(flat, axis=1)
    all_dots = flat @ mean
    cos = np.where(active, all_dots / (norms * np.sqrt(mean_sq) + 1e-300), 0.0)
    units = np.where(active[:, None], flat / np.maximum(norms, 1e-300)[:, None], 0.0)
    rest = units.sum(axis=0)[None] - units
    rest_cos = np.where(active, np.sum(units * rest, axis=1) / np.linalg.norm(rest, axis=1), 0.0)
    return {
        "cosine_to_rest": rest_cos,
        "fraction_against_rest": np.mean(rest_cos[active] < 0),
        "norms": np.where(active, norms, 0.0),
        "dot_to_batch": np.where(active, all_dots, 0.0),
        "cosine_to_batch": cos,
        "batch_gradient_norm": np.sqrt(mean_sq),
        "gradient_variance": cov_trace,
        "noise_scale": cov_trace / mean_sq,
        "snr": mean_sq / (cov_trace / n),
        "norm_test": np.sum((g - mean) ** 2) / (n - 1) / (n * mean_sq),
        "inner_product_test": np.var(dots, ddof=1) / (n * mean_sq**2),
        "orthogonality_test": np.sum(projections**2) / (n - 1) / (n * mean_sq),
        "gradient_diversity": np.sum(g**2) / np.sum(g.sum(axis=0) ** 2),
        "fraction_opposed": np.mean(dots < 0),
    }


def _materialize(case):
    grads, losses = loop_gradients(case.model, keras_loss(case.loss), case.x, case.y,
                                   case.sample_weight)
    return grads, np.concatenate([g.reshape(len(g), -1) for g in grads], axis=1), losses


def _check(stats, expected, losses=None):
    for key, value in expected.items():
        assert_close(stats[key], value, rtol=1e-6, what=key)
    if losses is not None:
        assert_close(stats["losses"], losses, what="losses")


@pytest.mark.parametrize("name", ["mlp", "conv2d_same_stride2", "embedding", "transformer",
                                  "generic_layers", "sample_weight_regularizers"])
def test_statistics_match_float64_reference(name, float64):
    case = zoo.ALL[name]()
    _, flat, losses = _materialize(case)
    pex = pergrad.PerExample(case.model, case.loss)
    stats = gradient_statistics(pex, case.x, case.y, case.sample_weight)
    assert set(BATCH_STATISTICS) <= set(stats)
    _check(stats, reference(flat, np.ones(len(flat), bool)), losses)


def test_zero_weight_examples_are_excluded(float64, rng):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
    x, y = rng.normal(size=(9, 4)), rng.integers(0, 3, 9)
    weight = rng.uniform(0.5, 2.0, 9)
    weight[[2, 7]] = 0.0  # padding
    case = zoo.Case(model, zoo.SCCE, x, y, weight)
    _, flat, losses = _materialize(case)
    stats = gradient_statistics(pergrad.PerExample(model, zoo.SCCE), x, y, weight)
    _check(stats, reference(flat, weight != 0), losses)
    # The same as dropping the padded rows altogether.
    keep = weight != 0
    dropped = gradient_statistics(pergrad.PerExample(model, zoo.SCCE), x[keep], y[keep], weight[keep])
    for key in BATCH_STATISTICS:
        assert_close(stats[key], dropped[key], what=key)


def test_per_layer_norms_and_cosines(float64):
    case = zoo.nested()
    grads, _, _ = _materialize(case)
    pex = pergrad.PerExample(case.model, case.loss)
    stats = gradient_statistics(pex, case.x, case.y, per_layer=True)
    groups: dict[str, list[np.ndarray]] = {}
    for g, v in zip(grads, case.model.trainable_variables, strict=True):
        groups.setdefault(v.path.rsplit("/", 1)[0], []).append(g.reshape(len(g), -1))
    assert set(stats["per_layer"]) == set(groups)
    for layer, parts in groups.items():
        block = np.concatenate(parts, axis=1)
        mean = block.mean(axis=0)
        norms = np.linalg.norm(block, axis=1)
        got = stats["per_layer"][layer]
        assert_close(got["norms"], norms, what=layer)
        assert_close(got["batch_gradient_norm"], np.linalg.norm(mean), what=layer)
        assert_close(got["dot_to_batch"], block @ mean, what=layer)
        assert_close(got["cosine_to_batch"], block @ mean / (norms * np.linalg.norm(mean)),
                     what=layer)


@pytest.mark.parametrize("name", ["mlp", "conv2d_valid", "embedding"])
def test_gram_matches_reference(name, float64):
    case = zoo.ALL[name]()
    _, flat, _ = _materialize(case)
    assert_close(gram(pergrad.PerExample(case.model, case.loss), case.x, case.y), flat @ flat.T)


def test_compiled_once(rng):
    case = zoo.mlp()
    pex = pergrad.PerExample(case.model, case.loss)
    for _ in range(3):
        x = rng.normal(size=(5, 6)).astype("float32")
        gradient_statistics(pex, x, case.y)
        gram(pex, x, case.y)
    traces = 0 if backend.is_torch() else 1  # PyTorch runs eagerly: nothing is traced, ever
    assert pex.trace_counts["statistics"] == traces
    assert pex.trace_counts["gram"] == traces


def test_statistics_never_materialize_ruled_layers(monkeypatch, float64):
    def refuse(self):
        raise AssertionError(f"materialized {self.variable.path}")

    monkeypatch.setattr(forms.Factored, "materialize", refuse)
    monkeypatch.setattr(forms.Rows, "materialize", refuse)
    for name in ["conv2d_same_stride2", "embedding", "transformer"]:
        case = zoo.ALL[name]()
        stats = gradient_statistics(pergrad.PerExample(case.model, case.loss), case.x, case.y,
                                    per_layer=True)
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(stats["norms"])))


def test_one_active_example_gives_nan_variance(float64):
    case = zoo.mlp()
    weight = np.zeros(len(case.y))
    weight[1] = 1.0
    stats = gradient_statistics(pergrad.PerExample(case.model, case.loss), case.x, case.y, weight)
    assert np.isnan(stats["gradient_variance"]) and np.isnan(stats["noise_scale"])
    assert float(stats["fraction_opposed"]) == 0.0
    assert_close(stats["cosine_to_batch"][1], 1.0)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(2, 12), params=st.integers(1, 7), seed=st.integers(0, 2**16),
       drop=st.floats(0.0, 0.6))
def test_formulas_hypothesis(batch, params, seed, drop):
    """batch_statistics from norms, dots and ||G|| against the direct formulas on random g_i."""
    rng = np.random.default_rng(seed)
    flat = rng.normal(size=(batch, params)) + rng.normal(size=params)
    active = rng.uniform(size=batch) >= drop
    active[:2] = True
    flat[~active] = 0.0
    mean = flat[active].mean(axis=0)
    got = batch_statistics(np.sum(flat**2, axis=1), flat @ mean, mean @ mean, active)
    expected = reference(flat, active)
    # orthogonality_test is exactly 0 when P = 1; it is bounded by n/(n-1) gradient_diversity.
    scale = 1.0 + 2 * expected["gradient_diversity"]
    for key in BATCH_STATISTICS:
        assert_close(got[key], expected[key], rtol=1e-9, atol=1e-9 * max(scale, abs(expected[key])),
                     what=key)
