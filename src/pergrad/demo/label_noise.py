"""Synthetic label noise: symmetric (any other class) and class-dependent (a fixed confusion)."""

from __future__ import annotations

import numpy as np


def flip_labels(labels: np.ndarray, fraction: float, seed: int = 0,
                num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric noise: give ``round(fraction * N)`` randomly chosen examples a different label,
    drawn uniformly from the other ``num_classes - 1`` classes.

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


def flip_classes(labels: np.ndarray, mapping: dict[int, int], fraction: float,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Class-dependent noise: for every ``source -> target`` of ``mapping``, relabel
    ``round(fraction * n_source)`` randomly chosen examples of class ``source`` as ``target``
    (e.g. digits ``{7: 1, 3: 8}``: sevens that look like ones).

    Returns ``(noisy labels, boolean mask of the flipped examples)``.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}.")
    if any(source == target for source, target in mapping.items()):
        raise ValueError(f"mapping {mapping} sends a class to itself.")
    rng = np.random.default_rng(seed)
    noisy, flipped = labels.copy(), np.zeros(len(labels), bool)
    for source, target in mapping.items():
        members = np.flatnonzero(labels == source)
        chosen = rng.choice(members, int(round(fraction * len(members))), replace=False)
        noisy[chosen], flipped[chosen] = target, True
    return noisy, flipped
