"""The shapes a per-example gradient can take before it is materialized.

A rule never returns a ``(B, *var.shape)`` tensor unless that is the cheapest honest form. It
returns one of three *forms*, each of which knows how to compute, for its variable ``W`` and every
example ``i`` of the batch:

* ``materialize()``     -> ``g_i``                   shape ``(B, *W.shape)``
* ``squared_norms()``   -> ``||g_i||^2``             shape ``(B,)``
* ``dots(V)``           -> ``<g_i, V>``              shape ``(B,)``
* ``weighted_sum(c)``   -> ``sum_i c_i g_i``         shape ``W.shape``
* ``gram()``            -> ``<g_i, g_j>``            shape ``(B, B)``

The forms:

``Factored``
    ``g_i[I, G, O] = sum_t A_i[t, G, I] D_i[t, G, O]``: a sum of outer products over ``T``
    positions (sequence steps, pixels) in ``G`` independent groups. Dense, EinsumDense and
    convolution kernels have this form, with ``A`` the layer input (or its patches) and ``D`` the
    gradient at the layer's pre-activation output (Goodfellow 2015).
``Materialized``
    ``g_i`` itself, for small variables (biases, normalization scales) and the generic rule.
``Rows``
    ``g_i[n, :] = sum_t [ids_i[t] = n] D_i[t, :]``: an embedding table's gradient, nonzero only in
    the rows an example looked up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import tensorflow as tf

from pergrad._compat import current_graph


def _static(dim: int | None) -> int | None:
    return None if dim is None else int(dim)


@dataclass
class Factored:
    """``g_i = sum_t A_i[t]^T D_i[t]`` per group, reshaped to the variable.

    ``a``: ``(B, T, G, I)``; ``d``: ``(B, T, G, O)``. ``natural_shape`` is the variable's shape
    with its axes ordered as ``(I-axes..., G-axes..., O-axes...)``; ``perm`` transposes that
    natural layout into the variable's layout (``None`` for the identity), after which a reshape
    to ``variable.shape`` is all that is left. ``summed``, when given, computes
    ``weighted_sum(c)`` with a faster native kernel (a convolution's filter gradient).
    """

    variable: object
    a: tf.Tensor
    d: tf.Tensor
    natural_shape: tuple[int, ...]
    perm: tuple[int, ...] | None = None
    summed: Callable[[tf.Tensor], tf.Tensor] | None = None
    _matrices: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def var_shape(self) -> tuple[int, ...]:
        return tuple(self.variable.shape)

    @property
    def signature(self) -> tuple:
        return ("factored", self.natural_shape, self.perm, tuple(self.a.shape[2:]),
                tuple(self.d.shape[2:]))

    def _to_variable_layout(self, m: tf.Tensor, batched: bool) -> tf.Tensor:
        lead = [tf.shape(m)[0]] if batched else []
        m = tf.reshape(m, lead + list(self.natural_shape))
        if self.perm is not None:
            offset = 1 if batched else 0
            m = tf.transpose(m, ([0] if batched else []) + [p + offset for p in self.perm])
        return tf.reshape(m, lead + list(self.var_shape))

    def _from_variable_layout(self, v: tf.Tensor) -> tf.Tensor:
        """Inverse of ``_to_variable_layout`` for one unbatched tensor, returned as (I, G, O)."""
        if self.perm is not None:
            permuted = [self.natural_shape[p] for p in self.perm]
            v = tf.reshape(v, permuted)
            inverse = [0] * len(self.perm)
            for position, axis in enumerate(self.perm):
                inverse[axis] = position
            v = tf.transpose(v, inverse)
        g, i, o = self.a.shape[2], self.a.shape[3], self.d.shape[3]
        # natural order is (I..., G..., O...): reshape to (I, G, O)
        return tf.reshape(v, [i, g, o])

    def _per_example_matrices(self) -> tf.Tensor:
        """``(B, G, O, I)``: ``sum_t d_t a_t^T`` per example and group, in the layout TensorFlow
        multiplies fastest (``matmul(D, A, transpose_a=True)``: 0.6 ms against 1.8 ms for
        ``A^T D`` with the benchmark CNN's first layer). Built once per form: norms, dots and
        Gram matrices share it; only ``materialize`` transposes it to the variable's layout."""
        graph = current_graph()
        if self._matrices is None or self._matrices[0] is not graph:
            a, d = self.a, self.d
            if a.shape[1] == 1:  # one position: a plain outer product
                m = d[:, 0, :, :, None] * a[:, 0, :, None, :]
            elif a.shape[2] == 1:
                m = tf.matmul(d[:, :, 0, :], a[:, :, 0, :], transpose_a=True)[:, None]
            else:
                m = tf.matmul(tf.transpose(d, [0, 2, 1, 3]), tf.transpose(a, [0, 2, 1, 3]),
                              transpose_a=True)
            # Remembered per graph: a tensor made inside a tf.cond branch is not usable outside.
            self._matrices = (graph, m)
        return self._matrices[1]

    def materialize(self) -> tf.Tensor:
        if self.a.shape[1] == 1:
            # One position: write the outer products once, straight into the (B, I, G, O)
            # layout (they are memory-bound: B I O floats for a Dense kernel).
            a = tf.transpose(self.a[:, 0], [0, 2, 1])  # (B, I, G); G is 1 for Dense
            m = a[:, :, :, None] * self.d[:, 0][:, None, :, :]
        else:
            m = tf.transpose(self._per_example_matrices(), [0, 3, 1, 2])  # (B, I, G, O)
        return self._to_variable_layout(m, batched=True)

    def _materializing(self) -> bool:
        """Whether norms go through the per-example matrices (``T I O`` per example) rather than
        the ghost Gram form (``T^2 (I + O)``). One batched GEMM runs about twice as fast per
        multiply-add as the two Gram einsums here, hence the factor 2 (measured on the benchmark
        CNN's second layer: 5.1 ms materialized against 5.9 ms ghost at ``T I O = 0.9 T^2 (I+O)``)."""
        t, i, o = _static(self.a.shape[1]), _static(self.a.shape[3]), _static(self.d.shape[3])
        return t is None or t * i * o <= 2 * t * t * (i + o)

    def squared_norms(self) -> tf.Tensor:
        t = _static(self.a.shape[1])
        if t == 1:
            # ||a d^T||^2 = ||a||^2 ||d||^2 per group.
            return tf.reduce_sum(
                tf.reduce_sum(tf.square(self.a), [1, 3]) * tf.reduce_sum(tf.square(self.d), [1, 3]),
                axis=1,
            )
        if not self._materializing():
            # ||sum_t a_t d_t^T||^2 = sum_{t,s} (a_t . a_s)(d_t . d_s)   (the Gram or "ghost" trick)
            gram_a = tf.einsum("btgi,bsgi->bgts", self.a, self.a)
            gram_d = tf.einsum("btgo,bsgo->bgts", self.d, self.d)
            return tf.reduce_sum(gram_a * gram_d, axis=[1, 2, 3])
        m = self._per_example_matrices()
        return tf.reduce_sum(tf.square(m), axis=[1, 2, 3])

    def dots(self, vector: tf.Tensor) -> tf.Tensor:
        v = self._from_variable_layout(tf.cast(vector, self.a.dtype))
        if self.a.shape[1] != 1 and self._materializing():
            # The per-example matrices are built for the norms anyway (and shared with them
            # inside one graph): <M_i, V> costs I O per example instead of T I O.
            m = self._per_example_matrices()
            v = tf.transpose(v, [1, 2, 0])  # (G, O, I), as the matrices
            return tf.reduce_sum(tf.reshape(m * v[None], [tf.shape(m)[0], -1]), axis=1)
        av = tf.einsum("btgi,igo->btgo", self.a, v)
        return tf.reduce_sum(av * self.d, axis=[1, 2, 3])

    def weighted_sum(self, coefficients: tf.Tensor) -> tf.Tensor:
        if self.summed is not None:
            return tf.reshape(self.summed(coefficients), self.var_shape)
        c = tf.cast(coefficients, self.a.dtype)[:, None, None, None]
        i, g, o = self.a.shape[3], self.a.shape[2], self.d.shape[3]
        if g == 1:  # one matmul over all (example, position) rows, like the batch gradient
            m = tf.matmul(tf.reshape(self.a * c, [-1, i]), tf.reshape(self.d, [-1, o]),
                          transpose_a=True)[:, None, :]
        else:
            m = tf.einsum("btgi,btgo->igo", self.a * c, self.d)
        return self._to_variable_layout(m, batched=False)

    def gram(self) -> tf.Tensor:
        """``K[i, j] = <g_i, g_j>``, ``(B, B)``: ghost ``sum_{t,s} (a_it . a_js)(d_it . d_js)``
        or the materialized ``M M^T``, whichever costs less."""
        t, i, o = _static(self.a.shape[1]), _static(self.a.shape[3]), _static(self.d.shape[3])
        if t is not None and t * t * (i + o) < t * i * o + i * o:
            gram_a = tf.einsum("btgi,csgi->bcgts", self.a, self.a)
            gram_d = tf.einsum("btgo,csgo->bcgts", self.d, self.d)
            return tf.reduce_sum(gram_a * gram_d, axis=[2, 3, 4])
        flat = tf.reshape(self._per_example_matrices(), [tf.shape(self.a)[0], -1])
        return tf.matmul(flat, flat, transpose_b=True)

    def masked(self, keep: tf.Tensor) -> Factored:
        """The form with the rows of examples where ``keep`` is false set to zero (NaN rows
        included). The native ``summed`` kernel reads the unmasked inputs, so it is used only
        while every row is kept."""
        plain = Factored(self.variable, zero_rows(self.a, keep), zero_rows(self.d, keep),
                         self.natural_shape, self.perm)
        if self.summed is None:
            return plain
        native = self.summed

        def summed(coefficients):  # the native kernel while no row is dropped
            return tf.cond(tf.reduce_all(keep), lambda: tf.reshape(native(coefficients),
                                                                    self.var_shape),
                           lambda: plain.weighted_sum(coefficients))

        return Factored(self.variable, plain.a, plain.d, self.natural_shape, self.perm, summed)

    def merged_with(self, other: Factored) -> Factored:
        """Two calls of one layer: the sums over positions concatenate along ``T``."""
        summed = None
        if self.summed is not None and other.summed is not None:
            def summed(c, first=self.summed, second=other.summed):
                return first(c) + second(c)
        return Factored(self.variable, tf.concat([self.a, other.a], 1),
                        tf.concat([self.d, other.d], 1), self.natural_shape, self.perm, summed)


@dataclass
class Materialized:
    """``g_i`` given explicitly, shape ``(B, *variable.shape)``."""

    variable: object
    value: tf.Tensor

    signature = ("materialized",)

    def materialize(self) -> tf.Tensor:
        return self.value

    def squared_norms(self) -> tf.Tensor:
        flat = tf.reshape(self.value, [tf.shape(self.value)[0], -1])
        return tf.reduce_sum(tf.square(flat), axis=1)

    def dots(self, vector: tf.Tensor) -> tf.Tensor:
        prod = self.value * tf.cast(vector, self.value.dtype)[None]
        return tf.reduce_sum(tf.reshape(prod, [tf.shape(prod)[0], -1]), axis=1)

    def weighted_sum(self, coefficients: tf.Tensor) -> tf.Tensor:
        c = tf.cast(coefficients, self.value.dtype)
        return tf.tensordot(c, self.value, axes=1)

    def gram(self) -> tf.Tensor:
        flat = tf.reshape(self.value, [tf.shape(self.value)[0], -1])
        return tf.matmul(flat, flat, transpose_b=True)

    def masked(self, keep: tf.Tensor) -> Materialized:
        return Materialized(self.variable, zero_rows(self.value, keep))

    def merged_with(self, other: Materialized) -> Materialized:
        return Materialized(self.variable, self.value + other.value)


@dataclass
class Rows:
    """An embedding table's gradient: ``g_i[n] = sum_t [ids_i[t] = n] D_i[t]``.

    ``ids``: ``(B, T)`` integers; ``d``: ``(B, T, O)``; the table is ``(num_rows, O)``. Norms use
    one segment sum over the distinct (example, row) pairs, so repeated ids within an example are
    summed before squaring, as they must be.
    """

    variable: object
    ids: tf.Tensor
    d: tf.Tensor

    signature = ("rows",)

    @property
    def num_rows(self) -> int:
        return int(self.variable.shape[0])

    def _example_row_keys(self) -> tf.Tensor:
        batch = tf.shape(self.ids, out_type=tf.int64)[0]
        example = tf.range(batch, dtype=tf.int64)[:, None]
        return example * self.num_rows + tf.cast(self.ids, tf.int64)

    def _flat_d(self) -> tf.Tensor:
        return tf.reshape(self.d, [-1, self.d.shape[-1]])

    def materialize(self) -> tf.Tensor:
        batch = tf.shape(self.ids)[0]
        keys = tf.reshape(self._example_row_keys(), [-1])
        rows = tf.math.unsorted_segment_sum(self._flat_d(), keys,
                                            tf.cast(batch, tf.int64) * self.num_rows)
        return tf.reshape(rows, [batch, *self.variable.shape])

    def squared_norms(self) -> tf.Tensor:
        keys = tf.reshape(self._example_row_keys(), [-1])
        unique_keys, position = tf.unique(keys)
        rows = tf.math.unsorted_segment_sum(self._flat_d(), position, tf.size(unique_keys))
        row_sq = tf.reduce_sum(tf.square(rows), axis=1)
        example = unique_keys // self.num_rows
        return tf.math.unsorted_segment_sum(row_sq, example, tf.cast(tf.shape(self.ids)[0], tf.int64))

    def dots(self, vector: tf.Tensor) -> tf.Tensor:
        looked_up = tf.gather(tf.cast(vector, self.d.dtype), self.ids)
        return tf.reduce_sum(looked_up * self.d, axis=[1, 2])

    def weighted_sum(self, coefficients: tf.Tensor) -> tf.Tensor:
        c = tf.cast(coefficients, self.d.dtype)[:, None, None]
        flat = tf.reshape(self.d * c, [-1, self.d.shape[-1]])
        return tf.math.unsorted_segment_sum(flat, tf.reshape(self.ids, [-1]), self.num_rows)

    def gram(self) -> tf.Tensor:
        """``<g_i, g_j> = sum_{t,s} [ids_it = ids_js] (d_it . d_js)``."""
        same = tf.cast(tf.equal(self.ids[:, None, :, None], self.ids[None, :, None, :]), self.d.dtype)
        dd = tf.einsum("bto,cso->bcts", self.d, self.d)
        return tf.reduce_sum(same * dd, axis=[2, 3])

    def masked(self, keep: tf.Tensor) -> Rows:
        return Rows(self.variable, self.ids, zero_rows(self.d, keep))

    def merged_with(self, other: Rows) -> Rows:
        return Rows(self.variable, tf.concat([self.ids, other.ids], 1),
                    tf.concat([self.d, other.d], 1))


class Scaled:
    """``factor`` times the gradients of ``inner`` (``factor^2`` for norms and Gram matrices):
    how ``PerExampleModel`` undoes loss scaling without recomputing anything."""

    def __init__(self, inner, factor: tf.Tensor) -> None:
        self.inner, self.factor, self.variable = inner, factor, inner.variable

    def _times(self, t: tf.Tensor, power: int = 1) -> tf.Tensor:
        return t * tf.cast(self.factor, t.dtype) ** power

    def materialize(self) -> tf.Tensor:
        return self._times(self.inner.materialize())

    def squared_norms(self) -> tf.Tensor:
        return self._times(self.inner.squared_norms(), 2)

    def dots(self, vector: tf.Tensor) -> tf.Tensor:
        return self._times(self.inner.dots(vector))

    def weighted_sum(self, coefficients: tf.Tensor) -> tf.Tensor:
        return self._times(self.inner.weighted_sum(coefficients))

    def gram(self) -> tf.Tensor:
        return self._times(self.inner.gram(), 2)

    def masked(self, keep: tf.Tensor) -> Scaled:
        return Scaled(self.inner.masked(keep), self.factor)

    @property
    def signature(self) -> tuple:
        return ("scaled",)

    def merged_with(self, other):
        return Materialized(self.variable, self.materialize() + other.materialize())


def zero_rows(t: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
    """``t`` with the rows (first axis) where ``keep`` is false replaced by zeros (not multiplied:
    NaN and inf rows become 0 too)."""
    mask = tf.reshape(keep, [-1] + [1] * (t.shape.rank - 1))
    return tf.where(mask, t, tf.zeros_like(t))


Form = Factored | Materialized | Rows | Scaled


def combine(forms: list[Form]) -> Form:
    """The form of a variable used by several calls: merge like forms, else materialize and add."""
    result = forms[0]
    for form in forms[1:]:
        if type(form) is type(result) and form.signature == result.signature:
            result = result.merged_with(form)
        else:
            result = Materialized(result.variable, result.materialize() + form.materialize())
    return result


def positions(dims) -> int:
    """The number of positions ``T`` spanned by ``dims`` (static sizes), or -1 when one is
    unknown. Reshapes use it instead of -1 so that ``T`` stays static after the batch dimension
    becomes dynamic (a retrace with ``reduce_retracing``): the cost model needs it."""
    dims = list(dims)
    if any(d is None for d in dims):
        return -1
    return int(math.prod(int(d) for d in dims))


def unbroadcast(grad: tf.Tensor, shape: tuple[int, ...]) -> tf.Tensor:
    """Per-example gradient of a parameter of ``shape`` added with broadcasting to ``grad``'s rows.

    ``grad`` is ``(B, ...)``; leading non-batch axes beyond ``len(shape)`` and axes where the
    parameter has size 1 are summed, giving ``(B, *shape)``.
    """
    extra = grad.shape.rank - 1 - len(shape)
    if extra > 0:
        grad = tf.reduce_sum(grad, axis=list(range(1, 1 + extra)))
    keep = [i + 1 for i, n in enumerate(shape) if n == 1 and grad.shape[i + 1] != 1]
    if keep:
        grad = tf.reduce_sum(grad, axis=keep, keepdims=True)
    return tf.reshape(grad, [tf.shape(grad)[0], *shape])
