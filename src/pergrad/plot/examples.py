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
    captions = [f"cos {table['mean_cosine_to_rest'][i]:+.2f}, against "
                f"{table['against_rest'][i]} of {table['seen'][i]}" for i in indices]
    return flagged_examples(images, labels, indices, captions=captions, true_labels=true_labels,
                            heading="Examples whose gradients fight the rest of their batches",
                            path=path)


def _blank(axes) -> None:
    for ax in np.atleast_1d(axes).ravel():
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_frame_on(False)


def _frame(ax, color: str) -> None:
    ax.set_frame_on(True)
    for spine in ax.spines.values():
        spine.set(color=color, linewidth=3)


def flagged_examples(images: Any, labels: Any, indices: Any, captions: list[str] | None = None,
                     true_labels: Any = None, heading: str = "Flagged examples",
                     path: str | os.PathLike | None = None, names: Any = None) -> Figure:
    """A grid of the examples ``indices`` (most suspect first), each titled with its index (or
    ``names[index]``, e.g. its row in the data file) and
    the label it was trained with (``given``) and an optional caption line. With
    ``true_labels`` (label noise injected on purpose), an example whose given label is wrong
    says ``true t`` and gets a red frame, and the heading counts them."""
    indices = [int(i) for i in indices]
    if not indices:
        raise ValueError("No examples to draw.")
    if max(indices) >= len(images):
        raise ValueError(f"Example index {max(indices)} is out of range for {len(images)} images; "
                         "pass the whole training set.")
    columns = math.ceil(math.sqrt(len(indices)))
    rows = math.ceil(len(indices) / columns)
    fig = new_figure(1.9 * columns, 2.1 * rows)
    axes = np.atleast_1d(fig.subplots(rows, columns)).ravel()
    _blank(axes)
    wrong = 0
    for n, (ax, index) in enumerate(zip(axes, indices, strict=False)):
        image = _image(images[index])
        ax.imshow(image, cmap="gray" if image.ndim == 2 else None)
        given = _label(labels[index])
        title = f"#{index if names is None else names[index]} given {given}"
        flipped = true_labels is not None and _label(true_labels[index]) != given
        if flipped:
            wrong += 1
            title += f", true {_label(true_labels[index])}"
            _frame(ax, "red")
        if captions is not None:
            title += "\n" + captions[n]
        ax.set_title(title, fontsize=8, color="red" if flipped else "black")
    if true_labels is not None:
        heading += f" (red: label flipped on purpose, {wrong} of {len(indices)})"
    fig.suptitle(heading, fontsize=10)
    save(fig, path)
    return fig


def influential_examples(influence: Any, train_images: Any, train_labels: Any,
                         test_images: Any, test_labels: Any, k: int = 4,
                         path: str | os.PathLike | None = None, test_indices: Any = None,
                         train_true_labels: Any = None, train_names: Any = None) -> Figure:
    """One row per explained test example: the test image, then its ``k`` most helpful training
    examples (green frames: TracIn proponents, training on them lowered this example's loss)
    and its ``k`` most harmful ones (red frames: opponents), each with its training index, given
    label and influence score (:func:`pergrad.stats.influence`). ``test_indices`` numbers the
    test examples in the titles, ``train_names`` the training examples (default: their
    position in ``train_images``); with ``train_true_labels`` a training example whose given label
    was flipped on purpose also shows its true label."""
    scores = np.asarray(influence.scores)
    helpful, harmful = influence.helpful(k), influence.harmful(k)
    rows = scores.shape[0]
    fig = new_figure(1.6 * (2 * k + 1), 1.9 * rows)
    axes = np.asarray(fig.subplots(rows, 2 * k + 1)).reshape(rows, 2 * k + 1)
    _blank(axes)
    for j in range(rows):
        image = _image(test_images[j])
        axes[j, 0].imshow(image, cmap="gray" if image.ndim == 2 else None)
        number = j if test_indices is None else int(test_indices[j])
        axes[j, 0].set_title(f"test #{number}\nlabel {_label(test_labels[j])}", fontsize=8)
        for col, (index, color) in enumerate([(i, "green") for i in helpful[j]]
                                             + [(i, "red") for i in harmful[j]]):
            ax = axes[j, col + 1]
            image = _image(train_images[index])
            ax.imshow(image, cmap="gray" if image.ndim == 2 else None)
            _frame(ax, color)
            given = _label(train_labels[index])
            title = f"#{index if train_names is None else train_names[index]} given {given}"
            if train_true_labels is not None and _label(train_true_labels[index]) != given:
                title += f" (true {_label(train_true_labels[index])})"
            ax.set_title(f"{title}\n{scores[j, index]:+.2g}", fontsize=7, color=color)
    fig.suptitle(f"Test examples (left), their {k} most helpful (green) and {k} most harmful "
                 "(red) training examples by TracIn", fontsize=10)
    save(fig, path)
    return fig
