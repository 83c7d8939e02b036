"""Writing what ``pergrad analyze`` found to files: ``examples.csv`` (every row of the data),
``label_issues.csv`` (the rows flagged as mislabeled), the pieces of ``summary.json`` and a
corrected copy of the data (``--fix``).

Examples are named as the user knows them: by their row in the data file (``row``), the CSV's
id column (``id``) and the image file (``path``), from a :class:`~pergrad.analysis.Dataset`.
"""

from __future__ import annotations

import csv
import os
from typing import Any

import numpy as np

from pergrad.analysis.data import Dataset
from pergrad.demo.detection import detection_scores
from pergrad.stats import Influence
from pergrad.stats.label_errors import ranking


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


def identity(data: Dataset, i: int) -> dict[str, Any]:
    """``{"row", "id"?, "path"?}``: how the user's file names example ``i`` of ``data``."""
    item: dict[str, Any] = {"row": int(data.rows[i])}
    if data.ids is not None:
        item["id"] = data.ids[i]
    if data.paths is not None:
        item["path"] = data.paths[i]
    return item


def identity_columns(data: Dataset) -> list[str]:
    return ["row"] + (["id"] if data.ids is not None else []) \
        + (["path"] if data.paths is not None else [])


def _cell(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return "" if np.isnan(value) else f"{value:.6g}"
    return value


def write_examples_csv(path: str, data: Dataset, labels: np.ndarray, scores: dict[str, np.ndarray],
                       names: tuple[str, ...], split: np.ndarray, seen: np.ndarray,
                       extra: dict[str, list] | None = None, true_labels: Any = None) -> None:
    """One line per row of ``data``, most suspect first by ``scores["default"]``: ``rank``,
    the row's identity, ``split`` (train or validation), ``given`` label, ``true`` label (noise
    injected), the ``extra`` columns (e.g. ``suggested``, ``flagged_by``), ``seen`` (how many
    monitored steps saw it), then the scores ``names`` (empty where a score does not apply)."""
    extra = extra or {}
    header = ["rank", *identity_columns(data), "split", "given"] \
        + (["true"] if true_labels is not None else []) + list(extra) + ["seen", *names]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for rank, i in enumerate(ranking(scores["default"]), start=1):
            row = [rank, *identity(data, i).values(), split[i],
                   label_text(labels[i], data.class_names)]
            if true_labels is not None:
                row.append(label_text(true_labels[i], data.class_names))
            row += [values[i] for values in extra.values()]
            row.append(int(seen[i]))
            row += [_cell(scores[n][i]) for n in names]
            writer.writerow(row)


def write_label_issues_csv(path: str, data: Dataset, labels: np.ndarray, flagged: np.ndarray,
                           suggested: np.ndarray, probabilities: np.ndarray,
                           order: np.ndarray) -> int:
    """The ``flagged`` rows, most suspect first (``order``): identity, ``given`` and
    ``suggested`` labels with their predicted probabilities. Returns the number written."""
    header = [*identity_columns(data), "given", "suggested", "p_given", "p_suggested"]
    written = 0
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for i in order:
            if not flagged[i]:
                continue
            given, better = int(labels[i]), int(suggested[i])
            writer.writerow([*identity(data, i).values(), label_text(given, data.class_names),
                             label_text(better, data.class_names),
                             f"{probabilities[i, given]:.4g}", f"{probabilities[i, better]:.4g}"])
            written += 1
    return written


def flagged_by(scores: dict[str, np.ndarray], names: tuple[str, ...], top: int) -> list[str]:
    """Per example, the scores (``;``-separated) that put it among their ``top`` most suspect:
    which evidence flagged it."""
    n = len(next(iter(scores.values())))
    found: list[list[str]] = [[] for _ in range(n)]
    for name in names:
        values = scores[name]
        if np.all(np.isnan(values)):
            continue
        for i in ranking(values)[:top]:
            if not np.isnan(values[i]):
                found[i].append(name)
    return [";".join(f) for f in found]


def detection_table(scores: dict[str, np.ndarray], names: tuple[str, ...],
                    flipped: np.ndarray) -> dict[str, dict[str, float]]:
    """ROC AUC and precision@k of every score for finding the ``flipped`` examples, over the
    examples the score covers (a score that is NaN on some rows is judged on the others)."""
    table = {}
    for name in names:
        values = scores[name]
        known = ~np.isnan(values)
        if known.any():
            table[name] = detection_scores(values[known], flipped[known])
    return table


def explained_test_examples(test_losses: np.ndarray, count: int = 4) -> np.ndarray:
    """Which test examples to explain: half with the highest loss (the model's worst
    predictions), half with the lowest (its surest), worst first."""
    order = np.argsort(-np.nan_to_num(test_losses, nan=-np.inf), kind="stable")
    worst = order[: (count + 1) // 2]
    best = [i for i in order[::-1] if i not in set(worst)][: count // 2]
    return np.concatenate([worst, np.asarray(best, worst.dtype)])


def influence_summary(influence: Influence, data: Dataset, train: np.ndarray,
                      test: np.ndarray, k: int = 4) -> list[dict]:
    """Per explained test example (dataset positions ``test``): its most helpful and most
    harmful training examples (``influence`` columns are the positions ``train``)."""
    def entry(j, column):
        return {**identity(data, train[column]), "tracin": float(influence.scores[j, column])}

    return [{"test": identity(data, t),
             "most_helpful": [entry(j, c) for c in influence.helpful(k)[j]],
             "most_harmful": [entry(j, c) for c in influence.harmful(k)[j]]}
            for j, t in enumerate(test)]


def suspects(data: Dataset, labels: np.ndarray, score: np.ndarray, count: int,
             suggested: np.ndarray | None = None) -> list[dict]:
    """The ``count`` most suspect rows: identity, given label, default score and, for a
    classifier, the suggested label."""
    out = []
    for i in ranking(score)[:count]:
        item = {**identity(data, i), "given": label_text(labels[i], data.class_names),
                "score": float(score[i])}
        if suggested is not None:
            item["suggested"] = label_text(suggested[i], data.class_names)
        out.append(item)
    return out


def write_fixed_copy(data: Dataset, out: str, labels: np.ndarray, flagged: np.ndarray,
                     suggested: np.ndarray, drop: bool) -> int:
    """Write a copy of ``data``'s file to ``out`` with the ``flagged`` rows relabelled to
    ``suggested`` (or left out with ``drop``); the input file is never written. An ``.npz``
    copy holds ``x`` and ``y``; a CSV copy keeps every column and line of the original.
    Returns the number of rows changed or dropped."""
    source = data.source
    if os.path.exists(out) and os.path.samefile(out, source):
        raise ValueError(f"--fix {out} is the input file; name a new file for the copy.")
    new_labels = np.where(flagged, suggested, labels).astype(np.asarray(labels).dtype)
    keep = ~flagged if drop else np.ones(len(labels), bool)
    if source.lower().endswith(".npz"):
        if not out.lower().endswith(".npz"):
            raise ValueError(f"--fix {out}: the data is a .npz file; name a .npz copy.")
        np.savez(out, x=data.x[keep], y=new_labels[keep])
        return int(flagged.sum())
    if source.lower().endswith(".csv"):
        if not out.lower().endswith(".csv"):
            raise ValueError(f"--fix {out}: the data is a CSV table; name a .csv copy.")
        _write_fixed_table(source, out, data, new_labels, keep)
        return int(flagged.sum())
    raise ValueError("--fix writes a corrected .npz or .csv; for an image folder, move the "
                     "files listed in label_issues.csv to the folder of their suggested class.")


def _write_fixed_table(source: str, out: str, data: Dataset, labels: np.ndarray,
                       keep: np.ndarray) -> None:
    with open(source, newline="") as handle:
        lines = list(csv.reader(handle))
    header, body = lines[0], [row for row in lines[1:] if row]
    column = header.index(data.label_column)
    with open(out, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for i, row in enumerate(body):
            if not keep[i]:
                continue
            row = list(row)
            row[column] = str(label_text(labels[i], data.class_names))
            writer.writerow(row)
