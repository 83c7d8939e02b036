"""Scikit-learn's bundled 8x8 digits (1,797 images shipped inside the package) and a small CNN."""

from __future__ import annotations

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """``(x_train, y_train), (x_test, y_test)``: images ``(N, 8, 8, 1)`` scaled to [0, 1]."""
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype("int64"), test_size=test_fraction, random_state=seed,
        stratify=digits.target)
    return (x_train, y_train), (x_test, y_test)


def flip_labels(labels: np.ndarray, fraction: float, seed: int = 0,
                num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Give ``round(fraction * N)`` randomly chosen examples a different, random label.

    Returns ``(noisy labels, boolean mask of the flipped examples)``.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}.")
    rng = np.random.default_rng(seed)
    flipped = np.zeros(len(labels), bool)
    flipped[rng.choice(len(labels), int(round(fraction * len(labels))), replace=False)] = True
    noisy = labels.copy()
    shift = rng.integers(1, num_classes, size=flipped.sum())
    noisy[flipped] = (labels[flipped] + shift) % num_classes
    return noisy, flipped


def digits_cnn(input_name: str = "image") -> keras.Model:
    """Conv(16, 3) -> Conv(32, 3, stride 2) -> Dense(64) -> Dense(10) logits, ~40k weights."""
    inputs = keras.Input((8, 8, 1), name=input_name)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(h)
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(h))
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="digits_cnn")
