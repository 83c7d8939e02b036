"""The per-example gradients of one batch, kept in whatever form is cheapest until asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keras import ops

from pergrad.backend.ops import add_n, batch_size, dtype_of
from pergrad.rules.forms import (
    Form,
    Scaled,
    dots_many,
    rebuilt,
    routed,
    weighted_sums,
)
from pergrad.rules.query import Query


@dataclass
class PerExampleResult:
    """Per-example gradients ``g_i`` of one batch, one form per trainable variable.

    Every method is traceable (use it inside your own ``tf.function`` or ``jax.jit``) and touches only what it
    needs: ``squared_norms``, ``dots`` and ``weighted_sum`` never build ``(B, *var.shape)`` tensors
    for variables whose rule has a cheaper form. Where several quantities of one result are
    needed, declare them first (:meth:`routed`) so that each form takes the routes that serve
    them all (norms that build what the sums then read).

    Attributes:
        variables: the model's trainable variables, in ``model.trainable_variables`` order.
        forms: one form per variable (``None`` when the loss does not depend on it).
        losses: ``(B,)`` per-example losses, sample weights applied.
        predictions: the model's outputs for the batch.
    """

    variables: list
    forms: list[Form | None]
    losses: Any
    predictions: Any

    @property
    def batch_size(self) -> Any:
        return batch_size(self.losses)

    @property
    def norm_dtype(self) -> str:
        """float64 if any variable is float64, else float32 (also under mixed precision)."""
        return "float64" if "float64" in {dtype_of(v) for v in self.variables} else "float32"

    def gradients(self) -> list:
        """``[g_i for each variable]``, each ``(B, *var.shape)``."""
        return [
            ops.zeros([self.batch_size, *v.shape], v.dtype) if f is None else f.materialize()
            for v, f in zip(self.variables, self.forms, strict=True)
        ]

    def routed(self, query: Query) -> PerExampleResult:
        """The same result, each form taking the routes the cost model chooses for what
        ``query`` declares will be asked of it (:class:`pergrad.rules.query.Query`: norms
        alone, norms then weighted sums, or those and reads of each example's gradient).

        A form with a cheaper route for norms alone (a convolution's shifted ghost norms,
        :class:`pergrad.rules.forms.Factored`) builds the per-example matrices instead when
        sums or rows follow, and the sums then read them, unless only sums follow and the
        form's own sum is cheap enough to follow its ghost norms. Without it each quantity
        takes its route as if asked alone. The routed result shares what the forms built::

            routed = result.routed(NORMS_THEN_SUMS)
            norms = routed.norms()
            clipped = routed.weighted_sum(ops.minimum(1.0, clip / norms))
        """
        forms = [None if f is None else routed(f, query) for f in self.forms]
        return PerExampleResult(self.variables, forms, self.losses, self.predictions)

    def squared_norms(self) -> list:
        """Per variable, ``||g_i[var]||^2`` of shape ``(B,)``."""
        dtype = self.norm_dtype
        return [ops.zeros([self.batch_size], dtype) if f is None
                else ops.cast(f.squared_norms(), dtype) for f in self.forms]

    def norms(self) -> Any:
        """``||g_i||``: the L2 norm of each example's whole gradient, ``(B,)``."""
        return ops.sqrt(add_n(self.squared_norms()))

    def dots(self, vectors: list) -> list:
        """Per variable, ``<g_i[var], v[var]>`` of shape ``(B,)``."""
        dtype = self.norm_dtype
        self._check_vectors(vectors)
        return [ops.zeros([self.batch_size], dtype) if f is None else ops.cast(f.dots(vec), dtype)
                for f, vec in zip(self.forms, vectors, strict=True)]

    def _check_vectors(self, vectors: list) -> None:
        """One vector per variable, each of its variable's shape (a transposed vector with the
        right number of entries would otherwise give wrong numbers without an error)."""
        if len(vectors) != len(self.variables):
            raise ValueError(f"Got {len(vectors)} vectors for {len(self.variables)} trainable "
                             "variables; pass one per variable, aligned with "
                             "model.trainable_variables.")
        for v, vec in zip(self.variables, vectors, strict=True):
            if tuple(vec.shape) != tuple(v.shape):
                raise ValueError(f"Vector for variable {v.path!r} has shape {tuple(vec.shape)}, "
                                 f"expected {tuple(v.shape)}.")

    def dot(self, vectors: list) -> Any:
        """``<g_i, v>`` summed over all variables, ``(B,)``."""
        return add_n(self.dots(vectors))

    def grams(self) -> list:
        """Per variable, the ``(B, B)`` matrix ``<g_i[var], g_j[var]>``."""
        dtype = self.norm_dtype
        return [ops.zeros([self.batch_size, self.batch_size], dtype) if f is None
                else ops.cast(f.gram(), dtype) for f in self.forms]

    def gram(self) -> Any:
        """``K[i, j] = <g_i, g_j>`` over all variables, ``(B, B)``."""
        return add_n(self.grams())

    def weighted_sum(self, coefficients: Any) -> list:
        """``sum_i c_i g_i`` per variable. ``coefficients`` is ``(B,)``, or one ``(B,)`` per
        variable (per-layer clipping)."""
        if not isinstance(coefficients, (list, tuple)):
            coefficients = [coefficients] * len(self.variables)
        return [
            ops.zeros(v.shape, v.dtype) if f is None else ops.cast(f.weighted_sum(c), v.dtype)
            for v, f, c in zip(self.variables, self.forms, coefficients, strict=True)
        ]

    def weighted_sums(self, coefficients: list) -> list:
        """``[self.weighted_sum(c) for c in coefficients]`` (each ``c`` of shape ``(B,)``), with
        each form reading its data once for all of them (:meth:`Factored.weighted_sums`)."""
        per_variable = [
            [ops.zeros(v.shape, v.dtype)] * len(coefficients) if f is None
            else [ops.cast(s, v.dtype) for s in weighted_sums(f, coefficients)]
            for v, f in zip(self.variables, self.forms, strict=True)]
        return [list(sums) for sums in zip(*per_variable, strict=True)]

    def dots_many(self, vector_sets: list) -> list:
        """``[self.dots(vectors) for vectors in vector_sets]``, with each form reading its data
        once for all of them (:meth:`Factored.dots_many`)."""
        dtype = self.norm_dtype
        for vectors in vector_sets:
            self._check_vectors(vectors)
        per_variable = [
            [ops.zeros([self.batch_size], dtype)] * len(vector_sets) if f is None
            else [ops.cast(d, dtype) for d in dots_many(f, [vs[k] for vs in vector_sets])]
            for k, f in enumerate(self.forms)]
        return [list(dots) for dots in zip(*per_variable, strict=True)]

    def kept_weighted_sum(self, coefficients: Any, keep: Any) -> list:
        """``sum_{i: keep_i} c_i g_i`` per variable, the rows of dropped examples zeroed before
        summing (:meth:`masked`), so a NaN row cannot leak through ``0 * NaN``.

        The plain sum is built outside the conditional, which only chooses it or the masked
        sum: inside a ``lax.cond`` branch XLA cannot reuse the per-example matrices the norms
        built outside it (measured: docs/benchmarks.md, "Route measurements"). A masked form
        reads only what its ``masked`` method needs
        (``Factored.remake``), or a compiled graph would compute those inputs (patches) at every
        step."""
        plain = self.weighted_sum(coefficients)
        return list(ops.cond(ops.all(keep), lambda: [ops.copy(s) for s in plain],
                             lambda: self.masked(keep).weighted_sum(coefficients)))

    def masked(self, keep: Any) -> PerExampleResult:
        """This result with examples where ``keep`` (``(B,)`` bool) is false removed: their
        gradients and losses become exactly zero, even where they were NaN or inf."""
        forms = [None if f is None else f.masked(keep) for f in self.forms]
        losses = ops.where(keep, self.losses, ops.zeros_like(self.losses))
        return PerExampleResult(self.variables, forms, losses, self.predictions)

    def rebuilt(self) -> PerExampleResult:
        """The same result with each form recomputed from its layer's recorded tensors
        (:meth:`pergrad.rules.forms.Factored.rebuilt`): call it inside a conditional branch
        (``ops.cond``), so that the branch reads only those tensors and a step that skips the
        branch never computes what only the branch needs (a convolution's patches)."""
        forms = [None if f is None else rebuilt(f) for f in self.forms]
        return PerExampleResult(self.variables, forms, self.losses, self.predictions)

    def scaled(self, factor) -> PerExampleResult:
        """A view with every gradient and loss multiplied by ``factor`` (norms by ``|factor|``),
        e.g. ``1 / S`` after a backward pass of the loss scaled by ``S``."""
        factor = ops.convert_to_tensor(factor)
        forms = [None if f is None else Scaled(f, factor) for f in self.forms]
        losses = self.losses * ops.cast(factor, dtype_of(self.losses))
        return PerExampleResult(self.variables, forms, losses, self.predictions)

