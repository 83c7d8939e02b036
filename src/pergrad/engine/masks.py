"""Keras masks of model outputs, kept across the operations that drop them.

A layer's padding mask (``Embedding(mask_zero=True)``) travels as an attribute of the output
tensor, and Keras's compiled loss and metrics average over the valid entries it marks. Any new
tensor made from the output (a detached copy, an output through ``jax.vjp``'s auxiliary values,
rows zeroed or removed) starts without one; these helpers carry it over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from pergrad._compat import keras_mask, set_keras_mask


def masks_of(structure: Any) -> dict[int, Any]:
    """``{k: mask}`` for the leaves of ``structure`` (flat positions ``k``) that have a Keras
    mask: only tensors, so that it passes as auxiliary output of ``jax.vjp`` or
    ``torch.func.jacrev``."""
    leaves = keras.tree.flatten(structure)
    masks = {k: None if t is None else keras_mask(t) for k, t in enumerate(leaves)}
    return {k: m for k, m in masks.items() if m is not None}


def with_masks(structure: Any, masks: dict[int, Any]) -> Any:
    """``structure`` with ``masks`` (from :func:`masks_of` of a structure of the same shape)
    attached to its leaves; returns ``structure``."""
    leaves = keras.tree.flatten(structure)
    for k, mask in masks.items():
        set_keras_mask(leaves[k], mask)
    return structure


def map_keeping_masks(fn: Callable[[Any], Any], structure: Any,
                      on_mask: Callable[[Any], Any] | None = None) -> Any:
    """``fn`` applied to every tensor leaf, each result given its leaf's mask (``on_mask`` of
    it when given: a mask detached, or its rows removed along with the tensor's)."""
    def one(t):
        if t is None:
            return t
        out = fn(t)
        mask = keras_mask(t)
        if mask is not None and out is not t:
            set_keras_mask(out, mask if on_mask is None else on_mask(mask))
        return out

    return keras.tree.map_structure(one, structure)
