"""``pergrad analyze``: train a model (the digits CNN, or your own model on your own data) while
every example's gradient is compared with the rest of its batch, then rank the training examples
most likely mislabeled and explain a few test predictions by training examples."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

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
        "analyze", help="find the training examples that are wrong or harmful (your model and "
                        "data, or the bundled digits)",
        description="Trains a model with pergrad.keras.PerExampleModel and a GradientMonitor that "
                    "scores every training example (loss, margin, EL2N, GraNd, TracIn, "
                    "forgetting, conflict with the rest of its batch), prints a summary per "
                    "epoch, and writes metrics.csv, examples.csv (every example, most suspect "
                    "first), report.png, flagged_examples.png, influence.png (images only) and "
                    "summary.json into --out. Without --model and --data: a small CNN on "
                    "scikit-learn's bundled 8x8 digits (no download).")
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="a saved Keras model (.keras) to train (default: the digits CNN)")
    parser.add_argument("--data", metavar="PATH", default=None,
                        help="training data: a .npz with arrays x and y, a folder of images with "
                             "one sub-folder per class, or a .csv with --label (default: digits)")
    parser.add_argument("--label", metavar="COLUMN", default=None,
                        help="the label column of a --data CSV table")
    parser.add_argument("--loss", metavar="NAME", default=None,
                        help="a Keras loss name, e.g. sparse_categorical_crossentropy, when the "
                             "model is not compiled (default: the model's compiled loss)")
    parser.add_argument("--from-logits", action="store_true",
                        help="with --loss: the model outputs logits, not probabilities")
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
                             "report how well each score finds them (default: 0)")
    parser.add_argument("--test-fraction", type=_fraction, default=0.2, metavar="F",
                        help="with --data: the share held out for validation and the test "
                             "examples explained by TracIn (default: 0.2; 0 holds out nothing)")
    parser.add_argument("--out", default="pergrad-report", metavar="DIR",
                        help="output directory (default: pergrad-report)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


def _aggregator(name: str, seed: int):
    from pergrad import aggregate

    return {"mean": aggregate.mean, "clip": lambda: aggregate.clip_mean(L2_NORM_CLIP),
            "dp": lambda: aggregate.dp_mean(L2_NORM_CLIP, NOISE_MULTIPLIER, seed=seed),
            "median": aggregate.median}[name]()


class _Refused(Exception):
    """A bad input found after parsing: printed as one error line, exit code 2."""


def _build_loss(name: str, from_logits: bool):
    import inspect

    import keras

    try:
        loss = keras.losses.get(name)
    except ValueError:
        raise _Refused(f"unknown loss {name!r}; use a Keras loss name such as "
                       "sparse_categorical_crossentropy") from None
    if not from_logits:
        return loss
    cls = getattr(keras.losses, "".join(p.capitalize() for p in name.split("_")), None)
    if cls is None or "from_logits" not in inspect.signature(cls).parameters:
        raise _Refused(f"--from-logits does not apply to the loss {name!r}")
    return cls(from_logits=True)


def _output_activation(model) -> str | None:
    layer = model.layers[-1] if getattr(model, "layers", None) else None
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None)


def _split(x, y, fraction: float, seed: int):
    from sklearn.model_selection import train_test_split

    index = np.arange(len(y))
    if fraction == 0:
        return index, index[:0]
    labels = np.asarray(y)
    counts = np.unique(labels, return_counts=True)[1] if labels.ndim == 1 else None
    stratify = labels if counts is not None and counts.min() >= 2 \
        and np.issubdtype(labels.dtype, np.integer) else None
    return train_test_split(index, test_size=fraction, random_state=seed, stratify=stratify)


def _load(args):
    """``(model, loss, optimizer, x, y_clean, x_test, y_test, paths, class_names, what)``."""
    import keras

    from pergrad import demo
    from pergrad.analysis import load_data

    if args.data is not None and args.model is None:
        raise _Refused("--data needs --model: the model to train on that data")
    if args.model is not None:
        try:
            model = keras.saving.load_model(args.model)
        except (OSError, ValueError, TypeError) as error:
            raise _Refused(f"cannot load the model {args.model}: {error}") from None
    else:
        model = demo.digits_cnn()
    if args.loss is not None:
        loss = _build_loss(args.loss, args.from_logits)
        if not args.from_logits and "crossentropy" in args.loss \
                and _output_activation(model) in ("linear", None):
            print(f"note: the model's last layer has no softmax or sigmoid; if it outputs "
                  f"logits, add --from-logits (the loss {args.loss!r} expects probabilities)")
    elif args.model is None:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise _Refused(f"the model {args.model} is not compiled with a loss: pass --loss "
                           "NAME (and --from-logits if it outputs logits)")
    optimizer = getattr(model, "optimizer", None) if args.model is not None else None
    optimizer = optimizer or keras.optimizers.Adam(3e-3 if args.model is None else 1e-3)
    if args.data is None:
        (x, y), (x_test, y_test) = demo.load_digits_split(seed=args.seed)
        return (model, loss, optimizer, x, y, x_test, y_test, None, None,
                f"digits: {len(x)} training and {len(x_test)} test images, 8x8")
    shape = tuple(model.inputs[0].shape[1:]) if getattr(model, "inputs", None) else None
    try:
        data = load_data(args.data, label=args.label, image_shape=shape)
    except (OSError, ValueError) as error:
        raise _Refused(str(error)) from None
    train, test = _split(data.x, data.y, args.test_fraction, args.seed)
    paths = [data.paths[i] for i in train] if data.paths else None
    return (model, loss, optimizer, data.x[train], data.y[train], data.x[test], data.y[test],
            paths, data.class_names,
            f"{args.data}: {len(train)} training and {len(test)} held-out examples")


def run(args: argparse.Namespace) -> int:
    import sys

    try:
        return _run(args)
    except _Refused as error:
        print(f"pergrad analyze: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import keras

    from pergrad import PerExample, demo, plot
    from pergrad.analysis import analyze, report
    from pergrad.keras import GradientMonitor, PrivacyCallback

    start = time.perf_counter()
    if keras.backend.backend() == "jax":
        import jax
        jax.config.update("jax_enable_x64", True)  # 64-bit DP noise keys (docs/backends.md)
    keras.utils.set_random_seed(args.seed)
    (model, loss, optimizer, x_train, y_clean, x_test, y_test, paths, class_names,
     what) = _load(args)
    flipped = np.zeros(len(y_clean), bool)
    y_train = y_clean
    if args.label_noise > 0:
        if not np.issubdtype(np.asarray(y_clean).dtype, np.integer) or y_clean.ndim != 1:
            raise _Refused("--label-noise needs integer class labels")
        classes = int(max(y_clean.max(), y_test.max() if len(y_test) else 0)) + 1
        y_train, flipped = demo.flip_labels(y_clean, args.label_noise, seed=args.seed,
                                            num_classes=classes)
    n = len(x_train)
    print(f"{what}; {int(flipped.sum())} training labels flipped; aggregator: {args.aggregator}")
    os.makedirs(args.out, exist_ok=True)

    monitor = GradientMonitor(csv_path=os.path.join(args.out, "metrics.csv"), num_examples=n)
    callbacks = [demo.EpochTable(monitor, n, args.batch_size, args.aggregator == "dp")]
    if args.aggregator == "dp":
        callbacks.insert(0, PrivacyCallback(n, args.batch_size, NOISE_MULTIPLIER, DELTA))
    validation = (x_test, y_test) if len(x_test) else None
    analysis = analyze(model, x_train, y_train, loss=loss, optimizer=optimizer,
                       epochs=args.epochs, batch_size=args.batch_size,
                       aggregator=_aggregator(args.aggregator, args.seed),
                       validation_data=validation, callbacks=callbacks, monitor=monitor)

    true_labels = y_clean if flipped.any() else None
    summary = {
        "data": args.data or "digits", "model": args.model or "digits_cnn",
        "examples": n, "epochs": args.epochs, "batch_size": args.batch_size,
        "aggregator": args.aggregator, "label_noise": args.label_noise, "seed": args.seed,
        "final": {k: float(v[-1]) for k, v in analysis.history.items()},
        "most_suspect": report.suspects(analysis, y_train, 16, paths, class_names),
        "flipped": [{"index": int(i), "given": report.label_text(y_train[i], class_names),
                     "true": report.label_text(y_clean[i], class_names)}
                    for i in np.flatnonzero(flipped)],
    }
    if flipped.any():
        summary["label_noise_detection"] = report.detection_table(analysis, flipped)
    report.write_examples_csv(os.path.join(args.out, "examples.csv"), analysis, y_train, paths,
                              class_names, true_labels)
    plot.training_report(monitor, path=os.path.join(args.out, "report.png"))
    written = ["metrics.csv", "examples.csv", "report.png"]
    images = report.is_image_batch(x_train)
    if images:
        shown = analysis.ranking()[:16]
        captions = [f"suspect #{r + 1}, margin {-analysis.scores['margin'][i]:+.1f}"
                    for r, i in enumerate(shown)]
        plot.flagged_examples(x_train, [report.label_text(v, class_names) for v in y_train],
                              shown, captions=captions,
                              true_labels=None if true_labels is None else
                              [report.label_text(v, class_names) for v in true_labels],
                              heading="The 16 training examples most likely mislabeled",
                              path=os.path.join(args.out, "flagged_examples.png"))
        written.append("flagged_examples.png")
    if len(x_test):
        test_losses = keras.ops.convert_to_numpy(PerExample(model, loss).losses(x_test, y_test))
        chosen = report.explained_test_examples(test_losses, 4)
        influence = analysis.influence(x_train, y_train, x_test[chosen], y_test[chosen])
        summary["influence"] = report.influence_summary(influence, chosen, paths)
        if images:
            plot.influential_examples(influence, x_train, y_train, x_test[chosen],
                                      y_test[chosen], k=4,
                                      path=os.path.join(args.out, "influence.png"),
                                      test_indices=chosen, train_true_labels=true_labels)
            written.append("influence.png")
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    written.append("summary.json")

    print()
    if flipped.any():
        detection = summary["label_noise_detection"]
        print(f"finding the {int(flipped.sum())} flipped labels (k = {int(flipped.sum())}):")
        print(f"  {'ranking by':<16}{'precision@k':>12}{'ROC AUC':>10}")
        for name, found in detection.items():
            print(f"  {name:<16}{found['precision_at_k']:>12.3f}{found['roc_auc']:>10.3f}")
    top = ", ".join(str(s["index"]) for s in summary["most_suspect"][:8])
    print(f"most likely mislabeled (training indices): {top}")
    print(f"wrote {args.out}/{', '.join(written)} in {time.perf_counter() - start:.0f} s")
    return 0
