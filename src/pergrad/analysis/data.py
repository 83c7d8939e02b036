"""Loading a user's training data for ``pergrad analyze``: ``.npz`` arrays, a folder of images
with one sub-folder per class, or a CSV table with a label column."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass

import numpy as np


@dataclass
class Dataset:
    """Examples in memory. ``paths[i]`` is the file of example ``i`` (images) or ``None``;
    ``class_names[c]`` names class ``c`` where the labels were names (folders, CSV strings)."""

    x: np.ndarray
    y: np.ndarray
    source: str
    paths: list[str] | None = None
    class_names: list[str] | None = None

    def __len__(self) -> int:
        return len(self.x)


def load_data(path: str, label: str | None = None,
              image_shape: tuple[int, ...] | None = None) -> Dataset:
    """Load ``path`` by its kind:

    * ``*.npz``: arrays ``x`` (inputs) and ``y`` (labels), as ``np.savez(path, x=x, y=y)``;
    * a directory: one sub-folder per class, read as ``keras.utils.image_dataset_from_directory``
      does (in file order, no shuffling; pixels as floats in [0, 255], so a model trained on
      rescaled images should start with a ``Rescaling`` layer). ``image_shape`` ``(H, W, C)``
      (the model's input) sets the size images are resized to and the color mode (C = 1, 3, 4);
    * ``*.csv``: a header row, numeric feature columns and the ``label`` column (integers, or
      names mapped to classes in sorted order).
    """
    if os.path.isdir(path):
        return _images(path, image_shape)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such file or directory: {path!r}.")
    lower = path.lower()
    if lower.endswith(".npz"):
        return _arrays(path)
    if lower.endswith(".csv"):
        if label is None:
            raise ValueError(f"{path} is a CSV table: name its label column with --label COLUMN.")
        return _table(path, label)
    raise ValueError(f"Cannot read {path!r}: give a .npz file (arrays x and y), a .csv table "
                     "(with --label) or a folder of images with one sub-folder per class.")


def _arrays(path: str) -> Dataset:
    with np.load(path, allow_pickle=False) as data:
        missing = [k for k in ("x", "y") if k not in data.files]
        if missing:
            raise ValueError(f"{path} has arrays {sorted(data.files)}; it needs 'x' (inputs) and "
                             "'y' (labels): np.savez(path, x=x, y=y).")
        x, y = data["x"], data["y"]
    if len(x) != len(y):
        raise ValueError(f"{path}: x has {len(x)} examples but y has {len(y)}.")
    if np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.float32)
    return Dataset(x, y, source=path)


def _images(path: str, image_shape: tuple[int, ...] | None) -> Dataset:
    import keras

    if image_shape is None or len(image_shape) != 3 or None in image_shape[:2]:
        raise ValueError(f"Reading the images in {path} needs a model whose input is (H, W, C) "
                         f"with a fixed H and W; got input shape {image_shape}.")
    height, width, channels = image_shape
    modes = {1: "grayscale", 3: "rgb", 4: "rgba"}
    if channels not in modes:
        raise ValueError(f"The model takes {channels} channels; images can be read as 1 "
                         "(grayscale), 3 (rgb) or 4 (rgba).")
    dataset = keras.utils.image_dataset_from_directory(
        path, labels="inferred", label_mode="int", color_mode=modes[channels],
        image_size=(height, width), shuffle=False, batch_size=None, verbose=False)
    images, labels = [], []
    for image, target in dataset.as_numpy_iterator():
        images.append(image)
        labels.append(target)
    if not images:
        raise ValueError(f"No images found in {path}.")
    return Dataset(np.stack(images).astype(np.float32), np.asarray(labels, np.int64), source=path,
                   paths=list(dataset.file_paths), class_names=list(dataset.class_names))


def _table(path: str, label: str) -> Dataset:
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        raise ValueError(f"{path} is empty.")
    header, body = rows[0], [r for r in rows[1:] if r]
    if label not in header:
        raise ValueError(f"{path} has no column {label!r}; its columns are {header}.")
    column = header.index(label)
    features = [k for k in range(len(header)) if k != column]
    x = np.empty((len(body), len(features)), np.float32)
    for r, row in enumerate(body):
        if len(row) != len(header):
            raise ValueError(f"{path}, line {r + 2}: {len(row)} fields, expected {len(header)}.")
        for c, k in enumerate(features):
            try:
                x[r, c] = float(row[k])
            except ValueError:
                raise ValueError(f"{path}, line {r + 2}: column {header[k]!r} is not a number "
                                 f"({row[k]!r}); only the label column may hold text.") from None
    values = [row[column] for row in body]
    try:
        numbers = [float(v) for v in values]
        if all(n == int(n) for n in numbers):
            return Dataset(x, np.asarray(numbers, np.int64), source=path)
        return Dataset(x, np.asarray(numbers, np.float32), source=path)
    except ValueError:
        names = sorted(set(values))
        lookup = {name: c for c, name in enumerate(names)}
        return Dataset(x, np.asarray([lookup[v] for v in values], np.int64), source=path,
                       class_names=names)
