"""``pergrad analyze``: train a model (the digits CNN, or your own model on your own data) while
every example's gradient is compared with the rest of its batch, then rank the training examples
most likely mislabeled and explain a few test predictions by training examples."""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
import zipfile

import numpy as np

AGGREGATORS = ("mean", "clip", "dp", "median")
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
DELTA = 1e-5


def _integer(text: str, accept, expected: str) -> int:
    """``int(text)`` if ``accept`` takes it, else an argparse error naming ``expected``."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not accept(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return value


def _positive_int(text: str) -> int:
    return _integer(text, lambda v: v >= 1, "a positive integer")


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
        "analyze", help="find the examples that are mislabeled or harmful (your model and "
                        "data, or the bundled digits)",
        description="Trains a model with pergrad.keras.PerExampleModel and a GradientMonitor that "
                    "scores every example (loss, margin, EL2N, GraNd, TracIn, forgetting, "
                    "conflict with the rest of its batch; with --folds, out-of-sample "
                    "confidence from k-fold cross-fitting), prints a summary per epoch, and "
                    "writes metrics.csv, examples.csv (every row of the data, most suspect "
                    "first, named by its row in your file), label_issues.csv (the rows whose "
                    "label looks wrong, with the suggested label), report.png, "
                    "flagged_examples.png, influence.png (images only) and summary.json into "
                    "--out. Without --model and --data: a small CNN on scikit-learn's bundled "
                    "8x8 digits (no download).")
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="a saved Keras model (.keras) to train (default: the digits CNN)")
    parser.add_argument("--data", metavar="PATH", default=None,
                        help="the data: a .npz with arrays x and y, a folder of images with "
                             "one sub-folder per class, or a .csv with --label (default: digits)")
    parser.add_argument("--label", metavar="COLUMN", default=None,
                        help="the label column of a --data CSV table")
    parser.add_argument("--id", metavar="COLUMN", default=None, dest="id_column",
                        help="a --data CSV column that names each row (kept in the reports, "
                             "not a feature)")
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
                        help="flip the labels of this fraction of the rows first and report how "
                             "well each score finds them (default: 0)")
    parser.add_argument("--test-fraction", type=_fraction, default=0.2, metavar="F",
                        help="the share of rows held out for validation and the test examples "
                             "explained by TracIn; they are scored too, by the trained model "
                             "(default: 0.2; 0 holds out nothing)")
    parser.add_argument("--folds", type=_folds, default=5, metavar="K",
                        help="also cross-fit K copies of the model (each trains on the other "
                             "folds and scores the one it did not see, as cleanlab does) for "
                             "out-of-sample confidence and the suggested labels; costs K more "
                             "plain trainings (default: 5; 0 turns it off)")
    parser.add_argument("--fix", metavar="PATH", default=None,
                        help="write a copy of --data (.npz or .csv) with the flagged rows "
                             "relabelled to the suggested label; the input is never changed")
    parser.add_argument("--drop", action="store_true",
                        help="with --fix: leave the flagged rows out of the copy instead")
    parser.add_argument("--out", default="pergrad-report", metavar="DIR",
                        help="output directory (default: pergrad-report)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


def _folds(text: str) -> int:
    return _integer(text, lambda v: v == 0 or v >= 2, "0 (off) or at least 2")


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


def _check_paths(args: argparse.Namespace) -> None:
    """Argument and file errors found before Keras is imported (a fraction of a second, where
    importing Keras and a backend takes seconds: docs/cli.md)."""
    if args.data is not None and args.model is None:
        raise _Refused("--data needs --model: the model to train on that data")
    if args.model is not None and not os.path.exists(args.model):
        raise _Refused(f"cannot load the model {args.model}: no such file")
    if args.data is not None and not os.path.exists(args.data):
        raise _Refused(f"cannot read the data {args.data}: no such file or directory")
    if args.id_column is not None and (args.data is None or not args.data.lower().endswith(".csv")):
        raise _Refused("--id names a column of a --data CSV table")
    if args.drop and args.fix is None:
        raise _Refused("--drop goes with --fix PATH (the copy the flagged rows are left out of)")
    if args.fix is not None:
        if args.data is None:
            raise _Refused("--fix writes a corrected copy of --data; the digits demo has no file")
        if args.label_noise > 0:
            raise _Refused("--fix writes a corrected copy of your file, but with --label-noise "
                           "the labels analyzed are not your file's; drop one of the two")
        if os.path.abspath(args.fix) == os.path.abspath(args.data):
            raise _Refused(f"--fix {args.fix} is the input file; name a new file for the copy")
        kind = os.path.splitext(args.data)[1].lower()
        if os.path.isdir(args.data) or kind not in (".npz", ".csv"):
            raise _Refused("--fix writes a corrected .npz or .csv; for an image folder, move the "
                           "files listed in label_issues.csv to the folder of their suggested "
                           "class")
        if os.path.splitext(args.fix)[1].lower() != kind:
            raise _Refused(f"--fix {args.fix}: the data is a {kind} file; name a {kind} copy")
    _check_model_file(args.model)
    if args.data is not None and not os.path.isdir(args.data):
        _check_data_file(args.data, args.label, args.id_column)


def _check_model_file(path: str | None) -> None:
    """What ``keras.saving.load_model`` refuses by the file alone, found without Keras: a
    ``.keras`` file that is not a zip archive, a file of another kind than ``.keras`` or the
    legacy ``.h5``/``.hdf5`` (a folder is left to Keras, which reads some)."""
    if path is None or not os.path.isfile(path):
        return
    kind = os.path.splitext(path)[1]
    if kind not in (".keras", ".h5", ".hdf5"):
        raise _Refused(f"cannot load the model {path}: give a Keras model saved as .keras "
                       "(model.save('model.keras')), or a legacy .h5 file")
    if kind == ".keras" and not zipfile.is_zipfile(path):
        raise _Refused(f"cannot load the model {path}: not a .keras file (a .keras file is a "
                       "zip archive written by model.save)")


def _check_data_file(path: str, label: str | None, id_column: str | None) -> None:
    """The refusals of :func:`pergrad.analysis.load_data` that the file's kind, a ``.npz``'s
    array names or a CSV's header show, found without Keras (``pergrad.analysis`` imports
    it); the rows themselves are checked when the data is loaded."""
    kind = os.path.splitext(path)[1].lower()
    if kind == ".npz":
        try:
            with zipfile.ZipFile(path) as archive:  # what np.savez writes
                names = sorted(n.removesuffix(".npy") for n in archive.namelist())
        except (OSError, zipfile.BadZipFile) as error:
            raise _Refused(f"{path} is not a readable .npz file: {error}") from None
        if not {"x", "y"} <= set(names):
            raise _Refused(f"{path} has arrays {names}; it needs 'x' (inputs) and 'y' "
                           "(labels): np.savez(path, x=x, y=y).")
    elif kind == ".csv":
        if label is None:
            raise _Refused(f"{path} is a CSV table: name its label column with --label COLUMN.")
        try:
            with open(path, newline="") as handle:
                header = next(csv.reader(handle), None)
        except (OSError, UnicodeDecodeError, csv.Error) as error:
            raise _Refused(f"cannot read the data {path}: {error}") from None
        if header is None:
            raise _Refused(f"{path} is empty.")
        for name in (label, id_column):
            if name is not None and name not in header:
                raise _Refused(f"{path} has no column {name!r}; its columns are {header}.")
    else:
        raise _Refused(f"Cannot read {path!r}: give a .npz file (arrays x and y), a .csv table "
                       "(with --label) or a folder of images with one sub-folder per class.")


def _load_model(args):
    """``(model, loss, optimizer)``: the user's saved model, or the digits CNN."""
    import keras

    from pergrad import demo

    if args.model is not None:
        try:
            model = keras.saving.load_model(args.model)
        except (OSError, ValueError, TypeError) as error:
            raise _Refused(f"cannot load the model {args.model}: {error}") from None
    else:
        model = demo.digits_cnn()
    if args.loss is not None:
        loss = _build_loss(args.loss, args.from_logits)
    elif args.model is None:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise _Refused(f"the model {args.model} is not compiled with a loss: pass --loss "
                           "NAME (and --from-logits if it outputs logits)")
    optimizer = getattr(model, "optimizer", None) if args.model is not None else None
    optimizer = optimizer or keras.optimizers.Adam(3e-3 if args.model is None else 1e-3)
    return model, loss, optimizer


def _load_dataset(args, model):
    """Every row of the user's data (or the digits), as a :class:`pergrad.analysis.Dataset`."""
    from pergrad import demo
    from pergrad.analysis import Dataset, load_data

    if args.data is None:
        x, y = demo.load_digits_images()
        return Dataset(x, y, source="digits")
    shape = tuple(model.inputs[0].shape[1:]) if getattr(model, "inputs", None) else None
    try:
        return load_data(args.data, label=args.label, image_shape=shape, id_column=args.id_column)
    except (OSError, ValueError) as error:
        raise _Refused(str(error)) from None


def _row(data, i: int) -> str:
    """Example ``i`` as the user's file names it."""
    where = f"row {int(data.rows[i])}"
    if data.paths is not None:
        where = data.paths[i]
    elif data.ids is not None:
        where += f" (id {data.ids[i]})"
    return f"{data.source}, {where}"


def _check_model_fits_data(model, loss, data, from_logits: bool | None) -> None:
    """Refuse, in one line, inputs of the wrong shape, labels outside the model's classes and a
    loss that expects probabilities from a model that outputs something else."""
    inputs = getattr(model, "inputs", None) or []
    if len(inputs) == 1:
        expected = tuple(inputs[0].shape[1:])
        given = tuple(data.x.shape[1:])
        if len(expected) != len(given) or any(e is not None and e != g
                                              for e, g in zip(expected, given, strict=False)):
            raise _Refused(f"the model takes inputs of shape {(None, *expected)}, but "
                           f"{data.source} holds examples of shape {given}")
    outputs = np.asarray(model.predict(data.x[:256], verbose=0))
    classes = outputs.shape[-1] if outputs.ndim == 2 else 1
    labels = np.asarray(data.y)
    if "crossentropy" in _loss_name(loss) and labels.ndim == 1 \
            and np.issubdtype(labels.dtype, np.integer):
        top = max(classes, 2) - 1
        bad = np.flatnonzero((labels < 0) | (labels > top))
        if bad.size:
            raise _Refused(f"{_row(data, bad[0])} has label {labels[bad[0]]}, but the model has "
                           f"{classes} output{'s' if classes > 1 else ''} (labels 0..{top})")
    if from_logits is False and "crossentropy" in _loss_name(loss):
        low, high = float(outputs.min()), float(outputs.max())
        sums = outputs.sum(axis=-1) if classes > 1 else np.ones(1)
        if low < -1e-6 or high > 1 + 1e-6 or np.abs(sums - 1).max() > 1e-3:
            raise _Refused(f"the loss expects probabilities, but the model outputs values in "
                           f"[{low:.3g}, {high:.3g}]" + (f" whose rows sum to {sums.min():.3g}.."
                                                         f"{sums.max():.3g}" if classes > 1 else "")
                           + ": if it outputs logits, pass --from-logits (or compile it with "
                           "from_logits=True)")


def _loss_name(loss) -> str:
    name = loss if isinstance(loss, str) else getattr(loss, "name", None) \
        or getattr(loss, "__name__", "") or type(loss).__name__
    return str(name).lower().replace("_", "")


def _from_logits(loss, model) -> bool | None:
    from pergrad.stats.scores import loss_from_logits

    known = loss_from_logits(loss)
    if known is not None:
        return known
    layer = model.layers[-1] if getattr(model, "layers", None) else None
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    return {"softmax": False, "sigmoid": False, "linear": True}.get(activation)


def _split(labels: np.ndarray, fraction: float, seed: int):
    """``(train, validation)`` positions, stratified by class where every class has two rows."""
    from sklearn.model_selection import train_test_split

    index = np.arange(len(labels))
    if fraction == 0:
        return index, index[:0]
    counts = np.unique(labels, return_counts=True)[1] if labels.ndim == 1 else None
    stratify = labels if counts is not None and counts.min() >= 2 \
        and np.issubdtype(labels.dtype, np.integer) else None
    train, test = train_test_split(index, test_size=fraction, random_state=seed, stratify=stratify)
    return np.sort(train), np.sort(test)


def _is_classifier(labels: np.ndarray, from_logits: bool | None) -> bool:
    return from_logits is not None and labels.ndim == 1 \
        and np.issubdtype(labels.dtype, np.integer)


def run(args: argparse.Namespace) -> int:
    import sys

    # PyTorch's OpenMP threads spin while they wait for work (libgomp's default). On a busy
    # machine a spinning thread holds a core the other one needs: on 2 shared cores the digits
    # demo took 4.4x TensorFlow's CPU time, 0.9x with passive waiting (docs/cli.md). OpenMP
    # reads this when PyTorch loads it, i.e. before Keras is imported below; a user's setting
    # wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        _check_paths(args)
        return _run(args)
    except _Refused as error:
        print(f"pergrad analyze: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import keras

    from pergrad import backend, demo
    from pergrad.analysis import analyze
    from pergrad.analysis import report as files
    from pergrad.analysis.out_of_sample import (
        class_probabilities,
        confident_learning,
        cross_fitted_probabilities,
        fold_assignment,
    )
    from pergrad.keras import GradientMonitor, PrivacyCallback
    from pergrad.stats.label_errors import ranking

    start = time.perf_counter()
    backend.native().enable_noise_keys()  # JAX: 64-bit DP noise keys (docs/backends.md)
    keras.utils.set_random_seed(args.seed)
    model, loss, optimizer = _load_model(args)
    data = _load_dataset(args, model)
    from_logits = _from_logits(loss, model)
    _check_model_fits_data(model, loss, data, from_logits)
    classifier = _is_classifier(np.asarray(data.y), from_logits)
    n = len(data)

    labels, flipped = np.asarray(data.y), np.zeros(n, bool)
    if args.label_noise > 0:
        if not classifier:
            raise _Refused("--label-noise needs integer class labels and a classification loss")
        classes = int(labels.max()) + 1 if data.class_names is None else len(data.class_names)
        labels, flipped = demo.flip_labels(labels, args.label_noise, seed=args.seed,
                                           num_classes=max(classes, 2))
    if args.fix is not None and not classifier:
        raise _Refused("--fix needs a classifier (integer labels and a classification loss)")
    train, valid = _split(labels, args.test_fraction, args.seed)
    if args.folds:
        if not classifier:
            raise _Refused("--folds scores classifiers: it needs integer class labels and a "
                           "loss whose outputs are known to be logits or probabilities")
        try:
            fold_assignment(labels, args.folds, args.seed)
        except ValueError as error:
            raise _Refused(f"{error} (--folds K, or --folds 0 to skip cross-fitting)") from None
    print(f"{data.source}: {n} rows, {len(train)} for training and {len(valid)} held out; "
          f"{int(flipped.sum())} labels flipped; aggregator: {args.aggregator}"
          + (f"; cross-fitting {args.folds} folds" if args.folds else ""))
    os.makedirs(args.out, exist_ok=True)

    out_of_sample = None
    if args.folds:
        out_of_sample = cross_fitted_probabilities(
            model, data.x, labels, loss=loss, optimizer=optimizer, from_logits=from_logits,
            folds=args.folds, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
        keras.utils.set_random_seed(args.seed)

    monitor = GradientMonitor(csv_path=os.path.join(args.out, "metrics.csv"),
                              num_examples=len(train), from_logits=from_logits)
    callbacks = [demo.EpochTable(monitor, len(train), args.batch_size, args.aggregator == "dp")]
    if args.aggregator == "dp":
        callbacks.insert(0, PrivacyCallback(len(train), args.batch_size, NOISE_MULTIPLIER, DELTA))
    validation = (data.x[valid], labels[valid]) if len(valid) else None
    analysis = analyze(model, data.x[train], labels[train], loss=loss, optimizer=optimizer,
                       epochs=args.epochs, batch_size=args.batch_size,
                       aggregator=_aggregator(args.aggregator, args.seed),
                       validation_data=validation, callbacks=callbacks, monitor=monitor)

    held_losses = _losses(analysis, data.x[valid], labels[valid]) if len(valid) else None
    scores, names = _row_scores(analysis, model, data.x, labels, train, valid, held_losses,
                                from_logits if classifier else None, out_of_sample)
    split = np.where(np.isin(np.arange(n), valid), "validation", "train")
    seen = np.zeros(n, np.int64)
    seen[train] = analysis.table["seen"]
    extra: dict[str, list] = {}
    summary: dict = {
        "data": data.source, "model": args.model or "digits_cnn", "rows": n,
        "training_rows": len(train), "held_out_rows": len(valid), "epochs": args.epochs,
        "batch_size": args.batch_size, "aggregator": args.aggregator, "folds": args.folds,
        "label_noise": args.label_noise, "seed": args.seed,
        "final": {k: float(v[-1]) for k, v in analysis.history.items()},
    }
    issues = suggested = None
    written = ["metrics.csv", "examples.csv"]
    if classifier:
        probabilities = out_of_sample if out_of_sample is not None \
            else class_probabilities(model, data.x, from_logits)
        issues = confident_learning(probabilities, labels)
        suggested = issues.suggested
        top = max(int(issues.flagged.sum()), 1)
        extra = {"suggested": [files.label_text(v, data.class_names) for v in suggested],
                 "flagged_by": files.flagged_by(scores, names, top)}
        order = ranking(scores["default"])
        count = files.write_label_issues_csv(os.path.join(args.out, "label_issues.csv"), data,
                                             labels, issues.flagged, suggested, probabilities,
                                             order)
        written.append("label_issues.csv")
        summary["label_issues"] = {
            "flagged": count, "estimated_errors": issues.estimated_errors,
            "probabilities": f"out-of-sample ({args.folds} folds)" if args.folds else
            "the trained model's (in-sample for training rows: pass --folds 5 for "
            "out-of-sample ones, which find more)"}
    summary["most_suspect"] = files.suspects(data, labels, scores["default"], 16, suggested)
    if flipped.any():
        summary["flipped"] = [{**files.identity(data, i),
                               "given": files.label_text(labels[i], data.class_names),
                               "true": files.label_text(data.y[i], data.class_names)}
                              for i in np.flatnonzero(flipped)]
        summary["label_noise_detection"] = files.detection_table(scores, ("default", *names),
                                                                 flipped)
    files.write_examples_csv(os.path.join(args.out, "examples.csv"), data, labels, scores,
                             ("default", *names), split, seen, extra,
                             data.y if flipped.any() else None)
    written += _pictures(args, analysis, monitor, data, labels, scores, train, valid,
                         held_losses, flipped, summary)
    if args.fix is not None and issues is not None:
        try:
            changed = files.write_fixed_copy(data, args.fix, labels, issues.flagged, suggested,
                                             args.drop)
        except ValueError as error:
            raise _Refused(str(error)) from None
        summary["fixed_copy"] = {"path": args.fix, "dropped" if args.drop else "relabelled":
                                 changed}
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    written.append("summary.json")
    _print_findings(summary, flipped)
    print(f"wrote {args.out}/{', '.join(written)} in {time.perf_counter() - start:.0f} s")
    return 0


def _losses(analysis, x, y) -> np.ndarray:
    """The trained model's per-example losses on ``(x, y)``."""
    import keras

    from pergrad import PerExample

    losses = PerExample(analysis.model, analysis.loss).losses(x, y)
    return np.asarray(keras.ops.convert_to_numpy(losses), np.float64)


def _row_scores(analysis, model, x, labels, train, valid, held_losses, from_logits,
                out_of_sample):
    """``({name: (N,)}, names)``: every row's scores. Training rows get the monitor's training
    dynamics; held-out rows the trained model's loss, margin and error norm (the scores that
    need no training history), and a default ranked within the held-out rows; with
    cross-fitting every row also gets out-of-sample confidence."""
    import keras

    from pergrad.analysis.out_of_sample import add_out_of_sample
    from pergrad.stats import SINGLE_SCORES
    from pergrad.stats.label_errors import DEFAULT_SCORE, rank_average
    from pergrad.stats.scores import class_scores

    n = len(labels)
    names = SINGLE_SCORES + (("self_confidence", "oos_margin") if out_of_sample is not None
                             else ())
    scores = {name: np.full(n, np.nan) for name in ("default", *names)}
    for name in ("default", *SINGLE_SCORES):
        scores[name][train] = analysis.scores[name]
    if len(valid):
        scores["loss"][valid] = scores["last_loss"][valid] = held_losses
        if from_logits is not None:
            found = class_scores(model.predict(x[valid], verbose=0), labels[valid], from_logits)
            scores["margin"][valid] = -keras.ops.convert_to_numpy(found["margin"])
            scores["error_norm"][valid] = keras.ops.convert_to_numpy(found["error_norm"])
        usable = [scores[k][valid] for k in DEFAULT_SCORE if not np.isnan(scores[k][valid]).all()]
        scores["default"][valid] = rank_average(*usable)
    if out_of_sample is not None:
        scores = add_out_of_sample(scores, out_of_sample, labels)
    return scores, names


def _pictures(args, analysis, monitor, data, labels, scores, train, valid, held_losses,
              flipped, summary) -> list[str]:
    """report.png; for images the flagged examples and, with held-out rows, TracIn pictures."""
    from pergrad import plot
    from pergrad.analysis import report as files
    from pergrad.stats.label_errors import ranking

    plot.training_report(monitor, path=os.path.join(args.out, "report.png"))
    written = ["report.png"]
    images = files.is_image_batch(data.x)
    names = [int(r) for r in data.rows]  # titles show rows; paths are in the CSV and JSON
    given = [files.label_text(v, data.class_names) for v in labels]
    true = [files.label_text(v, data.class_names) for v in data.y] if flipped.any() else None
    if images:
        shown = ranking(scores["default"])[:16]
        captions = [f"suspect #{r + 1}" + (f", margin {-scores['margin'][i]:+.1f}"
                                          if not np.isnan(scores["margin"][i]) else "")
                    for r, i in enumerate(shown)]
        plot.flagged_examples(data.x, given, shown, captions=captions, true_labels=true,
                              names=names, heading="The 16 rows most likely mislabeled",
                              path=os.path.join(args.out, "flagged_examples.png"))
        written.append("flagged_examples.png")
    if len(valid):
        chosen = valid[files.explained_test_examples(held_losses, 4)]
        influence = analysis.influence(data.x[train], labels[train], data.x[chosen],
                                       labels[chosen])
        summary["influence"] = files.influence_summary(influence, data, train, chosen)
        if images:
            plot.influential_examples(
                influence, data.x[train], labels[train], data.x[chosen], labels[chosen], k=4,
                path=os.path.join(args.out, "influence.png"),
                test_indices=[names[i] for i in chosen],
                train_true_labels=None if true is None else data.y[train],
                train_names=[names[i] for i in train])
            written.append("influence.png")
    return written


def _print_findings(summary: dict, flipped: np.ndarray) -> None:
    print()
    if flipped.any():
        detection = summary["label_noise_detection"]
        print(f"finding the {int(flipped.sum())} flipped labels (k = {int(flipped.sum())}):")
        print(f"  {'ranking by':<16}{'precision@k':>12}{'ROC AUC':>10}")
        for name, found in detection.items():
            print(f"  {name:<16}{found['precision_at_k']:>12.3f}{found['roc_auc']:>10.3f}")
    if "label_issues" in summary:
        issues = summary["label_issues"]
        print(f"label issues: {issues['flagged']} rows flagged, about "
              f"{issues['estimated_errors']} labels estimated wrong (label_issues.csv)")
    top = ", ".join(str(s.get("path", s["row"])) for s in summary["most_suspect"][:8])
    print(f"most likely mislabeled (rows of {summary['data']}): {top}")
