"""The per-example gradients of one batch, kept in whatever form is cheapest until asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from pergrad.rules.forms import Form, Scaled


@dataclass
class PerExampleResult:
    """Per-example gradients ``g_i`` of one batch, one form per trainable variable.

    Every method is traceable (use it inside your own ``tf.function``) and touches only what it
    needs: ``squared_norms``, ``dots`` and ``weighted_sum`` never build ``(B, *var.shape)`` tensors
    for variables whose rule has a cheaper form.

    Attributes:
        variables: the model's trainable variables, in ``model.trainable_variables`` order.
        forms: one form per variable (``None`` when the loss does not depend on it).
        losses: ``(B,)`` per-example losses, sample weights applied.
        predictions: the model's outputs for the batch.
    """

    variables: list
    forms: list[Form | None]
    losses: tf.Tensor
    predictions: Any

    @property
    def batch_size(self) -> tf.Tensor:
        return tf.shape(self.losses)[0]

    @property
    def norm_dtype(self) -> tf.DType:
        """float64 if any variable is float64, else float32 (also under mixed precision)."""
        dtypes = {tf.as_dtype(v.dtype) for v in self.variables}
        return tf.float64 if tf.float64 in dtypes else tf.float32

    def gradients(self) -> list[tf.Tensor]:
        """``[g_i for each variable]``, each ``(B, *var.shape)``."""
        return [
            tf.zeros([self.batch_size, *v.shape], v.dtype) if f is None else f.materialize()
            for v, f in zip(self.variables, self.forms, strict=True)
        ]

    def squared_norms(self) -> list[tf.Tensor]:
        """Per variable, ``||g_i[var]||^2`` of shape ``(B,)``."""
        dtype = self.norm_dtype
        return [
            tf.zeros([self.batch_size], dtype) if f is None else tf.cast(f.squared_norms(), dtype)
            for f in self.forms
        ]

    def norms(self) -> tf.Tensor:
        """``||g_i||``: the L2 norm of each example's whole gradient, ``(B,)``."""
        return tf.sqrt(tf.add_n(self.squared_norms()))

    def dots(self, vectors: list) -> list[tf.Tensor]:
        """Per variable, ``<g_i[var], v[var]>`` of shape ``(B,)``."""
        dtype = self.norm_dtype
        if len(vectors) != len(self.variables):
            raise ValueError(f"Got {len(vectors)} vectors for {len(self.variables)} trainable "
                             "variables; pass one per variable, aligned with "
                             "model.trainable_variables.")
        out = []
        for v, f, vec in zip(self.variables, self.forms, vectors, strict=True):
            if tuple(vec.shape) != tuple(v.shape):
                raise ValueError(f"Vector for variable {v.path!r} has shape {tuple(vec.shape)}, "
                                 f"expected {tuple(v.shape)}.")
            out.append(tf.zeros([self.batch_size], dtype) if f is None
                       else tf.cast(f.dots(vec), dtype))
        return out

    def dot(self, vectors: list) -> tf.Tensor:
        """``<g_i, v>`` summed over all variables, ``(B,)``."""
        return tf.add_n(self.dots(vectors))

    def grams(self) -> list[tf.Tensor]:
        """Per variable, the ``(B, B)`` matrix ``<g_i[var], g_j[var]>``."""
        dtype = self.norm_dtype
        return [tf.zeros([self.batch_size, self.batch_size], dtype) if f is None
                else tf.cast(f.gram(), dtype) for f in self.forms]

    def gram(self) -> tf.Tensor:
        """``K[i, j] = <g_i, g_j>`` over all variables, ``(B, B)``."""
        return tf.add_n(self.grams())

    def weighted_sum(self, coefficients: tf.Tensor | list[tf.Tensor]) -> list[tf.Tensor]:
        """``sum_i c_i g_i`` per variable. ``coefficients`` is ``(B,)``, or one ``(B,)`` per
        variable (per-layer clipping)."""
        if not isinstance(coefficients, (list, tuple)):
            coefficients = [coefficients] * len(self.variables)
        return [
            tf.zeros(v.shape, v.dtype) if f is None else tf.cast(f.weighted_sum(c), v.dtype)
            for v, f, c in zip(self.variables, self.forms, coefficients, strict=True)
        ]

    def masked(self, keep: tf.Tensor) -> PerExampleResult:
        """This result with examples where ``keep`` (``(B,)`` bool) is false removed: their
        gradients and losses become exactly zero, even where they were NaN or inf."""
        forms = [None if f is None else f.masked(keep) for f in self.forms]
        losses = tf.where(keep, self.losses, tf.zeros_like(self.losses))
        return PerExampleResult(self.variables, forms, losses, self.predictions)

    def scaled(self, factor) -> PerExampleResult:
        """A view with every gradient and loss multiplied by ``factor`` (norms by ``|factor|``),
        e.g. ``1 / S`` after a backward pass of the loss scaled by ``S``."""
        factor = tf.convert_to_tensor(factor)
        forms = [None if f is None else Scaled(f, factor) for f in self.forms]
        losses = self.losses * tf.cast(factor, self.losses.dtype)
        return PerExampleResult(self.variables, forms, losses, self.predictions)
