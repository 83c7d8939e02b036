"""Label-error scores from a ``GradientMonitor``'s per-example table: higher means more suspect.

Every score is a function of the running sums the monitor keeps over the monitored steps
``t in T_i`` in which training example ``i`` appeared (``n_i = |T_i|``), with ``g_i(w_t)`` its
gradient, ``l_i(w_t)`` its loss and ``eta_t`` the learning rate of step ``t``:

=================  =========================================================================
score              definition (higher = more likely mislabeled or harmful)
=================  =========================================================================
``loss``           mean loss ``(1/n_i) sum_t l_i(w_t)``
``last_loss``      the loss at the latest step that saw ``i``
``margin``         ``-AUM_i = -(1/n_i) sum_t m_i(w_t)``, ``m = z_y - max_{k != y} z_k``
                   (Pleiss et al. 2020)
``error_norm``     EL2N ``(1/n_i) sum_t ||softmax(z_i(w_t)) - onehot(y_i)||`` (Paul et al. 2021)
``gradient_norm``  GraNd ``(1/n_i) sum_t ||g_i(w_t)||`` (Paul et al. 2021)
``self_influence`` TracIn ``sum_t eta_t ||g_i(w_t)||^2`` (Pruthi et al. 2020)
``forgetting``     forgetting events (correct at one presentation, wrong at the next; Toneva et
                   al. 2019); an example never classified correctly scores ``n_i + 1``, above
                   any possible count
``conflict``       ``-(1/n_i) sum_t cosine_to_rest_i(w_t)``: how much ``g_i`` opposes the
                   consensus of the rest of its batches
                   (:func:`pergrad.stats.formulas.consensus_statistics`)
``default``        :data:`DEFAULT_SCORE`, the ranking ``pergrad analyze`` shows
=================  =========================================================================

Paul et al. and Toneva et al. evaluate their scores at fixed points of several training runs;
here they are accumulated along one run, at the cost of norms (they use only ``||g_i||``,
``cosine_to_rest`` and the outputs the training step already has).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata

#: The single scores of :func:`label_error_scores`, in the order tables show them.
SINGLE_SCORES = ("loss", "last_loss", "margin", "error_norm", "gradient_norm", "self_influence",
                 "forgetting", "conflict")

#: The scores averaged (by rank) into ``default``: validated by ``pergrad bench --suites
#: label-errors`` (docs/analysis.md has the table).
DEFAULT_SCORE = ("loss", "error_norm")


def rank_average(*scores: np.ndarray) -> np.ndarray:
    """The mean of the scores' ranks scaled to ``[0, 1]`` (ties share their mean rank; NaN, an
    example never seen, ranks lowest). Averaging ranks, not values, makes scores of different
    units comparable and keeps one score's outliers from deciding alone."""
    if not scores:
        raise ValueError("rank_average needs at least one score.")
    ranks = []
    for score in scores:
        s = np.asarray(score, np.float64)
        filled = np.where(np.isnan(s), -np.inf, s)
        ranks.append((rankdata(filled) - 1) / max(len(s) - 1, 1))
    return np.mean(ranks, axis=0)


def label_error_scores(table: dict[str, np.ndarray],
                       default: tuple[str, ...] = DEFAULT_SCORE) -> dict[str, np.ndarray]:
    """``{score name: (N,) float64}`` from ``GradientMonitor.example_table()``, higher = more
    suspect (definitions in the module docstring). Classifier scores (``margin``,
    ``error_norm``, ``forgetting``) are NaN for a model the monitor could not read as a
    classifier; examples never seen are NaN everywhere. ``default`` is the rank average of the
    named scores (those that are all NaN are left out)."""
    classified = table["classified"] > 0
    forgetting = np.where(classified & ~table["learned"], table["classified"] + 1.0,
                          table["forgetting_events"].astype(np.float64))
    scores = {
        "loss": table["mean_loss"],
        "last_loss": table["last_loss"],
        "margin": -table["mean_margin"],
        "error_norm": table["mean_error_norm"],
        "gradient_norm": table["mean_norm"],
        "self_influence": table["self_influence"],
        "forgetting": np.where(classified, forgetting, np.nan),
        "conflict": -table["mean_cosine_to_rest"],
    }
    scores = {k: np.asarray(v, np.float64) for k, v in scores.items()}
    unknown = [name for name in default if name not in scores]
    if unknown:
        raise ValueError(f"Unknown scores {unknown}; choose from {list(SINGLE_SCORES)}.")
    usable = [scores[name] for name in default if not np.all(np.isnan(scores[name]))]
    if not usable:
        usable = [scores["loss"]]
    seen = table["seen"] > 0
    scores["default"] = np.where(seen, rank_average(*usable), np.nan)
    return scores


def ranking(score: np.ndarray) -> np.ndarray:
    """Example indices from most to least suspect (NaN last; ties keep index order)."""
    s = np.asarray(score, np.float64)
    return np.argsort(-np.where(np.isnan(s), -np.inf, s), kind="stable")
