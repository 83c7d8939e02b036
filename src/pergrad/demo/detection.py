"""How well a ranking of training examples finds the corrupted ones."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score


def detection_scores(score: np.ndarray, corrupted: np.ndarray) -> dict[str, float]:
    """``precision_at_k`` (k = number corrupted: the share of corrupted examples among the k
    highest scores) and ``roc_auc`` (probability that a corrupted example outscores a clean
    one; 0.5 is random ranking)."""
    corrupted = np.asarray(corrupted, bool)
    k = int(corrupted.sum())
    if k == 0 or k == len(corrupted):
        return {"precision_at_k": float("nan"), "roc_auc": float("nan"), "k": k}
    top = np.argsort(-np.asarray(score), kind="stable")[:k]
    return {"precision_at_k": float(corrupted[top].mean()),
            "roc_auc": float(roc_auc_score(corrupted, score)), "k": k}
