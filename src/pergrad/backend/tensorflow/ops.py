"""TensorFlow's array primitives: native kernels where they beat the generic ``keras.ops``
composition (each measured: docs/benchmarks.md, "Route measurements"), and what graph tracing
needs (the graph a cached tensor belongs to, run-time assertions)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from keras import ops

from pergrad._compat import current_graph, tracing_for_xla
from pergrad.backend.neutral import batch_size, broadcast_outer_products, dtype_of


def matmul_ta(a: Any, b: Any) -> Any:
    """``a^T b``: the transpose folded into the kernel (``matmul(transpose_a=True)``), faster
    than a transposed copy."""
    return tf.matmul(a, b, transpose_a=True)


def outer_products(a: Any, d: Any) -> Any:
    """``m[b, i, g, o] = a[b, i, g] d[b, g, o]``: TensorFlow's broadcasting ``Mul`` writes them
    at about half the speed of memory, one small XLA computation in about half the time, so the
    product is a nested ``tf.function(jit_compile=True)`` unless the graph is compiled by XLA
    already (``Routes.nested_xla_outer_products``)."""
    if _routes().nested_xla_outer_products and _nested_xla_wanted():
        return _xla_outer_products()(a, d)
    return broadcast_outer_products(a, d)


@functools.cache
def _xla_outer_products() -> Callable[[Any, Any], Any]:
    return tf.function(broadcast_outer_products, jit_compile=True, reduce_retracing=True)


def segment_sum(values: Any, segments: Any, num_segments: Any) -> Any:
    """``out[n] = sum_{k: segments[k] = n} values[k]``: one small XLA computation (nested, unless
    the graph is compiled by XLA already), faster than ``UnsortedSegmentSum``
    (``Routes.native_segment_sums``)."""
    if _routes().native_segment_sums and _nested_xla_wanted():
        return _xla_segment_sum()(values, segments, num_segments)
    return ops.segment_sum(values, segments, num_segments)


@functools.cache
def _xla_segment_sum() -> Callable[[Any, Any, Any], Any]:
    return tf.function(tf.math.unsorted_segment_sum, jit_compile=True, reduce_retracing=True)


def _routes():
    """This package's route profile as it stands now (``pergrad.backend.routes.forced`` swaps
    it for an A/B run)."""
    from pergrad.backend import tensorflow as package  # this module's own package

    return package.ROUTES


def _nested_xla_wanted() -> bool:
    """Whether a graph being built now should call a nested XLA computation: not when XLA
    compiles the whole graph already, and only where XLA runs at all (not on a build or device
    plugin without it)."""
    return not tracing_for_xla() and _nested_xla_runs()


@functools.cache
def _nested_xla_runs() -> bool:
    """Whether TensorFlow compiles and runs a ``jit_compile=True`` function here: asked once,
    eagerly, on a tiny input."""
    with tf.init_scope():  # eagerly, even while a graph is being traced
        try:
            _xla_outer_products()(tf.zeros([1, 1, 1]), tf.zeros([1, 1, 1]))
        except (tf.errors.OpError, NotImplementedError, ValueError):
            return False
    return True


def row_squared_norms(t: Any) -> Any:
    """``(B,)``: ``||t[i]||^2``. ``Square`` then ``Sum`` writes a ``t``-sized tensor and reads it
    again; one ``EuclideanNorm`` reduction, squared, reads ``t`` once (the result differs by
    about one ulp). Its gradient is set to ``2 t`` (the square of a square root has none at a
    zero row). XLA has no ``EuclideanNorm`` kernel and fuses the two ops itself, so under
    ``jit_compile=True``, for other dtypes and where ``Routes.one_pass_row_norms`` is off the
    squares are summed."""
    flat = ops.reshape(t, [batch_size(t), -1])
    if (_routes().one_pass_row_norms and dtype_of(t) in ("float32", "float64")
            and not tracing_for_xla()):
        return _euclidean_row_squared_norms(flat)
    return ops.sum(ops.square(flat), axis=1)


def _euclidean_row_squared_norms(flat: Any) -> Any:
    @tf.custom_gradient
    def squared(rows):
        def gradient(upstream):
            return 2.0 * rows * upstream[:, None]
        return tf.square(tf.math.reduce_euclidean_norm(rows, axis=1)), gradient

    return squared(flat)


def vjp(fn: Callable[[Any], Any], primal: Any, cotangent: Any) -> Any:
    """``d/dp <fn(p), cotangent>`` at ``p = primal``, by one ``GradientTape``."""
    with tf.GradientTape() as tape:
        tape.watch(primal)
        out = fn(primal)
    return tape.gradient(out, primal, output_gradients=cotangent)


def map_in_chunks(fn: Callable[..., Any], arrays: tuple, chunk: int) -> Any:
    """``fn(*arrays)`` at once: TensorFlow's kernels gain nothing from chunking."""
    return fn(*arrays)


def image_patches(x: Any, kernel_size: Any, strides: Any, dilation: Any, padding: str) -> Any:
    """``(B, out_h, out_w, K C)`` by TensorFlow's ``extract_patches`` kernel (it beats a
    one-hot convolution for patches wider than 128 values)."""
    return tf.image.extract_patches(x, [1, *kernel_size, 1], [1, *strides, 1],
                                    [1, *dilation, 1], padding.upper())


def trace_token() -> Any:
    """The graph being built: a tensor made inside a ``tf.cond`` branch cannot be used outside
    it, so a form caches its intermediates per graph."""
    return current_graph()


def snapshot(t: Any) -> Any:
    """``t`` itself: TensorFlow values are immutable."""
    return t


def static_value(t: Any) -> Any:
    """``tf.get_static_value``: the value while tracing where it is a constant."""
    return tf.get_static_value(t)


def assert_positive(t: Any, message: str) -> Any:
    """``t`` after a run-time ``assert_positive`` (its value may be unknown while tracing)."""
    with tf.control_dependencies([tf.debugging.assert_positive(t, message=message)]):
        return tf.identity(t)


def wide_float() -> str:
    return "float64"


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """Nothing to do: TensorFlow's TensorFloat-32 setting is left as the user set it."""
    yield


def unique_row_squared_norms(ids: Any, flat_d: Any, num_rows: int) -> Any:
    """``(B,)``: an embedding table's per-example squared norms
    ``||g_i||^2 = sum_n ||sum_{t: ids_it = n} D_it||^2`` by one ``tf.unique`` over the
    (example, row) keys and two segment sums (``flat_d``: the rows ``D_it``, ``(B T, O)``);
    faster than sorting each example's ids (docs/benchmarks.md, "Route measurements")."""
    batch = tf.shape(ids, out_type=tf.int64)[0]
    example = tf.range(batch, dtype=tf.int64)[:, None]
    keys = tf.reshape(example * num_rows + tf.cast(ids, tf.int64), [-1])
    unique_keys, position = tf.unique(keys)
    rows = tf.math.unsorted_segment_sum(flat_d, position, tf.size(unique_keys))
    row_sq = tf.reduce_sum(tf.square(rows), axis=1)
    return tf.math.unsorted_segment_sum(row_sq, unique_keys // num_rows, batch)


def recurrence(body: Callable, extras: int, elems: tuple, zero: Any, states: tuple,
               sequences: bool) -> tuple:
    """:func:`pergrad.rules.recurrent._recur`'s loop as a ``tf.while_loop`` that stacks only
    what is read afterwards: ``h_{t-1}``, the extras and (with ``sequences``) the outputs; the
    states and the last output stay loop variables. (Keras 3.15's TensorFlow ``ops.scan`` mishandles nested
    carries, and ``tf.scan`` stacks every carry: the outputs and each state, twice more for
    a GRU, whose state is its output.)"""
    steps = elems[0].shape[0] if elems[0].shape[0] is not None else tf.shape(elems[0])[0]
    read = [tf.TensorArray(e.dtype, size=steps).unstack(e) for e in elems]

    def stack_of(like):
        return tf.TensorArray(like.dtype, size=steps, element_shape=like.shape)

    written = (stack_of(zero) if sequences else (), stack_of(zero),
               tuple(stack_of(zero) for _ in range(extras)))

    def loop(t, last, carried, outputs, previous, extra_steps):
        (output, new_states), (_, previous_h, step_extras) = body(
            (last, carried), tuple(r.read(t) for r in read))
        if sequences:
            outputs = outputs.write(t, output)
        return (t + 1, output, new_states, outputs, previous.write(t, previous_h),
                tuple(a.write(t, e) for a, e in zip(extra_steps, step_extras, strict=True)))

    # maximum_iterations: XLA (jit_compile=True) needs the stacks' size, and so does their
    # gradient's accumulator.
    _, last, final_states, outputs, previous, extra_steps = tf.while_loop(
        lambda t, *_: t < steps, loop, (tf.constant(0), zero, states, *written),
        maximum_iterations=steps)
    return (outputs.stack() if sequences else None, last, final_states, previous.stack(),
            tuple(a.stack() for a in extra_steps))
