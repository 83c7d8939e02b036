"""Scikit-learn's bundled 8x8 digits (1,797 images shipped inside the package) and a small CNN."""

from __future__ import annotations

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from pergrad.demo.label_noise import flip_labels  # noqa: F401  (its former home)


def load_digits_images():
    """``(x, y)``: all 1,797 images ``(N, 8, 8, 1)`` scaled to [0, 1] and their digits, in
    scikit-learn's order (row ``i`` is ``sklearn.datasets.load_digits().images[i]``)."""
    digits = load_digits()
    return (digits.images / 16.0).astype("float32")[..., None], digits.target.astype("int64")


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """``(x_train, y_train), (x_test, y_test)``: images ``(N, 8, 8, 1)`` scaled to [0, 1]."""
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype("int64"), test_size=test_fraction, random_state=seed,
        stratify=digits.target)
    return (x_train, y_train), (x_test, y_test)


def digits_cnn(input_name: str = "image") -> keras.Model:
    """Conv(16, 3) -> Conv(32, 3, stride 2) -> Dense(64) -> Dense(10) logits, ~40k weights."""
    inputs = keras.Input((8, 8, 1), name=input_name)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(h)
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(h))
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="digits_cnn")
