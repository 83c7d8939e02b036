"""Loading a user's training data for ``pergrad analyze``: ``.npz`` arrays, a folder of images
with one sub-folder per class, or a CSV table with a label column.

Every example keeps its identity in the user's file: ``Dataset.rows[i]`` is example ``i``'s row
(the index into the npz arrays, the CSV's data row counted from 0, the position of an image in
the sorted file list), ``Dataset.ids`` the CSV's own id column when one is named, and
``Dataset.paths`` an image's file. Reports name examples by these, never by a position in an
internal split.

Bad input is refused with a :class:`DataError` that names the file, the line or row and the
column, before anything is trained: a missing or non-numeric feature (``nan``, ``inf``, an empty
cell), an empty label cell, a file in an image folder that is not a readable image.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass

import numpy as np

#: File endings read as images (``keras.utils.image_dataset_from_directory``'s list).
IMAGE_ENDINGS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")


class DataError(ValueError):
    """The data cannot be used as given; the message names the file and the row or column."""


@dataclass
class Dataset:
    """Examples in memory.

    Attributes:
        x, y: inputs and labels, example ``i`` at position ``i``.
        source: the file or folder read.
        rows: ``(N,)`` example ``i``'s row in ``source`` (see the module docstring).
        paths: ``paths[i]`` the file of example ``i`` (image folders), else ``None``.
        class_names: ``class_names[c]`` names class ``c`` where the labels were names (folders,
            CSV strings), else ``None``.
        ids: ``ids[i]`` the value of the CSV's id column (``--id``), else ``None``.
        label_column: the CSV's label column, else ``None``.
    """

    x: np.ndarray
    y: np.ndarray
    source: str
    rows: np.ndarray | None = None
    paths: list[str] | None = None
    class_names: list[str] | None = None
    ids: list[str] | None = None
    label_column: str | None = None

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = np.arange(len(self.x))

    def __len__(self) -> int:
        return len(self.x)


def load_data(path: str, label: str | None = None,
              image_shape: tuple[int, ...] | None = None, id_column: str | None = None) -> Dataset:
    """Load ``path`` by its kind:

    * ``*.npz``: arrays ``x`` (inputs) and ``y`` (labels), as ``np.savez(path, x=x, y=y)``;
    * a directory: one sub-folder per class (sorted names are classes 0, 1, ...), images in
      sorted file order, each resized to ``image_shape`` ``(H, W, C)`` (the model's input;
      C = 1, 3, 4 sets grayscale, rgb, rgba) with bilinear interpolation, pixels as floats in
      [0, 255] as ``keras.utils.image_dataset_from_directory`` gives them (a model trained on
      rescaled images should start with a ``Rescaling`` layer);
    * ``*.csv``: a header row, numeric feature columns, the ``label`` column (integers, or names
      mapped to classes in sorted order) and optionally an ``id_column`` kept for reports.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataError: the data cannot be used as given (the message names file, row and column).
    """
    if os.path.isdir(path):
        return _images(path, image_shape)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such file or directory: {path!r}.")
    lower = path.lower()
    if lower.endswith(".npz"):
        if id_column is not None:
            raise DataError(f"--id names a CSV column; {path} is a .npz file (its rows are "
                            "named by their index).")
        return _arrays(path)
    if lower.endswith(".csv"):
        if label is None:
            raise DataError(f"{path} is a CSV table: name its label column with --label COLUMN.")
        return _table(path, label, id_column)
    raise DataError(f"Cannot read {path!r}: give a .npz file (arrays x and y), a .csv table "
                    "(with --label) or a folder of images with one sub-folder per class.")


def _first_bad_row(x: np.ndarray) -> int | None:
    """The first example with a NaN or infinite input, or ``None``."""
    if not np.issubdtype(x.dtype, np.floating):
        return None
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else None


def _arrays(path: str) -> Dataset:
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise DataError(f"{path} is not a readable .npz file: {error}") from None
    with data:
        missing = [k for k in ("x", "y") if k not in data.files]
        if missing:
            raise DataError(f"{path} has arrays {sorted(data.files)}; it needs 'x' (inputs) and "
                            "'y' (labels): np.savez(path, x=x, y=y).")
        try:
            x, y = data["x"], data["y"]
        except ValueError as error:  # object arrays need pickle, which is never loaded
            raise DataError(f"{path}: {error}") from None
    if len(x) != len(y):
        raise DataError(f"{path}: x has {len(x)} examples but y has {len(y)}.")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DataError(f"{path}: x has dtype {x.dtype}; it must hold numbers.")
    x = x.astype(np.float32)
    bad = _first_bad_row(x)
    if bad is not None:
        raise DataError(f"{path}: x[{bad}] holds NaN or infinity; fix or drop that row.")
    if np.issubdtype(y.dtype, np.floating):
        bad_labels = ~np.isfinite(y.reshape(len(y), -1)).all(axis=1)
        if bad_labels.any():
            raise DataError(f"{path}: y[{int(np.argmax(bad_labels))}] is NaN or infinite.")
    elif not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: y has dtype {y.dtype}; labels must be integers (class "
                        "indices) or numbers.")
    return Dataset(x, y, source=path)


def _image_files(path: str) -> tuple[list[str], list[int], list[str]]:
    """``(files, labels, class names)``: sorted class folders, then sorted files within each
    (sub-folders included); a file that is not an image is refused by name."""
    classes = sorted(entry for entry in os.listdir(path)
                     if os.path.isdir(os.path.join(path, entry)) and not entry.startswith("."))
    if not classes:
        raise DataError(f"{path} has no sub-folders: put the images of each class in a "
                        "sub-folder named after the class.")
    files, labels = [], []
    for label, name in enumerate(classes):
        for root, folders, names in os.walk(os.path.join(path, name)):
            folders.sort()
            for file in sorted(names):
                if file.startswith("."):
                    continue
                full = os.path.join(root, file)
                if not file.lower().endswith(IMAGE_ENDINGS):
                    raise DataError(f"{full} is not an image ({', '.join(IMAGE_ENDINGS)}); "
                                    "move it out of the image folder.")
                files.append(full)
                labels.append(label)
    return files, labels, classes


def _images(path: str, image_shape: tuple[int, ...] | None) -> Dataset:
    from keras.utils import img_to_array, load_img

    if image_shape is None or len(image_shape) != 3 or None in image_shape[:2]:
        raise DataError(f"Reading the images in {path} needs a model whose input is (H, W, C) "
                        f"with a fixed H and W; got input shape {image_shape}.")
    height, width, channels = image_shape
    modes = {1: "grayscale", 3: "rgb", 4: "rgba"}
    if channels not in modes:
        raise DataError(f"The model takes {channels} channels; images can be read as 1 "
                        "(grayscale), 3 (rgb) or 4 (rgba).")
    files, labels, classes = _image_files(path)
    if not files:
        raise DataError(f"No images found in {path}.")
    images = np.empty((len(files), height, width, channels), np.float32)
    for i, file in enumerate(files):
        try:
            image = load_img(file, color_mode=modes[channels], target_size=(height, width),
                             interpolation="bilinear")
            images[i] = img_to_array(image, dtype="float32")
        except Exception as error:  # PIL raises several types for a damaged file
            raise DataError(f"{file} is not a readable image ({type(error).__name__}: "
                            f"{error}); fix or remove it.") from None
    return Dataset(images, np.asarray(labels, np.int64), source=path, paths=files,
                   class_names=classes)


def _number(text: str) -> float:
    """A finite number from a CSV cell, else ``ValueError``."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _table(path: str, label: str, id_column: str | None) -> Dataset:
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        raise DataError(f"{path} is empty.")
    header = rows[0]
    body = [(line, row) for line, row in enumerate(rows[1:], start=2) if row]
    if not body:
        raise DataError(f"{path} has a header and no data rows.")
    for name in (label, id_column):
        if name is not None and name not in header:
            raise DataError(f"{path} has no column {name!r}; its columns are {header}.")
    column = header.index(label)
    id_index = header.index(id_column) if id_column is not None else None
    features = [k for k in range(len(header)) if k not in (column, id_index)]
    if not features:
        raise DataError(f"{path} has no feature columns besides {label!r}.")
    x = np.empty((len(body), len(features)), np.float32)
    for r, (line, row) in enumerate(body):
        if len(row) != len(header):
            raise DataError(f"{path}, line {line}: {len(row)} fields, expected {len(header)}.")
        for c, k in enumerate(features):
            try:
                x[r, c] = _number(row[k])
            except ValueError:
                raise DataError(f"{path}, line {line}: column {header[k]!r} is not a finite "
                                f"number ({row[k]!r}); only the label and id columns may hold "
                                "text.") from None
    values = [row[column].strip() for _, row in body]
    for (line, _), value in zip(body, values, strict=True):
        if not value:
            raise DataError(f"{path}, line {line}: the label {label!r} is empty; give every "
                            "row a label or drop the row.")
    ids = [row[id_index] for _, row in body] if id_index is not None else None
    if ids is not None and len(set(ids)) != len(ids):
        repeated = next(v for v in ids if ids.count(v) > 1)
        raise DataError(f"{path}: the id column {id_column!r} repeats {repeated!r}; ids must "
                        "name one row each.")
    try:
        numbers = [_number(v) for v in values]
    except ValueError:
        names = sorted(set(values))
        lookup = {name: c for c, name in enumerate(names)}
        return Dataset(x, np.asarray([lookup[v] for v in values], np.int64), source=path,
                       class_names=names, ids=ids, label_column=label)
    if all(n == int(n) for n in numbers):
        return Dataset(x, np.asarray(numbers, np.int64), source=path, ids=ids,
                       label_column=label)
    return Dataset(x, np.asarray(numbers, np.float32), source=path, ids=ids,
                   label_column=label)
