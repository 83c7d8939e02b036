"""Array primitives the rules and forms need beyond :mod:`keras.ops`, one definition per backend.

Everything here is a pure function of arrays. ``keras.ops`` covers the rest; the functions below
exist because ``keras.ops`` has no name for them (a transposed batched product, a
vector-Jacobian product) or because TensorFlow's graph tracing needs a detail JAX does not (the
dynamic batch size after a retrace, the graph a cached tensor belongs to).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import keras
from keras import ops

from pergrad.backend import is_jax, is_tensorflow, is_torch


def batch_size(t: Any) -> Any:
    """The leading dimension of ``t``: an int, or a scalar tensor while TensorFlow traces a
    dynamic batch (``reduce_retracing``). The static size is read without a ``keras.ops`` call
    (one costs about 10 us of dispatch on eager PyTorch, and the train step asks often)."""
    static = t.shape[0]
    return ops.shape(t)[0] if static is None else static


def rank(t: Any) -> int:
    return len(t.shape)


def dtype_of(t: Any) -> str:
    """``t``'s dtype as Keras names it (``"float32"``), for tensors and variables alike."""
    return keras.backend.standardize_dtype(t.dtype)


def add_n(terms: list) -> Any:
    """``sum(terms)`` without a leading zero."""
    return functools.reduce(ops.add, terms)


def matmul_ta(a: Any, b: Any) -> Any:
    """``a^T b`` over the last two axes, batched over the leading ones.

    TensorFlow multiplies fastest with the transpose folded into the kernel
    (``matmul(transpose_a=True)``) rather than a transposed copy; XLA folds a transpose into the
    dot on its own. Measured: docs/benchmarks.md, "Route measurements"."""
    if is_tensorflow():
        import tensorflow as tf
        return tf.matmul(a, b, transpose_a=True)
    return ops.matmul(ops.swapaxes(a, -1, -2), b)


def outer_products(a: Any, d: Any) -> Any:
    """``(B, I, G, O)``: ``m[b, i, g, o] = a[b, i, g] d[b, g, o]``, one outer product per
    example and group (a one-position layer's per-example kernel gradients, ``B I G O``
    numbers written once: memory-bound).

    TensorFlow's broadcasting ``Mul`` writes them at about half the speed of memory; one small
    XLA computation writes the same numbers in about half the time (docs/benchmarks.md, "Route
    measurements"), so on TensorFlow the product is a nested ``tf.function(jit_compile=True)``,
    unless the graph is compiled by XLA already."""
    if is_tensorflow() and _nested_xla_wanted():
        return _xla_outer_products()(a, d)
    return broadcast_outer_products(a, d)


def broadcast_outer_products(a: Any, d: Any) -> Any:
    """:func:`outer_products` as one broadcasting multiplication, on any backend."""
    return a[:, :, :, None] * d[:, None, :, :]


@functools.cache
def _xla_outer_products() -> Callable[[Any, Any], Any]:
    import tensorflow as tf

    return tf.function(broadcast_outer_products, jit_compile=True, reduce_retracing=True)


def segment_sum(values: Any, segments: Any, num_segments: Any) -> Any:
    """``out[n] = sum_{k: segments[k] = n} values[k]``, ``(num_segments, ...)``: rows added into
    zeros, as an embedding's per-example tables and its weighted sums (clipped and DP sums) are.

    On TensorFlow one small XLA computation (a nested ``tf.function(jit_compile=True)``, unless
    the graph is compiled by XLA already) adds the rows, faster than ``UnsortedSegmentSum``. On
    PyTorch ``index_add_`` adds them in place: Keras's ``segment_sum`` copies all the rows
    again. Measured: docs/benchmarks.md, "Route measurements"."""
    if is_tensorflow() and _nested_xla_wanted():
        return _xla_segment_sum()(values, segments, num_segments)
    if is_torch():
        import torch

        out = torch.zeros((num_segments, *values.shape[1:]), dtype=values.dtype,
                          device=values.device)
        return out.index_add_(0, segments.long(), values)
    return ops.segment_sum(values, segments, num_segments)


@functools.cache
def _xla_segment_sum() -> Callable[[Any, Any, Any], Any]:
    import tensorflow as tf

    return tf.function(tf.math.unsorted_segment_sum, jit_compile=True, reduce_retracing=True)


def _nested_xla_wanted() -> bool:
    """Whether a TensorFlow graph being built now should call a nested XLA computation: not
    when XLA compiles the whole graph already, and only where XLA runs at all (not on a build
    or device plugin without it)."""
    from pergrad._compat import tracing_for_xla

    return not tracing_for_xla() and _nested_xla_runs()


@functools.cache
def _nested_xla_runs() -> bool:
    """Whether TensorFlow compiles and runs a ``jit_compile=True`` function here: asked once,
    eagerly, on a tiny input."""
    import tensorflow as tf

    with tf.init_scope():  # eagerly, even while a graph is being traced
        try:
            _xla_outer_products()(tf.zeros([1, 1, 1]), tf.zeros([1, 1, 1]))
        except (tf.errors.OpError, NotImplementedError, ValueError):
            return False
    return True


def row_squared_norms(t: Any) -> Any:
    """``(B,)``: ``||t[i]||^2``, the sum of squares over every axis but the first.

    TensorFlow's ``Square`` then ``Sum`` writes a ``t``-sized tensor and reads it again; one
    ``EuclideanNorm`` reduction, squared, reads ``t`` once (faster: docs/benchmarks.md, "Route
    measurements"; the result differs by about one ulp). Its gradient is set to ``2 t`` (the
    square of a square root has none at a zero row). XLA has no ``EuclideanNorm`` kernel and
    fuses the two ops itself, so under ``jit_compile=True``, on other backends and for other
    dtypes the squares are summed."""
    if is_torch():  # eager: one native call instead of three dispatched keras.ops
        flat = t.reshape(t.shape[0], -1)
        return (flat * flat).sum(dim=1)
    flat = ops.reshape(t, [batch_size(t), -1])
    if is_tensorflow() and dtype_of(t) in ("float32", "float64"):
        from pergrad._compat import tracing_for_xla

        if not tracing_for_xla():
            return _tensorflow_row_squared_norms(flat)
    return ops.sum(ops.square(flat), axis=1)


def _tensorflow_row_squared_norms(flat: Any) -> Any:
    import tensorflow as tf

    @tf.custom_gradient
    def squared(rows):
        def gradient(upstream):
            return 2.0 * rows * upstream[:, None]
        return tf.square(tf.math.reduce_euclidean_norm(rows, axis=1)), gradient

    return squared(flat)


def vjp(fn: Callable[[Any], Any], primal: Any, cotangent: Any) -> Any:
    """``d/dp <fn(p), cotangent>`` at ``p = primal``: one vector-Jacobian product."""
    if is_tensorflow():
        import tensorflow as tf
        with tf.GradientTape() as tape:
            tape.watch(primal)
            out = fn(primal)
        return tape.gradient(out, primal, output_gradients=cotangent)
    if is_jax():
        import jax
        _, pullback = jax.vjp(fn, primal)
        return pullback(cotangent)[0]
    if is_torch():
        import torch
        _, pullback = torch.func.vjp(fn, primal)
        return pullback(cotangent)[0]
    raise NotImplementedError(f"vjp has no {keras.backend.backend()} definition")


def trace_token() -> Any:
    """What a cached intermediate belongs to, or ``None`` where caching is unnecessary.

    A tensor built inside a TensorFlow ``tf.cond`` branch cannot be used outside it, so a form
    caches per graph. Under ``jax.jit`` XLA merges repeated subcomputations itself, so JAX needs
    no cache (and a tracer must never leak out of a ``lax.cond`` branch). PyTorch runs eagerly:
    one token for the process, so a form's intermediates are computed once and shared."""
    if is_tensorflow():
        from pergrad._compat import current_graph
        return current_graph()
    if is_torch():
        return _EAGER
    return None


_EAGER = object()


def snapshot(t: Any) -> Any:
    """``t``'s value now, unchanged by later writes to the variable it was read from: ``t``
    itself on TensorFlow and JAX (values are immutable), a copy on PyTorch, where Keras assigns
    a variable in place (``copy_``) and ``variable.value`` is the variable's own storage."""
    if is_torch():
        return t.detach().clone()
    return t


def map_in_chunks(fn: Callable[..., Any], arrays: tuple, chunk: int) -> Any:
    """``fn(*arrays)`` computed over consecutive chunks of ``chunk`` rows (the leading axis of
    every array) and concatenated; ``fn`` must treat rows independently. On JAX one
    ``lax.map`` over the chunks (a remainder chunk after it), so that a chunk's intermediates
    stay in cache; elsewhere, or when one chunk holds every row, ``fn(*arrays)`` itself."""
    batch = static_or_none(arrays[0].shape[0])
    if not is_jax() or batch is None or chunk >= batch:
        return fn(*arrays)
    import jax

    whole = batch // chunk * chunk
    stacked = tuple(ops.reshape(a[:whole], [batch // chunk, chunk, *a.shape[1:]])
                    for a in arrays)
    out = jax.lax.map(lambda parts: fn(*parts), stacked)
    out = ops.reshape(out, [whole, *out.shape[2:]])
    if whole < batch:
        out = ops.concatenate([out, fn(*(a[whole:] for a in arrays))], axis=0)
    return out


def static_or_none(dim: Any) -> int | None:
    """A static dimension as an int, ``None`` when it is dynamic (a tensor or ``None``)."""
    return dim if isinstance(dim, int) else None


def zero_rows(t: Any, keep: Any) -> Any:
    """``t`` with the rows (first axis) where ``keep`` is false replaced by zeros (not
    multiplied: NaN and inf rows become 0 too); ``t`` itself when ``keep`` is ``None``."""
    if keep is None:
        return t
    mask = ops.reshape(keep, [-1] + [1] * (rank(t) - 1))
    return ops.where(mask, t, ops.zeros_like(t))


def is_floating(dtype: Any) -> bool:
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))


def wide_float() -> str:
    """float64 where the backend computes in it: always on TensorFlow, on JAX only with
    ``jax_enable_x64`` (else float32); always on PyTorch."""
    if is_jax():
        import jax
        return "float64" if jax.config.jax_enable_x64 else "float32"
    return "float64"


def divide_no_nan(numerator: Any, denominator: Any) -> Any:
    """``numerator / denominator``, 0 where the denominator is 0 (``tf.math.divide_no_nan``)."""
    zero = ops.equal(denominator, 0)
    safe = ops.where(zero, ops.ones_like(denominator), denominator)
    return ops.where(zero, ops.zeros_like(numerator * safe), numerator / safe)


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """Inside the block, float32 matrix products and convolutions round as float32 (24-bit
    mantissa), not TensorFloat-32 (10-bit): on PyTorch with CUDA, where cuDNN convolutions use
    TF32 by default, it turns TF32 off for cuDNN and CUDA matrix products and restores both
    settings after. Elsewhere it does nothing (TensorFlow's and XLA's settings are left as the
    user set them)."""
    if not is_torch():
        yield
        return
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
