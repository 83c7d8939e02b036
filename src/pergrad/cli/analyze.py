"""``pergrad analyze``: train a CNN on the bundled digits while comparing every example's gradient
with the batch gradient, then show the examples that fight the rest."""

from __future__ import annotations

import argparse
import json
import os
import time

AGGREGATORS = ("mean", "clip", "dp", "median")
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
DELTA = 1e-5


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 0.5], got {text!r}") from None
    if not 0.0 <= value <= 0.5:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 0.5], got {text!r}") from None
    return value


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "analyze", help="train on the bundled digits and find the examples that fight the rest",
        description="Trains a small CNN on scikit-learn's bundled 8x8 digits (1,797 images, no "
                    "download) with pergrad.keras.PerExampleModel and a GradientMonitor, prints a "
                    "summary per epoch, and writes the metrics CSV, a training report, the most "
                    "conflicting examples and summary.json into --out.")
    parser.add_argument("--epochs", type=_positive_int, default=8, help="epochs (default: 8)")
    parser.add_argument("--batch-size", type=_positive_int, default=64,
                        help="batch size (default: 64)")
    parser.add_argument("--aggregator", choices=AGGREGATORS, default="mean",
                        help=f"how per-example gradients become the update: mean, clip (clipped "
                             f"mean, C={L2_NORM_CLIP}), dp (DP-SGD, C={L2_NORM_CLIP}, sigma="
                             f"{NOISE_MULTIPLIER}, epsilon reported at delta={DELTA}), median "
                             "(coordinate-wise) (default: mean)")
    parser.add_argument("--label-noise", type=_fraction, default=0.0, metavar="P",
                        help="flip the labels of this fraction of training examples first and "
                             "report how well gradient conflict finds them (default: 0)")
    parser.add_argument("--out", default="pergrad-report", metavar="DIR",
                        help="output directory (default: pergrad-report)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


def _aggregator(name: str, seed: int):
    from pergrad import aggregate

    return {"mean": aggregate.mean, "clip": lambda: aggregate.clip_mean(L2_NORM_CLIP),
            "dp": lambda: aggregate.dp_mean(L2_NORM_CLIP, NOISE_MULTIPLIER, seed=seed),
            "median": aggregate.median}[name]()


def run(args: argparse.Namespace) -> int:
    import keras
    import numpy as np

    from pergrad import PerExample, demo, plot
    from pergrad.keras import INDEX_KEY, GradientMonitor, PerExampleModel, PrivacyCallback

    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    keras.utils.set_random_seed(args.seed)
    (x_train, y_clean), (x_test, y_test) = demo.load_digits_split(seed=args.seed)
    y_train, flipped = demo.flip_labels(y_clean, args.label_noise, seed=args.seed)
    n = len(x_train)
    print(f"digits: {n} training and {len(x_test)} test images, 8x8; "
          f"{int(flipped.sum())} training labels flipped; aggregator: {args.aggregator}")

    monitor = GradientMonitor(csv_path=os.path.join(args.out, "metrics.csv"), num_examples=n)
    model = PerExampleModel(demo.digits_cnn(), aggregator=_aggregator(args.aggregator, args.seed),
                            monitor=monitor)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=loss, metrics=["accuracy"])
    callbacks = [demo.EpochTable(monitor, n, args.batch_size, args.aggregator == "dp")]
    if args.aggregator == "dp":
        callbacks.insert(0, PrivacyCallback(n, args.batch_size, NOISE_MULTIPLIER, DELTA))
    history = model.fit({"image": x_train, INDEX_KEY: np.arange(n)}, y_train,
                        batch_size=args.batch_size, epochs=args.epochs,
                        validation_data=(x_test, y_test), callbacks=callbacks, verbose=0)

    table = monitor.example_table()
    order = monitor.most_conflicting(n)
    conflict = -np.nan_to_num(table["mean_cosine_to_rest"], nan=0.0)  # high: fights the rest
    opposed = np.nan_to_num(table["opposed_fraction"], nan=0.0)
    final_losses = PerExample(model.model, loss).losses(x_train, y_train).numpy()
    summary = {
        "examples": n, "epochs": args.epochs, "batch_size": args.batch_size,
        "aggregator": args.aggregator, "label_noise": args.label_noise, "seed": args.seed,
        "final": {k: float(v[-1]) for k, v in history.history.items()},
        "most_conflicting": [int(i) for i in order[:16]],
        "mean_cosine_to_rest_of_most_conflicting": [float(table["mean_cosine_to_rest"][i])
                                                    for i in order[:16]],
        "flipped": [{"index": int(i), "given": int(y_train[i]), "true": int(y_clean[i])}
                    for i in np.flatnonzero(flipped)],
    }
    if flipped.any():
        summary["label_noise_detection"] = {
            "conflict_with_rest": demo.detection_scores(conflict, flipped),
            "opposed_to_batch_gradient": demo.detection_scores(opposed, flipped),
            "per_example_loss": demo.detection_scores(final_losses, flipped),
        }
    plot.training_report(monitor, path=os.path.join(args.out, "report.png"))
    plot.conflicting_examples(monitor, x_train[..., 0], y_train, k=16,
                              path=os.path.join(args.out, "conflicting_examples.png"),
                              true_labels=y_clean if flipped.any() else None)
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)

    print()
    if flipped.any():
        detection = summary["label_noise_detection"]
        print(f"finding the {int(flipped.sum())} flipped labels (k = {int(flipped.sum())}):")
        print(f"  {'ranking by':<22}{'precision@k':>12}{'ROC AUC':>10}")
        for name, key in (("conflict with the rest", "conflict_with_rest"),
                          ("opposed to batch grad", "opposed_to_batch_gradient"),
                          ("final per-example loss", "per_example_loss")):
            print(f"  {name:<22}{detection[key]['precision_at_k']:>12.3f}"
                  f"{detection[key]['roc_auc']:>10.3f}")
    print(f"wrote {args.out}/metrics.csv, report.png, conflicting_examples.png, summary.json "
          f"in {time.perf_counter() - start:.0f} s")
    return 0
