"""Empirical privacy auditing: a high-confidence lower bound on epsilon from observed outputs.

The audit is the canary / membership-distinguisher audit of Jagielski, Ullman and Oprea, "Auditing
Differentially Private Machine Learning: How Private is Private SGD?" (NeurIPS 2020) and Nasr,
Song, Thakurta, Papernot and Carlini, "Adversary Instantiation: Lower Bounds for Differentially
Private Machine Learning" (IEEE S&P 2021): run the mechanism many times on two neighbouring
datasets ``D`` (canary out) and ``D'`` (canary in), reduce every output to a real score, and turn
how well a threshold on the score separates the two worlds into a lower bound on epsilon that
holds with probability at least ``confidence`` over the randomness of the trials.

**Why the bound is valid.** If a mechanism ``M`` is ``(epsilon, delta)``-DP for neighbours
``D, D'`` then for every event ``S``, in both directions,

    P[M(D') in S] <= exp(epsilon) * P[M(D) in S] + delta,
    P[M(D) in S]  <= exp(epsilon) * P[M(D') in S] + delta,

so ``epsilon >= log((P[M(D') in S] - delta) / P[M(D) in S])`` (and the mirror image). With
``n`` independent trials per world the two probabilities are estimated by counts; Clopper and
Pearson's exact binomial intervals (Biometrika 1934) give a lower confidence bound ``p_lo`` on
the numerator and an upper one ``p_hi`` on the denominator, each at level ``alpha / 2`` (a union
bound: both hold with probability ``>= 1 - alpha``), hence

    epsilon >= log((p_lo - delta) / p_hi)     with probability >= 1 - alpha.

**Choosing the event without cheating.** The events tried are ``{score >= t}`` and ``{score < t}``
for thresholds ``t``, each in both directions. Taking the best of many events on the same trials
would overstate the bound (multiple comparisons), so the trials are split in two: the event is
chosen on the first part (the one whose bound is largest there) and the bound is computed on the
rest, independent of the choice. One event is evaluated, so no further correction is needed. A
quarter of the trials suffices to choose well; the other three quarters tighten the bound.

**What it is not.** The one-run audit of Steinke, Nasr and Jagielski, "Privacy Auditing with One
(1) Training Run" (NeurIPS 2023) inserts many canaries into a single run; it is needed when one run
is a whole (expensive) training. A single DP-SGD step is cheap to repeat, so this module uses
many independent runs, whose bound can approach the true epsilon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats


def clopper_pearson(successes, trials: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper-Pearson bounds ``(lo, hi)`` on a binomial proportion, each at level
    ``alpha``: ``P[p < lo] <= alpha`` and ``P[p > hi] <= alpha``.

    ``lo = Beta^{-1}(alpha; k, n - k + 1)`` (0 when ``k = 0``) and ``hi = Beta^{-1}(1 - alpha;
    k + 1, n - k)`` (1 when ``k = n``), for ``k`` successes in ``n`` trials (arrays accepted).
    """
    k = np.asarray(successes, dtype=float)
    n = float(trials)
    lo = np.where(k > 0, stats.beta.ppf(alpha, np.maximum(k, 1.0), n - k + 1.0), 0.0)
    hi = np.where(k < n, stats.beta.ppf(1.0 - alpha, k + 1.0, np.maximum(n - k, 1.0)), 1.0)
    return lo, hi


@dataclass(frozen=True)
class AuditResult:
    """The outcome of :func:`epsilon_lower_bound`.

    Attributes:
        epsilon: the lower bound on epsilon (``>= 0``), valid with probability ``confidence``.
        event: the event used, e.g. ``"score >= 0.31"``.
        direction: ``"in/out"`` if the bound is ``log((P_in[S] - delta) / P_out[S])``,
            ``"out/in"`` for the mirror image.
        p_in, p_out: the event's empirical frequency in each world, on the evaluation trials.
        selection_epsilon: the bound of the chosen event on the selection trials.
        trials: evaluation trials per world (the smaller count if they differ).
    """

    epsilon: float
    event: str
    direction: str
    p_in: float
    p_out: float
    selection_epsilon: float
    trials: int


def _event_bounds(scores_in: np.ndarray, scores_out: np.ndarray, thresholds: np.ndarray,
                  delta: float, alpha: float) -> np.ndarray:
    """``(4, T)`` lower bounds on epsilon: rows are the events ``{s >= t}`` (in/out, out/in) and
    ``{s < t}`` (in/out, out/in), columns the thresholds."""
    n_in, n_out = len(scores_in), len(scores_out)
    above_in = n_in - np.searchsorted(np.sort(scores_in), thresholds, side="left")
    above_out = n_out - np.searchsorted(np.sort(scores_out), thresholds, side="left")
    rows = []
    for k_in, k_out in ((above_in, above_out), (n_in - above_in, n_out - above_out)):
        for (k_num, n_num), (k_den, n_den) in (((k_in, n_in), (k_out, n_out)),
                                               ((k_out, n_out), (k_in, n_in))):
            lo, _ = clopper_pearson(k_num, n_num, alpha / 2)
            _, hi = clopper_pearson(k_den, n_den, alpha / 2)
            with np.errstate(divide="ignore"):
                rows.append(np.log(np.maximum(lo - delta, 0.0)) - np.log(hi))
    return np.stack(rows)


def _candidate_thresholds(scores: np.ndarray, per_tail: int = 200, middle: int = 200
                          ) -> np.ndarray:
    """Order statistics of ``scores`` at ranks dense in both tails (where the best events of a
    tight audit live) and evenly spaced in between, always including the minimum and maximum."""
    s = np.sort(scores)
    n = len(s)
    tail = np.unique(np.geomspace(1, max(n // 2, 1), per_tail).astype(int)) - 1
    ranks = np.unique(np.concatenate([tail, n - 1 - tail, np.linspace(0, n - 1, middle)
                                      .astype(int)]))
    return s[ranks]


def epsilon_lower_bound(scores_in, scores_out, delta: float, confidence: float = 0.95,
                        select_fraction: float = 0.25) -> AuditResult:
    """A lower bound on the epsilon of a mechanism, valid with probability ``confidence``.

    Args:
        scores_in: one real score per independent run of the mechanism on ``D'`` (canary in).
        scores_out: the same score per independent run on ``D`` (canary out). The two arrays
            must be i.i.d. within themselves; they need not be independent of each other.
        delta: the ``delta`` of the ``(epsilon, delta)`` guarantee being audited.
        confidence: ``1 - alpha``, the probability that the bound is correct.
        select_fraction: the leading fraction of each array used to choose the event; the
            bound is computed on the rest.

    Returns:
        An :class:`AuditResult`; ``epsilon`` is ``max(0, log((p_lo - delta) / p_hi))`` for the
        event chosen on the leading ``select_fraction`` of each array and evaluated on the rest
        (see the module docstring).
    """
    scores_in = np.asarray(scores_in, dtype=float).ravel()
    scores_out = np.asarray(scores_out, dtype=float).ravel()
    if not 0.0 < select_fraction < 1.0:
        raise ValueError(f"select_fraction must be in (0, 1), got {select_fraction}.")
    cut_in = int(select_fraction * len(scores_in))
    cut_out = int(select_fraction * len(scores_out))
    if min(cut_in, cut_out, len(scores_in) - cut_in, len(scores_out) - cut_out) < 2:
        raise ValueError("Too few trials to both select an event and evaluate it.")
    alpha = 1.0 - confidence
    select_in, eval_in = scores_in[:cut_in], scores_in[cut_in:]
    select_out, eval_out = scores_out[:cut_out], scores_out[cut_out:]

    candidates = np.unique(np.concatenate([_candidate_thresholds(select_in),
                                           _candidate_thresholds(select_out)]))
    # Midpoints too, so that a gap between the worlds (perfect separation) has a threshold inside.
    thresholds = np.unique(np.concatenate([candidates, (candidates[1:] + candidates[:-1]) / 2]))
    selection = _event_bounds(select_in, select_out, thresholds, delta, alpha)
    row = int(np.argmax(selection.max(axis=1)))
    # Among thresholds tied for the best bound (a plateau, e.g. anywhere in a gap between the
    # worlds), take the one nearest the plateau's middle: the most margin on fresh trials.
    tied = np.flatnonzero(selection[row] == selection[row].max())
    middle = (thresholds[tied[0]] + thresholds[tied[-1]]) / 2
    column = int(tied[np.argmin(np.abs(thresholds[tied] - middle))])
    t = thresholds[column : column + 1]
    epsilon = float(_event_bounds(eval_in, eval_out, t, delta, alpha)[row, 0])

    above = row < 2
    p_in = float(np.mean((eval_in >= t[0]) == above))
    p_out = float(np.mean((eval_out >= t[0]) == above))
    return AuditResult(
        epsilon=max(epsilon, 0.0) if math.isfinite(epsilon) else 0.0,
        event=f"score {'>=' if above else '<'} {t[0]:.6g}",
        direction="in/out" if row % 2 == 0 else "out/in",
        p_in=p_in, p_out=p_out,
        selection_epsilon=float(selection[row, column]),
        trials=min(len(eval_in), len(eval_out)),
    )
