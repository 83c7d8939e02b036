"""How well ``pergrad analyze`` finds synthetic label noise, against cleanlab
(``pergrad bench --suites label-errors``).

Data that ships with a package (no download): scikit-learn's 8x8 digits (1,797 images, the
digits CNN of ``pergrad analyze``), breast cancer (569 rows, 30 features, 2 classes), wine (178,
13, 3), a synthetic 5-class set (``make_classification``, 600 rows, 20 features) and the
Palmer penguins (333 complete rows, 4 measurements, 3 species; the ``palmerpenguins`` package).
Tables are standardized and learned by an MLP (Dense 64 relu, Dense 64 relu, logits). Noise:
*symmetric* (a share of all rows gets a uniformly drawn other label) and *class-dependent* (a
share of each source class gets one fixed confusable label), at 10% and 25%.

Per row of the table, on every row of the data:

* **pergrad**: one ``pergrad.analysis.analyze`` training run on all rows, ranked by its
  ``default`` score (the training dynamics, what ``pergrad analyze`` ranks by), and each single
  score.
* **cleanlab**: its recipe, label-quality scores (``cleanlab.rank.get_label_quality_scores``,
  self-confidence) on 5-fold out-of-sample probabilities of the same Keras model, optimizer and
  epochs (``pergrad.analysis.cross_fitted_probabilities``, the cross-fitting ``pergrad analyze
  --folds 5`` runs for its suggested labels; its ``self_confidence`` column is this score).

Each reports ROC AUC and precision@k (k = the number of flipped labels), and the wall time of
each method (training included). ``--quick`` runs one digits row with fewer epochs and folds.

    python benchmarks/bench_label_errors.py            # the table in docs/analysis.md
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import keras
import numpy as np
from sklearn.datasets import load_breast_cancer, load_wine, make_classification
from sklearn.preprocessing import StandardScaler

from pergrad.bench.timing import script_main
from pergrad.demo import detection_scores, digits_cnn, flip_classes, flip_labels, load_digits_images

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RATES = (0.1, 0.25)
NOISE = ("symmetric", "class-dependent")
#: The columns of the table: pergrad's default, some of its single scores, cleanlab.
COLUMNS = ("default", "loss", "margin", "error_norm", "gradient_norm", "forgetting", "cleanlab")


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

    def optimizer(self) -> keras.optimizers.Optimizer:
        return keras.optimizers.Adam(self.learning_rate)


def _standardized(x: np.ndarray) -> np.ndarray:
    return StandardScaler().fit_transform(x).astype(np.float32)


def _penguins() -> tuple[np.ndarray, np.ndarray]:
    from palmerpenguins import load_penguins

    table = load_penguins()
    columns = ["bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g"]
    table = table.dropna(subset=[*columns, "species", "sex"])
    species = sorted(table["species"].unique())
    labels = table["species"].map({s: i for i, s in enumerate(species)}).to_numpy(np.int64)
    return _standardized(table[columns].to_numpy(np.float64)), labels


def tasks(quick: bool = False) -> list[Task]:
    x, y = load_digits_images()
    found = [Task("digits", x, y, 10, {2: 7, 3: 8, 5: 6, 6: 5, 7: 1}, 2 if quick else 8, 64,
                  3e-3)]
    if quick:
        return found
    cancer, wine = load_breast_cancer(), load_wine()
    synthetic_x, synthetic_y = make_classification(
        600, 20, n_informative=10, n_redundant=4, n_classes=5, n_clusters_per_class=1,
        class_sep=1.5, random_state=0)
    return found + [
        Task("breast_cancer", _standardized(cancer.data), cancer.target.astype(np.int64), 2,
             {1: 0}, 30, 32, 1e-3),
        Task("wine", _standardized(wine.data), wine.target.astype(np.int64), 3, {1: 0, 2: 1},
             60, 16, 1e-3),
        Task("penguins", *_penguins(), 3, {0: 1, 1: 2, 2: 0}, 60, 16, 1e-3),
        Task("synthetic", _standardized(synthetic_x), synthetic_y.astype(np.int64), 5,
             {0: 1, 1: 2, 2: 3, 3: 4, 4: 0}, 30, 32, 1e-3),
    ]


def noisy_labels(task: Task, noise: str, rate: float, seed: int = 0):
    if noise == "symmetric":
        return flip_labels(task.y, rate, seed=seed, num_classes=task.classes)
    return flip_classes(task.y, task.confusions, rate, seed=seed)


def _cross_fit(task: Task, labels: np.ndarray, folds: int, seed: int) -> np.ndarray:
    from pergrad.analysis import cross_fitted_probabilities

    keras.utils.set_random_seed(seed)
    return cross_fitted_probabilities(task.model(), task.x, labels, loss=LOSS,
                                      optimizer=task.optimizer(), from_logits=True, folds=folds,
                                      epochs=task.epochs, batch_size=task.batch_size, seed=seed)


def pergrad_scores(task: Task, labels: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    """The scores of one monitored training run on all rows (``pergrad analyze
    --test-fraction 0``)."""
    from pergrad.analysis import analyze

    keras.utils.set_random_seed(seed)
    result = analyze(task.model(), task.x, labels, loss=LOSS, optimizer=task.optimizer(),
                     epochs=task.epochs, batch_size=task.batch_size)
    return dict(result.scores)


def cleanlab_scores(task: Task, labels: np.ndarray, folds: int = 5, seed: int = 0
                    ) -> np.ndarray:
    """``1 - `` cleanlab's label quality on ``folds``-fold out-of-sample probabilities."""
    from cleanlab.rank import get_label_quality_scores

    probabilities = _cross_fit(task, labels, folds, seed)
    return 1.0 - get_label_quality_scores(labels, probabilities)


def run(quick: bool = False, seed: int = 0) -> list[dict]:
    baseline_folds = 2 if quick else 5
    rows = []
    for task in tasks(quick):
        for noise in NOISE[:1] if quick else NOISE:
            for rate in RATES[:1] if quick else RATES:
                labels, flipped = noisy_labels(task, noise, rate, seed)
                start = time.perf_counter()
                scores = pergrad_scores(task, labels, seed)
                ours = time.perf_counter() - start
                start = time.perf_counter()
                scores["cleanlab"] = cleanlab_scores(task, labels, baseline_folds, seed)
                theirs = time.perf_counter() - start
                row = {"dataset": task.name, "noise": noise, "rate": rate,
                       "flipped": int(flipped.sum()), "examples": len(flipped),
                       "cleanlab_folds": baseline_folds,
                       "pergrad_seconds": ours, "cleanlab_seconds": theirs}
                for name in COLUMNS:
                    found = detection_scores(scores[name], flipped)
                    row[f"{name}_auc"] = found["roc_auc"]
                    row[f"{name}_p@k"] = found["precision_at_k"]
                rows.append(row)
                print(markdown([row], header=len(rows) == 1), flush=True)
    return rows


def markdown(rows: list[dict], header: bool = True) -> str:
    """ROC AUC / precision@k per column; pergrad's default in bold where it is at least
    cleanlab's on both measures; wall times of both methods."""
    lines = []
    if header:
        lines.append("| dataset | noise | flipped | " + " | ".join(COLUMNS)
                     + " | pergrad s | cleanlab s |")
        lines.append("|---|---|---|" + "---|" * (len(COLUMNS) + 2))
    for row in rows:
        ahead = row["default_auc"] >= row["cleanlab_auc"] \
            and row["default_p@k"] >= row["cleanlab_p@k"]
        cells = []
        for name in COLUMNS:
            text = f"{row[f'{name}_auc']:.3f} / {row[f'{name}_p@k']:.2f}"
            cells.append(f"**{text}**" if name == "default" and ahead else text)
        lines.append(f"| {row['dataset']} | {row['noise']} {round(100 * row['rate'])}% | "
                     f"{row['flipped']} of {row['examples']} | " + " | ".join(cells)
                     + f" | {row['pergrad_seconds']:.0f} | {row['cleanlab_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def add_arguments(parser):
        parser.add_argument("--seed", type=int, default=0, help="noise and training seed")

    return script_main("ROC AUC / precision@k of pergrad's label-error scores and cleanlab's "
                       "on synthetic noise.", run, markdown, argv,
                       quick_help="one digits row, 2 epochs, cleanlab on 2 folds",
                       add_arguments=add_arguments)
