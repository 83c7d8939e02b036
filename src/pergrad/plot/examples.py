"""``conflicting_examples``: the training examples whose gradients most often opposed the batch."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from pergrad.plot._figure import new_figure, save


def _label(value: Any) -> Any:
    value = np.asarray(value)
    if value.ndim >= 1 and value.size > 1:  # one-hot or probabilities
        return int(np.argmax(value))
    value = value.reshape(())
    return value.item()


def _image(value: Any) -> np.ndarray:
    image = np.asarray(value, np.float64)
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    elif image.ndim == 3 and image.shape[0] in (1, 3) and image.shape[-1] not in (1, 3):
        image = np.moveaxis(image, 0, -1).squeeze()  # channels first
    if image.ndim == 3:  # RGB: scale into [0, 1] for imshow
        low, high = image.min(), image.max()
        image = (image - low) / (high - low) if high > low else np.zeros_like(image)
    return image


def conflicting_examples(monitor: Any, images: Any, labels: Any, k: int = 16,
                         path: str | os.PathLike | None = None,
                         true_labels: Any = None) -> Figure:
    """A grid of the ``k`` examples whose gradients fought the rest of their batches most
    (``monitor.most_conflicting(k)``: lowest mean cosine to the consensus of the other examples).

    Each title gives the example index and the label it was trained with (``given``), then its
    mean cosine to the rest of its batches and how often it pointed against them (``against
    a of b`` batches it was seen in). With ``true_labels`` (when label noise was injected on
    purpose), an example whose given label is wrong says ``true t`` and gets a red frame, so a
    person can check the ranking at a glance.

    Args:
        monitor: a ``GradientMonitor`` that tracked examples while training.
        images: the training images, indexed like the monitor's example indices,
            ``(N, H, W)``, ``(N, H, W, C)`` or channels-first.
        labels: ``(N,)`` labels or ``(N, classes)`` one-hot: the labels trained on.
        path: where to write a PNG (``None``: only return the figure).
        true_labels: optional clean labels, same form as ``labels``.
    """
    indices = monitor.most_conflicting(k)
    if len(indices) == 0:
        raise ValueError("The monitor has not seen any example yet (train with "
                         "GradientMonitor(track_examples=True) first).")
    if int(np.max(indices)) >= len(images):
        raise ValueError(f"The monitor tracked example index {int(np.max(indices))}, but only "
                         f"{len(images)} images were given; pass the whole training set.")
    table = monitor.example_table()
    columns = math.ceil(math.sqrt(len(indices)))
    rows = math.ceil(len(indices) / columns)
    fig = new_figure(1.9 * columns, 2.1 * rows)
    axes = np.atleast_1d(fig.subplots(rows, columns)).ravel()
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_frame_on(False)
    wrong = 0
    for ax, index in zip(axes, indices, strict=False):
        image = _image(images[index])
        ax.imshow(image, cmap="gray" if image.ndim == 2 else None)
        given = _label(labels[index])
        title = f"#{index} given {given}"
        if true_labels is not None and _label(true_labels[index]) != given:
            wrong += 1
            title += f", true {_label(true_labels[index])}"
            ax.set_frame_on(True)
            for spine in ax.spines.values():
                spine.set(color="red", linewidth=3)
        ax.set_title(f"{title}\ncos {table['mean_cosine_to_rest'][index]:+.2f}, against "
                     f"{table['against_rest'][index]} of {table['seen'][index]}", fontsize=8,
                     color="red" if "true" in title else "black")
    heading = "Examples whose gradients fight the rest of their batches"
    if true_labels is not None:
        heading += f" (red: label flipped on purpose, {wrong} of {len(indices)})"
    fig.suptitle(heading, fontsize=10)
    save(fig, path)
    return fig
