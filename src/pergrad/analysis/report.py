"""Writing an :class:`~pergrad.analysis.Analysis` to files: ``examples.csv`` (one row per
training example), the pictures and the pieces of ``summary.json``."""

from __future__ import annotations

import csv
from typing import Any

import numpy as np

from pergrad.analysis.run import Analysis
from pergrad.demo.detection import detection_scores
from pergrad.stats import SINGLE_SCORES, Influence


def is_image_batch(x: Any) -> bool:
    """``(N, H, W)`` or ``(N, H, W, C)`` with ``C`` in 1, 3, 4: something ``imshow`` can draw."""
    x = np.asarray(x) if not isinstance(x, dict) else None
    return x is not None and (x.ndim == 3 or (x.ndim == 4 and x.shape[-1] in (1, 3, 4)))


def label_text(label: Any, class_names: list[str] | None) -> Any:
    value = np.asarray(label)
    index = int(np.argmax(value)) if value.ndim >= 1 and value.size > 1 else value.item()
    if class_names is not None and isinstance(index, (int, np.integer)) \
            and 0 <= index < len(class_names):
        return class_names[index]
    return index.item() if isinstance(index, np.generic) else index


def write_examples_csv(path: str, analysis: Analysis, labels: Any,
                       paths: list[str] | None = None, class_names: list[str] | None = None,
                       true_labels: Any = None) -> None:
    """One row per training example, most suspect first: ``rank``, ``index``, ``path`` (files),
    ``given`` label, ``true`` label (noise injected), ``seen``, then every score."""
    order = analysis.ranking()
    names = ("default", *SINGLE_SCORES)
    header = ["rank", "index"] + (["path"] if paths else []) + ["given"] \
        + (["true"] if true_labels is not None else []) + ["seen", *names]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for rank, i in enumerate(order, start=1):
            row = [rank, int(i)] + ([paths[i]] if paths else []) \
                + [label_text(labels[i], class_names)]
            if true_labels is not None:
                row.append(label_text(true_labels[i], class_names))
            row.append(int(analysis.table["seen"][i]))
            row += [f"{analysis.scores[n][i]:.6g}" for n in names]
            writer.writerow(row)


def detection_table(analysis: Analysis, flipped: np.ndarray) -> dict[str, dict[str, float]]:
    """ROC AUC and precision@k of every score for finding the ``flipped`` examples."""
    return {name: detection_scores(analysis.scores[name], flipped)
            for name in ("default", *SINGLE_SCORES)}


def explained_test_examples(test_losses: np.ndarray, count: int = 4) -> np.ndarray:
    """Which test examples to explain: half with the highest loss (the model's worst
    predictions), half with the lowest (its surest), worst first."""
    order = np.argsort(-np.nan_to_num(test_losses, nan=-np.inf), kind="stable")
    worst = order[: (count + 1) // 2]
    best = [i for i in order[::-1] if i not in set(worst)][: count // 2]
    return np.concatenate([worst, np.asarray(best, worst.dtype)])


def influence_summary(influence: Influence, test_indices: np.ndarray, paths: list[str] | None,
                      k: int = 4) -> list[dict]:
    """Per explained test example: its most helpful and most harmful training examples."""
    def entry(j, i):
        item = {"index": int(i), "tracin": float(influence.scores[j, i])}
        if paths:
            item["path"] = paths[i]
        return item

    return [{"test_index": int(t),
             "most_helpful": [entry(j, i) for i in influence.helpful(k)[j]],
             "most_harmful": [entry(j, i) for i in influence.harmful(k)[j]]}
            for j, t in enumerate(test_indices)]


def suspects(analysis: Analysis, labels: Any, count: int, paths: list[str] | None,
             class_names: list[str] | None) -> list[dict]:
    """The ``count`` most suspect training examples with their label and default score."""
    out = []
    for i in analysis.ranking()[:count]:
        item = {"index": int(i), "given": label_text(labels[i], class_names),
                "score": float(analysis.scores["default"][i])}
        if paths:
            item["path"] = paths[i]
        out.append(item)
    return out
