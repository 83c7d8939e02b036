"""One check shared by the layer-rule tests: the layer takes the expected rule, and its
per-example gradients, norms, dot products and clipped sums equal the float64 loop oracle's."""

from __future__ import annotations

import numpy as np
import zoo
from oracle import assert_close, keras_loss, loop_gradients

import pergrad


def assert_rule_matches_oracle(model, layer, rule, x, y) -> None:
    """``layer`` of ``model`` is handled by ``rule`` (nothing generic) and every quantity matches
    the loop oracle at 1e-6 relative to the largest entry."""
    loss = zoo.SCCE
    pex = pergrad.PerExample(model, loss)
    ruled = {id(lay): r for lay, r in pex.plan.ruled}
    assert id(layer) in ruled, pex.plan.describe()
    assert ruled[id(layer)].fn is rule
    assert not pex.plan.generic, pex.plan.describe()

    expected, _ = loop_gradients(model, keras_loss(loss), x, y)
    scale = max(np.max(np.abs(e)) for e in expected)
    grads = pex.gradients(x, y)
    for g, e, v in zip(grads, expected, model.trainable_variables, strict=True):
        assert_close(g, e, atol=1e-6 * scale, what=v.path)

    flat = np.concatenate([e.reshape(len(x), -1) for e in expected], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    assert_close(pex.norms(x, y), norms, what="norms")

    rng = np.random.default_rng(7)
    vectors = [rng.normal(size=v.shape) for v in model.trainable_variables]
    flat_v = np.concatenate([v.ravel() for v in vectors])
    assert_close(pex.dot(x, y, vectors), flat @ flat_v, what="dot")

    clip = float(np.median(norms))
    summed, clip_norms = pex.clipped_sum(x, y, clip)
    factors = np.minimum(1.0, clip / norms)
    expected_sums = [np.tensordot(factors, e, axes=1) for e in expected]
    sum_scale = max(np.max(np.abs(e)) for e in expected_sums)
    for s, e, v in zip(summed, expected_sums, model.trainable_variables, strict=True):
        assert_close(s, e, atol=1e-6 * sum_scale, what=f"clipped_sum {v.path}")
    assert_close(clip_norms, norms, what="clipped_sum norms")
