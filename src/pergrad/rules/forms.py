"""The shapes a per-example gradient can take before it is materialized.

A rule never returns a ``(B, *var.shape)`` tensor unless that is the cheapest honest form. It
returns *forms* (the :class:`Form` protocol; the classes below implement it), each of which
knows how to compute, for its variable ``W`` and every example ``i`` of the batch:

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
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from keras import ops

from pergrad.backend import native
from pergrad.backend.ops import (
    add_n,
    batch_size,
    dtype_of,
    matmul_ta,
    outer_products,
    rank,
    row_squared_norms,
    segment_sum,
    static_or_none,
    trace_token,
    zero_rows,
)
from pergrad.rules import cost
from pergrad.rules.cost import FactoredRoute, factored_route, prefers_ghost
from pergrad.rules.query import NORMS_ALONE, Query

Tensor = Any


@dataclass(frozen=True)
class Deferred:
    """A tensor a rule may never need, built on first use: ``build()`` makes it; ``shape`` (its
    static shape) and ``dtype`` are known before. On PyTorch, which runs every op as it is
    written, a convolution's patches are deferred so that the routes that never read them (its
    shifted products and sums, one grouped filter gradient) do not pay for building them.
    Graph backends need no such thing (their compilers prune what no output reads), and must
    not use it: a tensor built inside a conditional branch cannot be reused outside it."""

    build: Callable[[], Tensor]
    shape: tuple
    dtype: Any


class Built:
    """What a :class:`Factored` form built, shared with its routed copies: ``a`` from a
    :class:`Deferred` source, and the per-example matrices' blocks with the trace they were
    built in (:func:`pergrad.backend.ops.trace_token`). On TensorFlow that is the graph: a
    tensor made inside a ``tf.cond`` branch is not usable outside it, one of an enclosing graph
    is (captured). Under ``jax.jit`` (no token) no blocks are kept: XLA merges the repeated
    products. ``a`` is kept whatever the token: only PyTorch, which has none of these scopes,
    defers it. It is a cache only: the routes never read it."""

    def __init__(self) -> None:
        self.a: Tensor | None = None
        self._blocks: tuple | None = None

    def blocks_for(self, token: Any) -> list | None:
        """The blocks built in ``token``'s trace or one enclosing it, else ``None``."""
        if token is None or self._blocks is None:
            return None
        built_in, blocks = self._blocks
        graph = token
        while graph is not None:
            if graph is built_in:
                return blocks
            graph = getattr(graph, "outer_graph", None)
        return None

    def remember_blocks(self, token: Any, blocks: list) -> None:
        if token is not None:
            self._blocks = (token, blocks)


@dataclass
class Factored:
    """``g_i = sum_t A_i[t]^T D_i[t]`` per group, reshaped to the variable.

    ``a``: ``(B, T, G, I)``, given as ``a_source``, a tensor or a :class:`Deferred` one
    built the first time a route reads ``a``; ``d``: ``(B, T, G, O)``. ``natural_shape`` is the variable's shape
    with its axes ordered as ``(I-axes..., G-axes..., O-axes...)``; ``perm`` transposes that
    natural layout into the variable's layout (``None`` for the identity), after which a reshape
    to ``variable.shape`` is all that is left. ``summed``, when given, computes
    ``weighted_sum(c)`` with a faster native kernel (a convolution's filter gradient).
    ``per_example``, when given, computes the per-example matrices ``(B, G, O, I)``
    (``sum_t D_i[t]^T A_i[t]`` per group) with a faster native kernel (a depthwise
    convolution's filter gradient with the batch folded into the channels), or a list of
    blocks ``(B, G, O, I_k)`` whose concatenation along ``I`` they are (a convolution's one
    product per kernel offset: the norms, dots and sums read the blocks, and only
    ``materialize`` writes the concatenation); norms, dots and Gram matrices then always take
    the materialized route. ``ghost_norms``, when given beside ``per_example``, computes the
    per-example squared norms alone by a ghost route the rule knows to be cheaper (a stride-1
    convolution's shifted Gram of its input); ``ghost_before_sums`` says that route and
    ``summed`` beat the matrices when only sums follow the norms.
    ``remake``, when given, rebuilds the form from the layer's inputs with the rows of examples where ``keep`` is false zeroed
    (``remake(keep)``); :meth:`masked` then uses it, so a masked form computed inside a
    conditional reads only the layer's input and output gradient, not tensors (patches) that
    the plain routes never build. ``remake(None)`` must work too and give the unmasked form:
    :meth:`rebuilt` calls it inside conditional branches, which are traced (so called) at every
    compilation.

    The form holds the math; which route computes each quantity is its ``route``
    (:class:`pergrad.rules.cost.FactoredRoute`), chosen by the cost model
    (:func:`pergrad.rules.cost.factored_route`) for what the caller declares it will ask
    (:meth:`routed` with a :class:`pergrad.rules.query.Query`; without one, as for norms
    alone), never by what ran before. What the form builds (``a`` from a :class:`Deferred`
    source, the per-example matrices once per trace) is remembered and shared with its routed
    copies, so norms and the sums that follow them read one set of matrices.
    """

    variable: object
    a_source: Tensor | Deferred
    d: Tensor
    natural_shape: tuple[int, ...]
    perm: tuple[int, ...] | None = None
    summed: Callable[[Tensor], Tensor] | None = None
    per_example: Callable[[], Tensor] | None = None
    remake: Callable[[Tensor], Factored] | None = None
    ghost_norms: Callable[[], Tensor] | None = None
    ghost_before_sums: bool = False
    route: FactoredRoute | None = field(default=None, repr=False, compare=False)
    built: Built = field(default_factory=Built, repr=False, compare=False)

    @property
    def a(self) -> Tensor:
        """``A``, ``(B, T, G, I)``; a :class:`Deferred` source is built now, once."""
        if not isinstance(self.a_source, Deferred):
            return self.a_source
        if self.built.a is None:
            self.built.a = self.a_source.build()
        return self.built.a

    def routed(self, query: Query) -> Factored:
        """This form taking the routes the cost model chooses for ``query`` (what the caller
        will ask of it: :class:`pergrad.rules.query.Query`), sharing what it built."""
        return replace(self, route=self.route_for(query))  # the same ``built``, shared

    def route_for(self, query: Query) -> FactoredRoute:
        """:func:`pergrad.rules.cost.factored_route` for this form's sizes and kernels, within
        the running backend's :class:`pergrad.backend.routes.Routes`."""
        sizes = [static_or_none(n) for n in (self.a_shape[0], self.a_shape[2], self.a_shape[3],
                                             self.d.shape[3])]
        routes = native().ROUTES
        return factored_route(
            positions=static_or_none(self.a_shape[1]), inputs=sizes[2], outputs=sizes[3],
            matrix_elements=None if None in sizes else math.prod(sizes),
            native_products=self.per_example is not None,
            rule_ghost=self.ghost_norms is not None, ghost_before_sums=self.ghost_before_sums,
            native_sums=self.summed is not None, query=query,
            products_in_variable_order=routes.products_in_variable_order,
            forced=routes.factored_norms)

    @property
    def _route(self) -> FactoredRoute:
        return self.route if self.route is not None else self.route_for(NORMS_ALONE)

    @property
    def a_shape(self) -> tuple:
        """``A``'s static shape, read without building a :class:`Deferred` one."""
        return tuple(self.a_source.shape)

    @property
    def a_dtype(self) -> Any:
        source = self.a_source
        return source.dtype if isinstance(source, Deferred) else dtype_of(source)

    @property
    def var_shape(self) -> tuple[int, ...]:
        return tuple(self.variable.shape)

    @property
    def signature(self) -> tuple:
        return ("factored", self.natural_shape, self.perm, tuple(self.a_shape[2:]),
                tuple(self.d.shape[2:]))

    def _to_variable_layout(self, m: Tensor, batched: bool) -> Tensor:
        lead = [batch_size(m)] if batched else []
        m = ops.reshape(m, lead + list(self.natural_shape))
        if self.perm is not None:
            offset = 1 if batched else 0
            m = ops.transpose(m, ([0] if batched else []) + [p + offset for p in self.perm])
        return ops.reshape(m, lead + list(self.var_shape))

    def _from_variable_layout(self, v: Tensor) -> Tensor:
        """Inverse of ``_to_variable_layout`` for one unbatched tensor, returned as (I, G, O)."""
        if self.perm is not None:
            permuted = [self.natural_shape[p] for p in self.perm]
            v = ops.reshape(v, permuted)
            inverse = [0] * len(self.perm)
            for position, axis in enumerate(self.perm):
                inverse[axis] = position
            v = ops.transpose(v, inverse)
        g, i, o = self.a_shape[2], self.a_shape[3], self.d.shape[3]
        # natural order is (I..., G..., O...): reshape to (I, G, O)
        return ops.reshape(v, [i, g, o])

    def _per_example_blocks(self) -> list:
        """``[(B, G, O, I_k), ...]``: ``sum_t d_t a_t^T`` per example and group, in blocks along
        ``I`` (one block unless ``per_example`` gives several), in the layout TensorFlow
        multiplies fastest (``matmul(D, A, transpose_a=True)``; docs/benchmarks.md, "Route
        measurements"). Built once per trace and shared by the form's routed copies
        (:class:`Built`; on TensorFlow reused from an enclosing graph, rebuilt on JAX, where XLA
        merges the repeats): norms, dots, sums and Gram matrices share them; only
        ``materialize`` concatenates them and transposes to the variable's layout."""
        token = trace_token()
        blocks = self.built.blocks_for(token)
        if blocks is None:
            d = self.d
            if self.per_example is not None:
                m = self.per_example()
            elif self.a_shape[1] == 1:  # one position: a plain outer product
                m = d[:, 0, :, :, None] * self.a[:, 0, :, None, :]
            elif self.a_shape[2] == 1:
                m = matmul_ta(d[:, :, 0, :], self.a[:, :, 0, :])[:, None]
            else:
                m = matmul_ta(ops.transpose(d, [0, 2, 1, 3]),
                              ops.transpose(self.a, [0, 2, 1, 3]))
            blocks = _as_blocks(m)
            self.built.remember_blocks(token, blocks)
        return blocks

    def _per_example_matrices(self) -> Tensor:
        """``(B, G, O, I)``: the blocks of :meth:`_per_example_blocks` side by side."""
        return _side_by_side(self._per_example_blocks())

    def _split_inputs(self, v: Tensor, blocks: list) -> list:
        """``v`` (``(..., I)``) cut along its last axis as the blocks cut ``I``."""
        if len(blocks) == 1:
            return [v]
        parts, start = [], 0
        for block in blocks:
            width = block.shape[-1]
            parts.append(v[..., start:start + width])
            start += width
        return parts

    def materialize(self) -> Tensor:
        if self.a_shape[1] == 1 and self.per_example is None:
            # One position: write the outer products once, straight into the (B, I, G, O)
            # layout (they are memory-bound: B I O floats for a Dense kernel).
            a = ops.transpose(self.a[:, 0], [0, 2, 1])  # (B, I, G); G is 1 for Dense
            m = outer_products(a, self.d[:, 0])
        elif self._route.gradients == "variable_order":
            m = self._products_in_variable_order()
        else:
            m = ops.transpose(self._per_example_matrices(), [0, 3, 1, 2])  # (B, I, G, O)
        return self._to_variable_layout(m, batched=True)

    def _products_in_variable_order(self) -> Tensor:
        """``(B, I, G, O)``: ``sum_t a_t d_t^T`` per example and group, multiplied in that
        order (``A^T D``) where no per-example blocks (``D^T A``) were built to transpose,
        which is faster than ``D^T A`` and its transpose (docs/benchmarks.md, "Route
        measurements")."""
        if self.a_shape[2] == 1:
            return matmul_ta(self.a[:, :, 0, :], self.d[:, :, 0, :])[:, :, None, :]
        m = matmul_ta(ops.transpose(self.a, [0, 2, 1, 3]), ops.transpose(self.d, [0, 2, 1, 3]))
        return ops.transpose(m, [0, 2, 1, 3])  # (B, G, I, O) -> (B, I, G, O)

    def squared_norms(self) -> Tensor:
        """``||g_i||^2`` by the route's ``norms``."""
        route = self._route.norms
        if route == "rule_ghost":
            return self.ghost_norms()
        if route == "outer":
            # ||a d^T||^2 = ||a||^2 ||d||^2 per group.
            return ops.sum(
                ops.sum(ops.square(self.a), [1, 3]) * ops.sum(ops.square(self.d), [1, 3]),
                axis=1,
            )
        if route == "gram":
            # ||sum_t a_t d_t^T||^2 = sum_{t,s} (a_t . a_s)(d_t . d_s)   (the Gram or "ghost" trick)
            gram_a = ops.einsum("btgi,bsgi->bgts", self.a, self.a)
            gram_d = ops.einsum("btgo,bsgo->bgts", self.d, self.d)
            return ops.sum(gram_a * gram_d, axis=[1, 2, 3])
        return add_n([row_squared_norms(m) for m in self._per_example_blocks()])

    def dots(self, vector: Tensor) -> Tensor:
        v = self._from_variable_layout(ops.cast(vector, self.a_dtype))
        if self._route.dots == "matrices":
            # The per-example matrices are built for the norms anyway (and shared with them
            # inside one graph): <M_i, V> costs I O per example instead of T I O. One
            # matrix-vector product reads M once; M * V then a sum wrote and read an M-sized
            # tensor again (docs/benchmarks.md, "Route measurements").
            blocks = self._per_example_blocks()
            v = ops.transpose(v, [1, 2, 0])  # (G, O, I), as the matrices
            return add_n([ops.matmul(ops.reshape(m, [batch_size(m), -1]),
                                     ops.reshape(vk, [-1, 1]))[:, 0]
                          for m, vk in zip(blocks, self._split_inputs(v, blocks), strict=True)])
        av = ops.einsum("btgi,igo->btgo", self.a, v)
        return ops.sum(av * self.d, axis=[1, 2, 3])

    def weighted_sum(self, coefficients: Tensor) -> Tensor:
        if self._route.sums == "matrices":  # sum_i c_i M_i: B I O reads, not B T I O multiply-adds
            blocks = self._per_example_blocks()
            c = ops.cast(coefficients, dtype_of(blocks[0]))
            s = _side_by_side([ops.tensordot(c, m, axes=1) for m in blocks])  # (G, O, I)
            return self._to_variable_layout(ops.transpose(s, [2, 0, 1]), batched=False)
        if self.summed is not None:
            return ops.reshape(self.summed(coefficients), self.var_shape)
        c = ops.cast(coefficients, self.a_dtype)[:, None, None, None]
        i, g, o = self.a_shape[3], self.a_shape[2], self.d.shape[3]
        if g == 1:  # one matmul over all (example, position) rows, like the batch gradient
            m = matmul_ta(ops.reshape(self.a * c, [-1, i]), ops.reshape(self.d, [-1, o]))
            m = m[:, None, :]
        else:
            m = ops.einsum("btgi,btgo->igo", self.a * c, self.d)
        return self._to_variable_layout(m, batched=False)

    def weighted_sums(self, coefficients: list) -> list:
        """``[sum_i c_i^(k) g_i for each coefficient vector c^(k)]`` in one pass over the data:
        ``C M`` with ``C`` the ``(K, B)`` coefficients where the per-example matrices are built
        (one read of them instead of ``K``), ``A^T [c^(1) D, ..., c^(K) D]`` (one GEMM) for one
        group without them."""
        if self._route.sums == "matrices":
            blocks = self._per_example_blocks()
            c = ops.stack([ops.cast(ck, dtype_of(blocks[0])) for ck in coefficients])  # (K, B)
            s = _side_by_side([ops.tensordot(c, m, axes=1) for m in blocks])  # (K, G, O, I)
            return [self._to_variable_layout(ops.transpose(s[k], [2, 0, 1]), batched=False)
                    for k in range(len(coefficients))]
        i, g, o = self.a_shape[3], self.a_shape[2], self.d.shape[3]
        if self.summed is not None or g != 1 or len(coefficients) == 1:
            return [self.weighted_sum(ck) for ck in coefficients]
        scaled = ops.concatenate(
            [self.d * ops.cast(ck, dtype_of(self.d))[:, None, None, None] for ck in coefficients],
            axis=-1)  # (B, T, 1, K O)
        m = matmul_ta(ops.reshape(self.a, [-1, i]), ops.reshape(scaled, [-1, len(coefficients) * o]))
        return [self._to_variable_layout(m[:, None, k * o:(k + 1) * o], batched=False)
                for k in range(len(coefficients))]

    def dots_many(self, vectors: list) -> list:
        """``[<g_i, V_k> for each V_k]`` in one pass: ``M [V_1 ... V_K]`` (one GEMM over the
        per-example matrices) where the norms materialize, ``A [V_1 ... V_K]`` (one GEMM, then
        the products with ``D``) for one group without them."""
        if len(vectors) == 1:
            return [self.dots(vectors[0])]
        vs = [self._from_variable_layout(ops.cast(v, self.a_dtype)) for v in vectors]  # (I, G, O)
        batch = batch_size(self.d)
        if self._route.dots == "matrices":
            blocks = self._per_example_blocks()  # (B, G, O, I_k) each
            parts = [self._split_inputs(ops.transpose(v, [1, 2, 0]), blocks) for v in vs]
            out = add_n([ops.matmul(ops.reshape(m, [batch, -1]),
                                    ops.stack([ops.reshape(p[b], [-1]) for p in parts], 1))
                         for b, m in enumerate(blocks)])  # (B, K)
            return [out[:, k] for k in range(len(vectors))]
        i, g, o = self.a_shape[3], self.a_shape[2], self.d.shape[3]
        if g != 1:
            return [self.dots(v) for v in vectors]
        stacked = ops.concatenate([v[:, 0, :] for v in vs], axis=-1)  # (I, K O)
        av = ops.matmul(ops.reshape(self.a, [-1, i]), stacked)  # (B T, K O)
        av = ops.reshape(av, [batch, -1, len(vectors), o])
        products = ops.sum(av * self.d[:, :, 0, None, :], axis=[1, 3])  # (B, K)
        return [products[:, k] for k in range(len(vectors))]

    def gram(self) -> Tensor:
        """``K[i, j] = <g_i, g_j>``, ``(B, B)``: ghost ``sum_{t,s} (a_it . a_js)(d_it . d_js)``
        or the materialized ``M M^T``, whichever :mod:`pergrad.rules.cost` finds cheaper."""
        t, i, o = (static_or_none(self.a_shape[1]), static_or_none(self.a_shape[3]),
                   static_or_none(self.d.shape[3]))
        if self.per_example is None and prefers_ghost(t, i, o, batch=static_or_none(
                self.a_shape[0]), pairs=True):
            gram_a = ops.einsum("btgi,csgi->bcgts", self.a, self.a)
            gram_d = ops.einsum("btgo,csgo->bcgts", self.d, self.d)
            return ops.sum(gram_a * gram_d, axis=[2, 3, 4])
        flats = [ops.reshape(m, [batch_size(self.d), -1]) for m in self._per_example_blocks()]
        return add_n([ops.matmul(f, ops.transpose(f)) for f in flats])

    def masked(self, keep: Tensor) -> Factored:
        """The form with the rows of examples where ``keep`` is false set to zero (NaN rows
        included): ``remake(keep)`` where the rule gave one, else ``a`` and ``d`` with those
        rows zeroed. The native ``summed`` and ``per_example`` kernels read the unmasked
        inputs, so without ``remake`` the first is used only while every row is kept and the
        second not at all."""
        if self.remake is not None:
            return self.remake(keep)
        plain = Factored(self.variable, zero_rows(self.a, keep), zero_rows(self.d, keep),
                         self.natural_shape, self.perm)
        if self.summed is None:
            return plain
        native = self.summed

        def summed(coefficients):  # the native kernel while no row is dropped
            return ops.cond(ops.all(keep),
                            lambda: ops.reshape(native(coefficients), self.var_shape),
                            lambda: plain.weighted_sum(coefficients))

        return Factored(self.variable, plain.a, plain.d, self.natural_shape, self.perm, summed)

    def rebuilt(self) -> Factored:
        """The same form rebuilt from the layer's input and output gradient (``remake`` with
        every row kept), for use inside a conditional branch: the branch then captures only
        those two tensors, not what the rule derived from them (patches). A graph computes a
        branch's captured inputs before the branch, even on the steps that skip it, so a form
        built outside and read only inside made every step compute the patches (the benchmark
        CNN's ``mean()`` step: a one-hot convolution and an ``ExtractImagePatches`` that no
        taken branch read). A routed form's rebuilt form keeps its routes (the same layer,
        sizes and kernels)."""
        if self.remake is None:
            return self
        remade = self.remake(None)
        return remade if self.route is None else replace(remade, route=self.route)

    def merged_with(self, other: Factored) -> Factored:
        """Two calls of one layer: the sums over positions concatenate along ``T``."""
        summed = per_example = None
        if self.summed is not None and other.summed is not None:
            def summed(c, first=self.summed, second=other.summed):
                return first(c) + second(c)
        if self.per_example is not None and other.per_example is not None:
            def per_example(first=self.per_example, second=other.per_example):
                return _add_blocks(first(), second())
        remake = None
        if self.remake is not None and other.remake is not None:
            def remake(keep, first=self.remake, second=other.remake):
                return first(keep).merged_with(second(keep))
        return Factored(self.variable, ops.concatenate([self.a, other.a], 1),
                        ops.concatenate([self.d, other.d], 1), self.natural_shape, self.perm,
                        summed, per_example, remake)


def routed(form: Form, query: Query) -> Form:
    """``form.routed(query)`` where the form has routes to choose (:class:`Factored`,
    :class:`Scaled`), else ``form``: the form taking the cheapest routes for what ``query``
    declares will be asked of it."""
    method = getattr(form, "routed", None)
    return form if method is None else method(query)


def _side_by_side(parts: list) -> Tensor:
    """The parts concatenated along their last axis (one part: itself)."""
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=-1)


def _as_blocks(m) -> list:
    """A ``per_example`` result as its list of blocks along ``I`` (a tensor is one block)."""
    return list(m) if isinstance(m, (list, tuple)) else [m]


def _add_blocks(first, second) -> list:
    """The sum of two ``per_example`` results: block by block where both cut ``I`` alike."""
    first, second = _as_blocks(first), _as_blocks(second)
    if [m.shape[-1] for m in first] == [m.shape[-1] for m in second]:
        return [f + s for f, s in zip(first, second, strict=True)]
    return [_side_by_side(first) + _side_by_side(second)]


@dataclass
class Materialized:
    """``g_i`` given explicitly, shape ``(B, *variable.shape)``."""

    variable: object
    value: Tensor

    signature = ("materialized",)

    def materialize(self) -> Tensor:
        return self.value

    def squared_norms(self) -> Tensor:
        return row_squared_norms(self.value)

    def dots(self, vector: Tensor) -> Tensor:
        flat = ops.reshape(self.value, [batch_size(self.value), -1])
        v = ops.reshape(ops.cast(vector, dtype_of(self.value)), [-1, 1])
        return ops.matmul(flat, v)[:, 0]  # one read of the (B, P) gradients

    def weighted_sum(self, coefficients: Tensor) -> Tensor:
        c = ops.cast(coefficients, dtype_of(self.value))
        return ops.tensordot(c, self.value, axes=1)

    def weighted_sums(self, coefficients: list) -> list:
        c = ops.stack([ops.cast(ck, dtype_of(self.value)) for ck in coefficients])  # (K, B)
        sums = ops.tensordot(c, self.value, axes=1)
        return [sums[k] for k in range(len(coefficients))]

    def dots_many(self, vectors: list) -> list:
        flat = ops.reshape(self.value, [batch_size(self.value), -1])
        stacked = ops.stack([ops.reshape(ops.cast(v, dtype_of(self.value)), [-1])
                             for v in vectors], 1)
        out = ops.matmul(flat, stacked)  # (B, K)
        return [out[:, k] for k in range(len(vectors))]

    def gram(self) -> Tensor:
        flat = ops.reshape(self.value, [batch_size(self.value), -1])
        return ops.matmul(flat, ops.transpose(flat))

    def masked(self, keep: Tensor) -> Materialized:
        return Materialized(self.variable, zero_rows(self.value, keep))

    def rebuilt(self) -> Materialized:
        return self

    def merged_with(self, other: Materialized) -> Materialized:
        return Materialized(self.variable, self.value + other.value)


@dataclass
class Rows:
    """An embedding table's gradient: ``g_i[n] = sum_t [ids_i[t] = n] D_i[t]``.

    ``ids``: ``(B, T)`` integers; ``d``: ``(B, T, O)``; the table is ``(num_rows, O)``. Norms
    sort each example's ids and sum the rows of equal ids before squaring (one segment sum over
    ``B T`` static segments), so repeated ids within an example add up, as they must.
    """

    variable: object
    ids: Tensor
    d: Tensor

    signature = ("rows",)

    @property
    def num_rows(self) -> int:
        return int(self.variable.shape[0])

    def _flat_d(self) -> Tensor:
        return ops.reshape(self.d, [-1, self.d.shape[-1]])

    def materialize(self) -> Tensor:
        batch = batch_size(self.ids)
        example = ops.arange(batch, dtype="int32")[:, None]
        keys = ops.reshape(example * self.num_rows + ops.cast(self.ids, "int32"), [-1])
        rows = segment_sum(self._flat_d(), keys, batch * self.num_rows)
        return ops.reshape(rows, [batch, *self.variable.shape])

    def squared_norms(self) -> Tensor:
        """``||g_i||^2 = sum_n ||sum_{t: ids_it = n} D_it||^2``: with each example's ids sorted,
        equal ids are neighbours; ``rank_it`` (how many distinct ids precede position ``t``)
        numbers the segments, and segment ``i T + rank_it`` collects id ``n``'s rows."""
        positions = static_or_none(self.ids.shape[1])
        routes = native().ROUTES
        if cost.rows_pairwise_wins(positions, routes.embedding_pairwise_max_positions):
            return self._squared_norms_pairwise()
        if routes.embedding_norms == "unique":
            return native().unique_row_squared_norms(self.ids, self._flat_d(), self.num_rows)
        batch, t = batch_size(self.ids), ops.shape(self.ids)[1]
        order = ops.argsort(self.ids, axis=1)
        ids = ops.take_along_axis(self.ids, order, axis=1)
        d = ops.take_along_axis(self.d, order[:, :, None], axis=1)
        new = ops.concatenate([ops.ones_like(ids[:, :1]),
                               ops.cast(ops.not_equal(ids[:, 1:], ids[:, :-1]), ids.dtype)], 1)
        local = ops.cumsum(ops.cast(new, "int32"), axis=1) - 1
        segment = ops.arange(batch, dtype="int32")[:, None] * t + local
        # pergrad's segment_sum: Keras's adds the rows in float32 on PyTorch (``data.float()``)
        rows = segment_sum(ops.reshape(d, [-1, d.shape[-1]]), ops.reshape(segment, [-1]),
                           batch * t)
        return row_squared_norms(ops.reshape(rows, [batch, -1]))

    def _squared_norms_pairwise(self) -> Tensor:
        """``||g_i||^2 = sum_{t,s} [ids_it = ids_is] (d_it . d_is) = sum_t d_it . s_it`` with
        ``s_it = sum_s [ids_it = ids_is] d_is`` (the rows that share position ``t``'s id), for
        short sequences (:func:`pergrad.rules.cost.rows_pairwise_wins`). Summing the
        rows first beats the Gram of the rows on XLA's CPU backend (docs/benchmarks.md, "Route
        measurements")."""
        same = ops.cast(ops.equal(self.ids[:, :, None], self.ids[:, None, :]), dtype_of(self.d))
        shared = ops.einsum("bts,bso->bto", same, self.d)
        return ops.sum(shared * self.d, axis=[1, 2])

    def dots(self, vector: Tensor) -> Tensor:
        looked_up = ops.take(ops.cast(vector, dtype_of(self.d)), self.ids, axis=0)
        return ops.sum(looked_up * self.d, axis=[1, 2])

    def weighted_sum(self, coefficients: Tensor) -> Tensor:
        """``sum_i c_i g_i``: the rows ``c_i D_i[t]`` added into the table at ``ids_i[t]`` by
        :func:`pergrad.backend.ops.segment_sum` (TensorFlow: one nested XLA computation;
        PyTorch: ``index_add_``)."""
        c = ops.cast(coefficients, dtype_of(self.d))[:, None, None]
        flat = ops.reshape(self.d * c, [-1, self.d.shape[-1]])
        return segment_sum(flat, ops.reshape(ops.cast(self.ids, "int32"), [-1]), self.num_rows)

    def gram(self) -> Tensor:
        """``<g_i, g_j> = sum_{t,s} [ids_it = ids_js] (d_it . d_js)``."""
        same = ops.cast(ops.equal(self.ids[:, None, :, None], self.ids[None, :, None, :]),
                        dtype_of(self.d))
        dd = ops.einsum("bto,cso->bcts", self.d, self.d)
        return ops.sum(same * dd, axis=[2, 3])

    def masked(self, keep: Tensor) -> Rows:
        return Rows(self.variable, self.ids, zero_rows(self.d, keep))

    def rebuilt(self) -> Rows:
        return self

    def merged_with(self, other: Rows) -> Rows:
        return Rows(self.variable, ops.concatenate([self.ids, other.ids], 1),
                    ops.concatenate([self.d, other.d], 1))

    def as_factored(self) -> Factored:
        """The same gradients as a ``Factored`` form: ``g_i = sum_t onehot(ids_it)^T D_it``
        (``A``: ``(B, T, 1, rows)``, ``D``: ``(B, T, 1, O)``), to merge with a ``Factored``
        form of the same table (:func:`combine`)."""
        batch = batch_size(self.ids)
        ids = ops.reshape(ops.cast(self.ids, "int32"), [batch, -1])
        a = ops.one_hot(ids, self.num_rows, dtype=dtype_of(self.d))
        d = ops.reshape(self.d, [batch, -1, 1, self.d.shape[-1]])
        return Factored(self.variable, ops.expand_dims(a, 2), d, tuple(self.variable.shape))


class Scaled:
    """``factor`` times the gradients of ``inner`` (``factor^2`` for norms and Gram matrices):
    how ``PerExampleModel`` undoes loss scaling without recomputing anything."""

    def __init__(self, inner, factor: Tensor) -> None:
        self.inner, self.factor, self.variable = inner, factor, inner.variable

    def _times(self, t: Tensor, power: int = 1) -> Tensor:
        return t * ops.cast(self.factor, dtype_of(t)) ** power

    def materialize(self) -> Tensor:
        return self._times(self.inner.materialize())

    def squared_norms(self) -> Tensor:
        return self._times(self.inner.squared_norms(), 2)

    def routed(self, query: Query) -> Scaled:
        return Scaled(routed(self.inner, query), self.factor)

    def dots(self, vector: Tensor) -> Tensor:
        return self._times(self.inner.dots(vector))

    def weighted_sum(self, coefficients: Tensor) -> Tensor:
        return self._times(self.inner.weighted_sum(coefficients))

    def gram(self) -> Tensor:
        return self._times(self.inner.gram(), 2)

    def masked(self, keep: Tensor) -> Scaled:
        return Scaled(self.inner.masked(keep), self.factor)

    def rebuilt(self) -> Scaled:
        return Scaled(rebuilt(self.inner), self.factor)

    def weighted_sums(self, coefficients: list) -> list:
        return [self._times(s) for s in weighted_sums(self.inner, coefficients)]

    def dots_many(self, vectors: list) -> list:
        return [self._times(d) for d in dots_many(self.inner, vectors)]

    @property
    def signature(self) -> tuple:
        return ("scaled",)

    def merged_with(self, other):
        return Materialized(self.variable, self.materialize() + other.materialize())


@runtime_checkable
class Form(Protocol):
    """What every per-example gradient form provides, for its variable ``W`` and every example
    ``i`` of the batch (``g_i = dl_i/dW``). A rule may return its own class with these members;
    the engine uses nothing else.

    * ``variable``: the Keras variable ``W``;
    * ``signature``: a hashable description; two forms of one variable with equal types and
      signatures can be merged by ``merged_with`` (several calls of one layer);
    * ``materialize() -> (B, *W.shape)``: ``g_i``;
    * ``squared_norms() -> (B,)``: ``||g_i||^2``;
    * ``dots(V) -> (B,)``: ``<g_i, V>`` for ``V`` of ``W``'s shape;
    * ``weighted_sum(c) -> W.shape``: ``sum_i c_i g_i``;
    * ``gram() -> (B, B)``: ``<g_i, g_j>``;
    * ``masked(keep) -> Form``: the form with ``g_i = 0`` where ``keep[i]`` is false;
    * ``merged_with(other) -> Form``: the form of ``g_i + g'_i``.

    Optional, each with a default (:func:`routed`, :func:`rebuilt`, :func:`weighted_sums`, :func:`dots_many`;
    a subclass of a built-in form that overrides ``weighted_sum`` or ``dots`` must override
    these too, or it inherits the parent's one-pass versions):

    * ``routed(query) -> Form``: the form taking the cheapest routes for what the caller
      declares it will ask (:class:`pergrad.rules.query.Query`; :meth:`Factored.routed`);
      default: the form itself;
    * ``rebuilt() -> Form``: the same gradients recomputed from the layer's recorded tensors,
      for use inside a conditional branch (:meth:`Factored.rebuilt`); default: the form itself;
    * ``weighted_sums([c_1, ...]) -> [W.shape, ...]`` and ``dots_many([V_1, ...]) -> [(B,), ...]``:
      several sums or dot products in one pass over the data; default: one call per vector.
    """

    variable: Any

    @property
    def signature(self) -> tuple: ...

    def materialize(self) -> Tensor: ...

    def squared_norms(self) -> Tensor: ...

    def dots(self, vector: Tensor) -> Tensor: ...

    def weighted_sum(self, coefficients: Tensor) -> Tensor: ...

    def gram(self) -> Tensor: ...

    def masked(self, keep: Tensor) -> Form: ...

    def merged_with(self, other: Form) -> Form: ...


def rebuilt(form: Form) -> Form:
    """``form.rebuilt()`` where the form has it, else ``form`` (the method is optional)."""
    method = getattr(form, "rebuilt", None)
    return form if method is None else method()


def weighted_sums(form: Form, coefficients: list) -> list:
    """``form.weighted_sums(coefficients)`` where the form has it, else one ``weighted_sum``
    per coefficient vector."""
    method = getattr(form, "weighted_sums", None)
    if method is None:
        return [form.weighted_sum(c) for c in coefficients]
    return method(coefficients)


def dots_many(form: Form, vectors: list) -> list:
    """``form.dots_many(vectors)`` where the form has it, else one ``dots`` per vector."""
    method = getattr(form, "dots_many", None)
    if method is None:
        return [form.dots(v) for v in vectors]
    return method(vectors)


def combine(forms: list[Form]) -> Form:
    """The form of a variable used by several calls: merge like forms, else materialize and add.
    A table read both as an embedding (``Rows``) and as a matmul kernel (``Factored`` over the
    table's rows, a tied input/output embedding) merges as ``Factored``: its ``Rows`` are the
    factors ``(one_hot(ids), D)`` (:meth:`Rows.as_factored`)."""
    result = forms[0]
    for form in forms[1:]:
        result, form = _as_like_forms(result, form)
        if type(form) is type(result) and form.signature == result.signature:
            result = result.merged_with(form)
        else:
            result = Materialized(result.variable, result.materialize() + form.materialize())
    return result


def _as_like_forms(first: Form, second: Form) -> tuple[Form, Form]:
    """``(first, second)``, with a ``Rows`` form turned into ``Factored`` when the other is a
    ``Factored`` form of the same table laid out as ``(rows, O)`` (one group, no permutation),
    so that the two merge instead of materializing ``B x rows x O``."""
    def fits(rows, factored) -> bool:
        return (isinstance(rows, Rows) and type(factored) is Factored and factored.perm is None
                and factored.natural_shape == tuple(rows.variable.shape)
                and tuple(factored.a_shape[2:]) == (1, rows.num_rows)
                and tuple(factored.d.shape[2:]) == (1, rows.d.shape[-1]))
    if fits(first, second):
        return first.as_factored(), second
    if fits(second, first):
        return first, second.as_factored()
    return first, second


def positions(dims) -> int:
    """The number of positions ``T`` spanned by ``dims`` (static sizes), or -1 when one is
    unknown. Reshapes use it instead of -1 so that ``T`` stays static after the batch dimension
    becomes dynamic (a retrace with ``reduce_retracing``): the cost model needs it."""
    dims = list(dims)
    if any(d is None for d in dims):
        return -1
    return int(math.prod(int(d) for d in dims))


def unbroadcast(grad: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Per-example gradient of a parameter of ``shape`` added with broadcasting to ``grad``'s rows.

    ``grad`` is ``(B, ...)``; leading non-batch axes beyond ``len(shape)`` and axes where the
    parameter has size 1 are summed, giving ``(B, *shape)``.
    """
    extra = rank(grad) - 1 - len(shape)
    if extra > 0:
        grad = ops.sum(grad, axis=list(range(1, 1 + extra)))
    keep = [i + 1 for i, n in enumerate(shape) if n == 1 and grad.shape[i + 1] != 1]
    if keep:
        grad = ops.sum(grad, axis=keep, keepdims=True)
    return ops.reshape(grad, [batch_size(grad), *shape])


__all__ = ["Built", "Deferred", "Factored", "Form", "Materialized", "Rows", "Scaled", "add_n", "combine", "dots_many",
           "positions", "rebuilt", "routed", "unbroadcast", "weighted_sums",
           "zero_rows"]
