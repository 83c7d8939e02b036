"""How well each label-error score finds synthetic label noise (``pergrad bench --suites
label-errors``).

Datasets that ship with scikit-learn (no download): the 8x8 digits (the training split of
``pergrad analyze``, 1,437 images, its CNN), breast cancer (569 examples, 30 features, 2
classes) and wine (178 examples, 13 features, 3 classes), both standardized, with an MLP
(Dense 64 relu, Dense 64 relu, logits). Noise: *symmetric* (a share of all examples gets a
uniformly drawn other label) and *class-dependent* (a share of the examples of each source class
gets one fixed confusable label: digits 2->7, 3->8, 5->6, 6->5, 7->1; breast cancer benign ->
malignant; wine 1->0, 2->1), at 10% and 30%. Every row trains the model once with
``pergrad.analysis.analyze`` (mean aggregation, Adam) and reports, per score of
:func:`pergrad.stats.label_error_scores`, ROC AUC and precision@k (k = the number of flipped
labels). ``--quick`` runs the digits rows only, with fewer epochs.

    python benchmarks/bench_label_errors.py            # the table in docs/analysis.md
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.preprocessing import StandardScaler

from pergrad.bench.timing import script_main
from pergrad.demo import detection_scores, digits_cnn, flip_classes, flip_labels, load_digits_split
from pergrad.stats import SINGLE_SCORES

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RATES = (0.1, 0.3)
NOISE = ("symmetric", "class-dependent")


@dataclass(frozen=True)
class Task:
    name: str
    x: np.ndarray
    y: np.ndarray
    classes: int
    confusions: dict[int, int]
    epochs: int
    batch_size: int
    learning_rate: float

    def model(self) -> keras.Model:
        if self.name == "digits":
            return digits_cnn()
        return keras.Sequential([keras.Input(self.x.shape[1:]),
                                 keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(self.classes)], name=f"{self.name}_mlp")


def _tabular(loader) -> tuple[np.ndarray, np.ndarray]:
    data = loader()
    return StandardScaler().fit_transform(data.data).astype(np.float32), data.target.astype(np.int64)


def tasks(quick: bool = False) -> list[Task]:
    (x, y), _ = load_digits_split(seed=0)
    found = [Task("digits", x, y, 10, {2: 7, 3: 8, 5: 6, 6: 5, 7: 1}, 4 if quick else 8, 64, 3e-3)]
    if not quick:
        found.append(Task("breast_cancer", *_tabular(load_breast_cancer), 2, {1: 0}, 30, 32, 1e-3))
        found.append(Task("wine", *_tabular(load_wine), 3, {1: 0, 2: 1}, 60, 16, 1e-3))
    return found


def noisy_labels(task: Task, noise: str, rate: float, seed: int = 0):
    if noise == "symmetric":
        return flip_labels(task.y, rate, seed=seed, num_classes=task.classes)
    return flip_classes(task.y, task.confusions, rate, seed=seed)


def detect(task: Task, noise: str, rate: float, seed: int = 0) -> dict[str, np.ndarray]:
    """The scores of one training run with noisy labels, and the flipped mask (key
    ``"flipped"``)."""
    from pergrad.analysis import analyze

    labels, flipped = noisy_labels(task, noise, rate, seed)
    keras.utils.set_random_seed(seed)
    result = analyze(task.model(), task.x, labels, loss=LOSS,
                     optimizer=keras.optimizers.Adam(task.learning_rate), epochs=task.epochs,
                     batch_size=task.batch_size)
    return {**result.scores, "flipped": flipped}


def run(quick: bool = False, seed: int = 0) -> list[dict]:
    rows = []
    for task in tasks(quick):
        for noise in NOISE:
            for rate in RATES[:1] if quick else RATES:
                scores = detect(task, noise, rate, seed)
                flipped = scores.pop("flipped")
                row = {"dataset": task.name, "noise": noise, "rate": rate,
                       "flipped": int(flipped.sum()), "examples": len(flipped)}
                for name, score in scores.items():
                    found = detection_scores(score, flipped)
                    row[f"{name}_auc"] = found["roc_auc"]
                    row[f"{name}_p@k"] = found["precision_at_k"]
                rows.append(row)
                print(markdown([row], header=len(rows) == 1), flush=True)
    return rows


def markdown(rows: list[dict], header: bool = True) -> str:
    """ROC AUC / precision@k per score; the best single score of each row in bold."""
    names = ("default", *SINGLE_SCORES)
    lines = []
    if header:
        lines.append("| dataset | noise | flipped | " + " | ".join(names) + " |")
        lines.append("|---|---|---|" + "---|" * len(names))
    for row in rows:
        best = max(row[f"{n}_auc"] for n in SINGLE_SCORES)
        cells = []
        for n in names:
            text = f"{row[f'{n}_auc']:.3f} / {row[f'{n}_p@k']:.2f}"
            cells.append(f"**{text}**" if n != "default" and row[f"{n}_auc"] == best else text)
        lines.append(f"| {row['dataset']} | {row['noise']} {round(100 * row['rate'])}% | "
                     f"{row['flipped']} of {row['examples']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return script_main("ROC AUC / precision@k of every label-error score on synthetic noise.",
                       run, markdown, argv, quick_help="digits only, 4 epochs")
