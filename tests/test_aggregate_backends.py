"""Every aggregator called directly, ``agg(result)``, on every backend, against NumPy float64
math on the loop oracle's per-example gradients (the aggregators' own detailed tests, with
TensorFlow-specific graphs, are in tests/test_aggregate.py and tests/test_noise.py)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import zoo
from oracle import assert_close, keras_loss, loop_gradients

import pergrad
from pergrad import aggregate


def _flat(grads: list) -> np.ndarray:
    return np.concatenate([np.reshape(g, (len(g), -1)) for g in grads], axis=1)


def _split_like(flat: np.ndarray, grads: list) -> list:
    out, start = [], 0
    for g in grads:
        size = int(np.prod(g.shape[1:]))
        out.append(np.reshape(flat[start:start + size], g.shape[1:]))
        start += size
    return out


@pytest.fixture
def case(float64):
    case = zoo.mlp()
    result = pergrad.PerExample(case.model, case.loss).compute(case.x, case.y)
    expected, _ = loop_gradients(case.model, keras_loss(case.loss), case.x, case.y)
    return result, [np.asarray(e, np.float64) for e in expected]


def _numpy(values: list) -> list:
    return [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in values]


def test_linear_and_order_aggregators_match_numpy(case):
    result, expected = case
    flat = _flat(expected)
    norms = np.linalg.norm(flat, axis=1)
    clip = float(np.median(norms))
    clipped = flat * np.minimum(1.0, clip / norms)[:, None]
    references = {
        "mean": flat.mean(0),
        "sum": flat.sum(0),
        "clip_mean": clipped.mean(0),
        "dp_mean sigma=0": clipped.mean(0),
        "normalized_mean": (flat / (norms + 0.01)[:, None]).mean(0),
        "median": np.median(flat, axis=0),
        "trimmed_mean": np.sort(flat, axis=0)[1:-1].mean(0),
    }
    batch = len(flat)
    assert batch >= 5  # trimmed_mean(1 / batch) drops one row on each side
    aggregators = {
        "mean": aggregate.mean(), "sum": aggregate.sum(), "clip_mean": aggregate.clip_mean(clip),
        "dp_mean sigma=0": aggregate.dp_mean(clip, 0.0, seed=0),
        "normalized_mean": aggregate.normalized_mean(0.01), "median": aggregate.median(),
        "trimmed_mean": aggregate.trimmed_mean(1.0 / batch),
    }
    for name, agg in aggregators.items():
        got = _numpy(agg(result))
        for g, want in zip(got, _split_like(references[name], expected), strict=True):
            assert_close(g, want)


def test_dp_noise_has_the_calibrated_size_and_is_fresh_at_every_call(case):
    result, expected = case
    clip, sigma = 0.5, 2.0
    flat = _flat(expected)
    norms = np.linalg.norm(flat, axis=1)
    signal = (flat * np.minimum(1.0, clip / norms)[:, None]).mean(0)
    agg = aggregate.dp_mean(clip, sigma, seed=3)
    calls = np.stack([_flat([g[None] for g in _numpy(agg(result))])[0] - signal
                      for _ in range(16)])
    # N(0, (C sigma / B)^2) per coordinate: over 16 calls of P = 107 coordinates the sample
    # std is within 8% (4.7 standard errors) of the calibrated one.
    assert abs(calls.std() / (clip * sigma / len(flat)) - 1) < 0.08, calls.std()
    # A new key at each call: consecutive draws are uncorrelated (a repeat would give 1; each
    # correlation's standard error is 1/sqrt(107) = 0.1).
    correlations = [np.corrcoef(a, b)[0, 1] for a, b in zip(calls[:-1], calls[1:], strict=True)]
    assert max(np.abs(correlations)) < 0.5, correlations
