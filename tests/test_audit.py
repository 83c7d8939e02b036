"""Empirical privacy audit of ``pergrad.aggregate.dp_mean`` (issue 9, part 7).

A canary audit (Jagielski et al. 2020; Nasr et al. 2021) of one DP-SGD step through the real code
path: ``PerExample.compute`` on a dataset ``D`` and on ``D' = D + {canary}`` (add-or-remove-one
neighbours, the relation ``pergrad.privacy`` accounts for), then ``dp_mean``'s ``local`` and
``finalize`` with many independent noise keys. Every release is projected on the direction of the
canary's clipped gradient, and :func:`audit.epsilon_lower_bound` turns the two worlds' projections
into a 95%-confidence lower bound on epsilon. It must stay below the accountant's epsilon for the
real aggregator (one step, sampling probability 1) and exceed it for deliberately broken variants:

* the same noise key for two releases (the noise cancels in their difference),
* clipping removed (noise calibrated for ``C``, a canary gradient far above ``C``),
* a noise multiplier smaller than the one claimed to the accountant,
* dividing by the number of rows (which differs between ``D`` and ``D'``) instead of
  ``expected_batch_size``: the noise *scale* then reveals the canary.

The aggregator under audit therefore divides by ``expected_batch_size`` in both worlds, as
``dp_mean``'s docstring asks for Poisson-sampled batches.

**Many releases per ``finalize`` call.** ``finalize`` adds noise of the shape of each partial value
and divides, coordinate by coordinate. Its partial is given a leading *trial* axis (the same clipped
sum repeated ``rows`` times), so one call with one key releases ``rows`` independent noisy updates:
the audit draws hundreds of thousands of releases in a few calls, and still runs the real
``finalize`` with real keys (different keys for different calls, the same key only in the
repeated-noise variant).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import keras
import numpy as np
import pytest
from audit import AuditResult, clopper_pearson, epsilon_lower_bound
from scipy import optimize
from scipy import stats as scipy_stats

import pergrad
from pergrad import aggregate
from pergrad.aggregate.base import linear_local
from pergrad.privacy import epsilon_for_steps

tf = pytest.importorskip("tensorflow", reason="needs tensorflow (pip install pergrad[tensorflow])")
pytestmark = pytest.mark.tensorflow_only(reason=(
    "the canary audit runs dp_mean's local() in a tf.function (reduce_retracing) and finalize() "
    "with tf.int64 noise keys, and projects with TensorFlow ops (tf.linalg.qr); on JAX the keys "
    "would have to be passed into a jax.jit step"))
BOUND_CHECKS = pytest.mark.only_on("tensorflow", reason=(
    "backend-independent NumPy/SciPy checks of tests/audit.py's bound: run once, beside the "
    "audits that use it"))

CLIP = 1.0
SIGMA = 1.0
DELTA = 1e-5
BACKGROUND = 7          # examples of D; D' adds the canary
FEATURES = 4
SEED = 1234
KEYS_PER_WORLD = 8      # finalize calls (noise keys) per world
ROWS_PER_KEY = 25_000   # releases per finalize call: 200,000 trials per world


def noise_key(i: int) -> tf.Tensor:
    """The ``i``-th noise key of the audit, ``[seed, counter]`` (the one place keys are built)."""
    return tf.constant([SEED, i], tf.int64)


def _loss(y, p):
    return keras.ops.mean(keras.ops.square(y - p), axis=-1)


@dataclass
class Worlds:
    """The neighbouring datasets, another batch, and the canary's direction.

    Attributes:
        pex: the engine for a ``Dense`` model with squared error.
        batches: ``(x, y)`` of ``"out"`` (``D``), ``"in"`` (``D' = D + {canary}``, canary last)
            and ``"other"`` (a second batch of the same epoch, for the two-step audits).
        direction: per variable, the canary gradient divided by its norm (a unit vector overall).
        canary_norm: ``||g_canary||``, far above ``CLIP``.
    """

    pex: pergrad.PerExample
    batches: dict[str, tuple[np.ndarray, np.ndarray]]
    direction: list[tf.Tensor]
    canary_norm: float
    _compiled: dict = field(default_factory=dict)

    def partial(self, agg: aggregate.Aggregator, batch: str) -> aggregate.Partial:
        """``agg.local`` of the batch's :class:`pergrad.PerExampleResult`, computed inside a
        ``tf.function`` (one per ``local``, so the few shapes are traced once each)."""
        if agg.local not in self._compiled:
            # A partial, not a closure: TensorFlow counts retracing per closure *code*, across
            # instances, and would warn about the handful of traces of several aggregators.
            self._compiled[agg.local] = tf.function(
                functools.partial(_local, self.pex, agg.local), autograph=False,
                reduce_retracing=True)
        x, y = self.batches[batch]
        return self._compiled[agg.local](tf.constant(x), tf.constant(y))


def _local(pex: pergrad.PerExample, local, x: tf.Tensor, y: tf.Tensor) -> aggregate.Partial:
    result = pex.compute(x, y)
    return local(result, aggregate.Batch.of(result))


def make_worlds(units: int) -> Worlds:
    """``D``: 7 random examples for a ``Dense(units)`` model; the canary: a far-out input with a
    far-off target, so that its gradient is huge (clipped to norm exactly ``CLIP``) and points in
    a known direction."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(
        units, kernel_initializer=keras.initializers.RandomNormal(seed=0),
        bias_initializer="zeros")])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * BACKGROUND, FEATURES)).astype("float32")
    y = rng.normal(size=(2 * BACKGROUND, units)).astype("float32")
    x_canary = np.array([[10.0, -10.0, 10.0, -10.0]], "float32")
    y_canary = np.full((1, units), 100.0, "float32")
    pex = pergrad.PerExample(model, _loss)
    grads = pex.gradients(x_canary, y_canary)
    norm = float(tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])))
    direction = [g[0] / norm for g in grads]
    d = (x[:BACKGROUND], y[:BACKGROUND])
    batches = {"out": d, "in": (np.concatenate([d[0], x_canary]), np.concatenate([d[1], y_canary])),
               "other": (x[BACKGROUND:], y[BACKGROUND:])}
    return Worlds(pex, batches, direction, norm)


@pytest.fixture(scope="module")
def worlds() -> Worlds:
    """The audit's worlds for a ``Dense(1)`` model (5 parameters)."""
    return make_worlds(1)


def release(agg: aggregate.Aggregator, partial: aggregate.Partial, key: tf.Tensor,
            rows: int) -> list[tf.Tensor]:
    """``rows`` independent releases ``agg.finalize(partial, key)``, each update ``(rows,
    *var.shape)``: the partial's values get a leading trial axis (see the module docstring)."""
    values = [tf.repeat(v[tf.newaxis], rows, axis=0) for v in partial.values]
    return agg.finalize(partial._replace(values=values), key)


def project(update: list[tf.Tensor], direction: list[tf.Tensor]) -> np.ndarray:
    """``<update_r, direction>`` for every release ``r``: the distinguisher's score."""
    return tf.add_n([tf.reduce_sum(tf.reshape(g * d, [tf.shape(g)[0], -1]), axis=1)
                     for g, d in zip(update, direction, strict=True)]).numpy()


def one_step_scores(agg: aggregate.Aggregator, worlds: Worlds) -> tuple[np.ndarray, np.ndarray]:
    """Scores of one released step on ``D'`` (canary in) and on ``D`` (out), independent keys."""
    scores = []
    for world, batch in enumerate(("in", "out")):
        partial = worlds.partial(agg, batch)
        scores.append(np.concatenate([
            project(release(agg, partial, noise_key(world * KEYS_PER_WORLD + k), ROWS_PER_KEY),
                    worlds.direction) for k in range(KEYS_PER_WORLD)]))
    return scores[0], scores[1]


def two_step_scores(agg: aggregate.Aggregator, worlds: Worlds, same_key: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Two steps of one epoch: batch 1 is ``D`` or ``D'``, batch 2 another batch ``E`` (the rest
    of the data; the canary is in batch 1 only). The adversary sees both updates and projects their
    difference on the canary direction. ``same_key``: both steps noised with the same key."""
    other = worlds.partial(agg, "other")
    scores = []
    for world, batch in enumerate(("in", "out")):
        partial = worlds.partial(agg, batch)
        parts = []
        for k in range(KEYS_PER_WORLD):
            first = 2 * (world * KEYS_PER_WORLD + k)
            second = first if same_key else first + 1
            step1 = release(agg, partial, noise_key(first), ROWS_PER_KEY)
            step2 = release(agg, other, noise_key(second), ROWS_PER_KEY)
            parts.append(project([a - b for a, b in zip(step1, step2, strict=True)],
                                 worlds.direction))
        scores.append(np.concatenate(parts))
    return scores[0], scores[1]


@dataclass(frozen=True)
class Verdict:
    """An audit's lower bound next to the accountants' upper bounds for the claimed noise."""

    audit: AuditResult
    pld: float
    rdp: float
    name: str

    def __str__(self) -> str:
        a = self.audit
        return (f"{self.name}: empirical epsilon >= {a.epsilon:.3f} (95%, event {a.event} "
                f"{a.direction}, p_in={a.p_in:.5f}, p_out={a.p_out:.5f}, {a.trials} trials per "
                f"world); accountant epsilon PLD {self.pld:.3f}, RDP {self.rdp:.3f}")


def verdict(name: str, agg: aggregate.Aggregator, scores: tuple[np.ndarray, np.ndarray],
            steps: int) -> Verdict:
    """Audit the scores against the accountant's epsilon for the aggregator's *claimed* noise
    multiplier, ``steps`` Gaussian steps at sampling probability 1 (add-or-remove-one)."""
    sigma = agg.config["noise_multiplier"]
    return Verdict(epsilon_lower_bound(*scores, DELTA),
                   epsilon_for_steps(1.0, sigma, steps, DELTA, accountant="pld"),
                   epsilon_for_steps(1.0, sigma, steps, DELTA, accountant="rdp"), name)


#: The aggregator under audit; its divisor ``expected_batch_size`` does not depend on the data.
DP_MEAN = aggregate.dp_mean(CLIP, SIGMA, seed=SEED, expected_batch_size=BACKGROUND + 1)


# -- the bound itself, on mechanisms with a known epsilon -------------------------------------


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon at ``delta`` of ``N(0, 1)`` vs ``N(mu, 1)`` (Balle & Wang 2018, Thm. 8)."""

    def gap(eps: float) -> float:
        return (scipy_stats.norm.cdf(mu / 2 - eps / mu)
                - np.exp(eps) * scipy_stats.norm.cdf(-mu / 2 - eps / mu) - delta)

    return optimize.brentq(gap, 0.0, 100.0, xtol=1e-12)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 3.0])
@BOUND_CHECKS
def test_bound_on_randomized_response(epsilon):
    """Randomized response (report the true bit with probability e^eps / (1 + e^eps)) is exactly
    eps-DP: the bound approaches eps from below."""
    rng = np.random.default_rng(int(10 * epsilon))
    p = np.exp(epsilon) / (1 + np.exp(epsilon))
    n = 200_000
    result = epsilon_lower_bound(rng.random(n) < p, rng.random(n) < 1 - p, delta=0.0)
    assert 0.9 * epsilon < result.epsilon < epsilon, result


@BOUND_CHECKS
def test_bound_on_gaussian_mechanism():
    """The Gaussian mechanism with sensitivity/sigma = 1 has an exact epsilon(delta); a threshold
    audit of 200,000 trials per world reaches a good part of it (about 2/3) and never exceeds
    it."""
    exact = exact_gaussian_epsilon(1.0, DELTA)
    assert exact == pytest.approx(epsilon_for_steps(1.0, 1.0, 1, DELTA, "pld"), rel=2e-3)
    rng = np.random.default_rng(2)
    bounds = [epsilon_lower_bound(rng.normal(1.0, 1.0, 200_000), rng.normal(0.0, 1.0, 200_000),
                                  DELTA).epsilon for _ in range(3)]
    assert all(0.5 * exact < b < exact for b in bounds), (bounds, exact)


@BOUND_CHECKS
def test_bound_edge_cases():
    """Nothing to detect gives 0; perfect separation gives the most the trial count allows."""
    rng = np.random.default_rng(3)
    # The same distribution in both worlds: nothing to detect.
    assert epsilon_lower_bound(rng.normal(size=50_000), rng.normal(size=50_000), DELTA).epsilon \
        == 0.0
    # Perfect separation, in either orientation: the bound is limited only by the number n of
    # evaluation trials, log(n / c) with c ~ 3.7 at 95% (both Clopper-Pearson bounds at 2.5%).
    for sign in (1.0, -1.0):
        result = epsilon_lower_bound(sign * rng.normal(100.0, 1.0, 20_000),
                                     sign * rng.normal(0.0, 1.0, 20_000), DELTA)
        n = result.trials
        assert n == 15_000
        _, fpr_hi = clopper_pearson(0, n, 0.025)
        lo, _ = clopper_pearson(n, n, 0.025)
        assert result.epsilon == pytest.approx(np.log((lo - DELTA) / fpr_hi), rel=1e-9)
        assert np.log(n / 4) < result.epsilon < np.log(n / 3)
    # Clopper-Pearson against scipy's exact binomial test interval.
    lo, hi = clopper_pearson(np.array([7]), 50, 0.025)
    ci = scipy_stats.binomtest(7, 50).proportion_ci(0.95, method="exact")
    assert (lo[0], hi[0]) == pytest.approx((ci.low, ci.high), rel=1e-9)


# -- the audit of pergrad's DP-SGD step ---------------------------------------------------------


def test_canary_is_clipped_and_direction_is_unit(worlds):
    """The audit's premise: the canary's gradient is far above the clip norm, so in ``D'`` it adds
    exactly ``CLIP * direction`` to the clipped sum."""
    assert worlds.canary_norm > 100 * CLIP
    norm = np.sqrt(sum(float(tf.reduce_sum(d * d)) for d in worlds.direction))
    assert norm == pytest.approx(1.0, rel=1e-6)
    with_canary, without = worlds.partial(DP_MEAN, "in"), worlds.partial(DP_MEAN, "out")
    for a, b, d in zip(with_canary.values, without.values, worlds.direction, strict=True):
        np.testing.assert_allclose(a - b, CLIP * d, atol=1e-5)


def test_dp_mean_passes_the_audit(worlds):
    """One step of the real dp_mean: the empirical lower bound stays below the accountant's
    epsilon, and the audit is tight enough to mean something (a good fraction of it: about 2/3
    is what 200,000 trials per world typically reach for sigma = 1)."""
    result = verdict("dp_mean", DP_MEAN, one_step_scores(DP_MEAN, worlds), steps=1)
    assert result.audit.epsilon <= result.pld <= result.rdp, str(result)
    assert result.audit.epsilon >= 0.5 * result.pld, f"audit too weak to mean anything: {result}"
    print(f"\n{result}")


def test_audit_flags_repeated_noise(worlds):
    """Two steps noised with the same key: the difference of the two updates has no noise left,
    the canary is certain, and the bound blows past the accountant's two-step epsilon. With
    distinct keys the same two-step audit passes."""
    fresh = verdict("two steps, distinct keys", DP_MEAN, two_step_scores(DP_MEAN, worlds, False),
                    steps=2)
    assert fresh.audit.epsilon <= fresh.pld, str(fresh)
    repeated = verdict("two steps, the same key", DP_MEAN,
                       two_step_scores(DP_MEAN, worlds, True), steps=2)
    assert repeated.audit.epsilon > repeated.rdp >= repeated.pld, str(repeated)
    print(f"\n{fresh}\n{repeated}")


def test_audit_flags_missing_clipping(worlds):
    """Noise calibrated for C but gradients not clipped: the canary's gradient (norm ~2000 C)
    dwarfs the noise, and the bound exceeds the accountant's epsilon."""
    unclipped = DP_MEAN._replace(name="dp_mean_without_clipping", clips=False,
                              local=linear_local(lambda squared, batch: 1.0, needs_norms=False))
    result = verdict("no clipping", unclipped, one_step_scores(unclipped, worlds), steps=1)
    assert result.audit.epsilon > result.rdp >= result.pld, str(result)
    print(f"\n{result}")


def test_audit_flags_understated_noise(worlds):
    """An aggregator that adds a quarter of the noise it claims (sigma / 4, reported as sigma)."""
    weak = aggregate.dp_mean(CLIP, SIGMA / 4, seed=SEED, expected_batch_size=BACKGROUND + 1)
    claims = DP_MEAN._replace(finalize=weak.finalize)  # config still says SIGMA
    result = verdict("noise sigma/4 claimed as sigma", claims, one_step_scores(claims, worlds),
                     steps=1)
    assert result.audit.epsilon > result.rdp >= result.pld, str(result)
    print(f"\n{result}")


def test_row_count_divisor_is_flagged_under_add_or_remove():
    """Why DP-SGD over Poisson batches passes ``expected_batch_size``: dividing by the number of
    rows makes the noise scale depend on whether the canary is there, ``sigma C / 7`` versus
    ``sigma C / 8``. An adversary who knows ``D`` measures the noise energy off the span of
    ``D``'s clipped sum and the canary direction, where both worlds have mean 0; with 500
    parameters that alone exceeds the add-or-remove accountant. (Fixed-size or padded batches
    keep the row count constant, which is what ``dp_mean``'s default is documented for.) The
    same score on the ``expected_batch_size`` aggregator finds nothing."""
    wide = make_worlds(100)  # 4 * 100 + 100 = 500 parameters
    rows_divisor = aggregate.dp_mean(CLIP, SIGMA, seed=SEED)

    def flat(tensors: list[tf.Tensor]) -> tf.Tensor:
        return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)

    known = tf.stack([flat(wide.partial(DP_MEAN, "out").values), flat(wide.direction)], axis=1)
    basis, _ = tf.linalg.qr(known)  # (500, 2), orthonormal

    def scores(agg: aggregate.Aggregator) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for world, batch in enumerate(("in", "out")):
            partial = wide.partial(agg, batch)
            parts = []
            for k in range(2):
                update = release(agg, partial, noise_key(2 * world + k), 10_000)
                rows = tf.concat([tf.reshape(g, [tf.shape(g)[0], -1]) for g in update], axis=1)
                along = rows @ basis
                parts.append((tf.reduce_sum(rows * rows, 1) - tf.reduce_sum(along * along, 1))
                             .numpy())
            out.append(np.concatenate(parts))
        return out[0], out[1]

    leaky = verdict("dp_mean dividing by the row count", rows_divisor, scores(rows_divisor), 1)
    assert leaky.audit.epsilon > leaky.rdp >= leaky.pld, str(leaky)
    fixed = verdict("dp_mean with expected_batch_size", DP_MEAN, scores(DP_MEAN), 1)
    assert fixed.audit.epsilon <= fixed.pld, str(fixed)
    print(f"\n{leaky}\n{fixed}")
