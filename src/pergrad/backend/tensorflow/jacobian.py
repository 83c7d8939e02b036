"""The TensorFlow primitives of `pergrad.jacobian._modes`: a persistent ``GradientTape`` for
reverse mode, ``tf.autodiff.ForwardAccumulator`` for forward mode and ``tf.vectorized_map``
(pfor) over the basis index, all inside the one ``tf.function`` trace that
`pergrad.backend.tensorflow.jacobian_compile` builds per input signature (the compiling and the
one-shot products, `jacobian_products`, are this module's too: imported below).

TensorFlow reads and writes Keras variables inside the trace itself, so f needs no state
threaded through it (`_modes` leaves ``writes`` empty). Shapes may be dynamic: a batch size
unknown at trace time is a scalar tensor, and the output's batch is checked by an assertion
that runs with the result (:func:`batch_assert`, :func:`depending_on`).

`stack_map` with a chunk size vectorizes one chunk, then maps the remaining full chunks in
sequence (``tf.map_fn``), then the remainder, chained by control dependencies so that they
run one after the other and peak memory is that of one chunk. The primal forward pass does
not depend on the index, so pfor leaves it unbatched: it runs once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from pergrad.backend.tensorflow.jacobian_compile import (  # noqa: F401 - the protocol's names
    convert_argument,
    dispatch,
    signature_function,
    structural_key,
    user_function,
)
from pergrad.backend.tensorflow.jacobian_products import (  # noqa: F401 - the protocol's names
    hvp_product,
    jvp_product,
    vjp_product,
)

#: Gradients of outputs that do not depend on an input are zeros, not None.
ZERO = tf.UnconnectedGradients.ZERO


flatten = tf.nest.flatten
pack_as = tf.nest.pack_sequence_as


def convert_leaf(x: Any) -> Any:
    """``x`` as a tensor; a ``tf.Variable`` passes unchanged."""
    return x if isinstance(x, tf.Variable) else tf.convert_to_tensor(x)


def batch_size(t: Any) -> int | Any:
    """``t``'s leading dimension: a Python int when static, else a scalar tensor."""
    static = t.shape[0]
    return int(static) if static is not None else tf.shape(t)[0]


def batch_assert(t: Any, axis: int, batch: Any, message: str) -> Any:
    """An op that fails at run time unless ``t.shape[axis] == batch``."""
    return tf.debugging.assert_equal(tf.shape(t)[axis], batch, message=message)


def depending_on(deps: list, t: Any) -> Any:
    """``t``, computed only after the ops ``deps`` (assertions) ran."""
    if not deps:
        return t
    with tf.control_dependencies(deps):
        return tf.identity(t)


class _Pullback:
    """``u -> u^T J`` of one forward pass recorded on a persistent tape."""

    def __init__(self, tape: tf.GradientTape, x: Any, xs: list, y: Any) -> None:
        self.tape, self.x, self.xs, self.ys = tape, x, xs, tf.nest.flatten(y)

    def __call__(self, cotangents: Any) -> tuple:
        grads = self.tape.gradient(self.ys, self.xs, output_gradients=tf.nest.flatten(cotangents),
                                   unconnected_gradients=ZERO)
        return (tf.nest.pack_sequence_as(self.x, grads),)

    def one(self, k: int, u: Any) -> list:
        """The flat ``u^T J_k``: the cotangent ``u`` on output leaf ``k``, zero elsewhere (the
        other outputs' backward passes are not built)."""
        live = [i for i, x in enumerate(self.xs) if x.shape.num_elements() != 0]
        grads = self.tape.gradient(self.ys[k], [self.xs[i] for i in live], output_gradients=u,
                                   unconnected_gradients=ZERO)
        out = [tf.zeros_like(x) for x in self.xs]  # an empty input's block is empty
        for i, g in zip(live, grads, strict=True):
            out[i] = g
        return out


def vjp(fn: Callable[[Any], tuple[Any, Any]], x: Any) -> tuple[Any, Callable, Any]:
    """``(y, pullback, aux)`` for ``fn(x) = (y, aux)``: one forward pass on a persistent tape."""
    xs = tf.nest.flatten(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xs)
        y, aux = fn(tf.nest.pack_sequence_as(x, xs))
    return y, _Pullback(tape, x, xs, y), aux


def pull_one(pullback: _Pullback, y: Any, k: int, u: Any) -> list:
    """The flat input gradient of the cotangent ``u`` on ``y``'s output leaf ``k`` (zero on
    the others)."""
    del y
    return pullback.one(k, u)


def jvp_along(fn: Callable[[Any], tuple[Any, Any]], x: Any, index: int, t: Any) -> tuple:
    """``(y, J t, aux)`` for ``fn(x) = (y, aux)`` along the tangent ``t`` of ``x``'s leaf
    ``index`` (zero on the others: only that leaf is watched)."""
    xs = tf.nest.flatten(x)
    with tf.autodiff.ForwardAccumulator(xs[index], t) as acc:
        y, aux = fn(tf.nest.pack_sequence_as(x, xs))
    return y, tf.nest.map_structure(lambda o: acc.jvp(o, unconnected_gradients=ZERO), y), aux


def grad(fn: Callable[[Any], tuple[Any, Any]]) -> Callable[[Any], tuple[Any, Any]]:
    """``x -> (d fn(x)[0] / dx, aux)``."""

    def gradient(x: Any) -> tuple[Any, Any]:
        xs = tf.nest.flatten(x)
        with tf.GradientTape() as tape:
            tape.watch(xs)
            s, aux = fn(tf.nest.pack_sequence_as(x, xs))
        grads = tape.gradient(s, xs, unconnected_gradients=ZERO)
        return tf.nest.pack_sequence_as(x, grads), aux

    return gradient


def eval_shape(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)``'s structure, shapes and dtypes, from a trace in a graph of its own: nothing of
    it runs, so f's side effects (moving statistics with ``training=True``) are not doubled."""
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), x)
    return tf.function(fn, autograph=False).get_concrete_function(specs).structured_outputs


def _vmap(fn: Callable[[Any], Any], indices: Any) -> Any:
    return tf.vectorized_map(fn, indices)


def stack_map(fn: Callable[[Any], Any], n: int, chunk_size: int | None, like: Any) -> Any:
    """``fn(i)`` for ``i`` in ``range(n)``, stacked along a new leading axis: one
    ``vectorized_map``, or chunks of ``chunk_size`` in sequence (see the module notes)."""
    del like  # one device per trace: TensorFlow places the indices
    if chunk_size is None or chunk_size >= n:
        return _vmap(fn, tf.range(n))
    first = _vmap(fn, tf.range(chunk_size))
    parts = [first]
    n_full = n // chunk_size
    if n_full > 1:
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), first)

        def one_chunk(c: Any) -> Any:
            return _vmap(fn, c * chunk_size + tf.range(chunk_size))

        with tf.control_dependencies(tf.nest.flatten(parts[-1])):
            start = tf.identity(tf.constant(1))
        rest = tf.map_fn(one_chunk, tf.range(start, n_full), fn_output_signature=spec,
                         parallel_iterations=1)
        rest = tf.nest.map_structure(
            lambda r: tf.reshape(r, tf.concat([[-1], tf.shape(r)[2:]], axis=0)), rest)
        parts.append(rest)
    remainder = n - n_full * chunk_size
    if remainder:
        with tf.control_dependencies(tf.nest.flatten(parts[-1])):
            base = tf.identity(tf.constant(n_full * chunk_size))
        parts.append(_vmap(fn, base + tf.range(remainder)))
    if len(parts) == 1:
        return first
    return tf.nest.map_structure(lambda *ps: tf.concat(ps, axis=0), *parts)


def basis(index: Any, shape: list[int], dtype: Any, like: Any) -> Any:
    """The one-hot ``e_index`` of ``shape``, broadcast to the (dynamic) shape of ``like``."""
    size = 1
    for n in shape:
        size *= n
    e = tf.reshape(tf.one_hot(index, size, dtype=dtype), shape)
    return e if like is None else tf.broadcast_to(e, tf.shape(like))


def one_example(t: Any, index: Any) -> Any:
    """``t[index:index + 1]`` for a scalar index tensor."""
    return tf.gather(t, tf.reshape(index, [1]))


def zeros(shape: list, dtype: Any, like: Any) -> Any:
    del like
    return tf.zeros(shape, dtype)


def moveaxis(t: Any, source: int, destination: int) -> Any:
    """``t`` with axis ``source`` moved to ``destination`` (static rank)."""
    n = t.shape.rank
    order = list(range(n))
    order.insert(destination % n, order.pop(source % n))
    return tf.transpose(t, order)


zeros_like = tf.zeros_like
reshape = tf.reshape
cast = tf.cast
sum = tf.reduce_sum  # noqa: A001 - the primitive's name in every backend module
