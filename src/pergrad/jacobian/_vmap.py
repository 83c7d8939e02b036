"""Vectorized maps over a basis index, optionally in chunks.

`stack_map(fn, n, chunk_size)` returns ``stack([fn(i) for i in range(n)])`` (nested), built with
`tf.vectorized_map` (pfor): the body is traced once and every op that depends on ``i`` is
rewritten to act on all indices at once, while ops that do not (the primal forward pass, for
example) stay unbatched and run once.

With a chunk size c, at most c indices are vectorized at a time: one chunk, then a sequential
`tf.map_fn` over the remaining full chunks, then the remainder, chained by control dependencies
so that they run one after the other and peak memory is that of one chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pergrad.backend.lazy import tensorflow as tf


def _vmap(fn: Callable[[tf.Tensor], Any], indices: tf.Tensor) -> Any:
    return tf.vectorized_map(fn, indices)


def stack_map(fn: Callable[[tf.Tensor], Any], n: int, chunk_size: int | None) -> Any:
    """Stacks ``fn(i)`` for ``i`` in ``range(n)`` along a new leading axis.

    Args:
      fn: maps a scalar int32 index tensor to a nested structure of tensors.
      n: number of indices (static, >= 1).
      chunk_size: at most this many indices are vectorized at once; None for all.
    """
    if chunk_size is None or chunk_size >= n:
        return _vmap(fn, tf.range(n))
    first = _vmap(fn, tf.range(chunk_size))
    parts = [first]
    n_full = n // chunk_size
    if n_full > 1:
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), first)

        def one_chunk(c: tf.Tensor) -> Any:
            return _vmap(fn, c * chunk_size + tf.range(chunk_size))

        with tf.control_dependencies(tf.nest.flatten(parts[-1])):
            start = tf.identity(tf.constant(1))
        rest = tf.map_fn(
            one_chunk,
            tf.range(start, n_full),
            fn_output_signature=spec,
            parallel_iterations=1,
        )
        rest = tf.nest.map_structure(
            lambda r: tf.reshape(r, tf.concat([[-1], tf.shape(r)[2:]], axis=0)), rest
        )
        parts.append(rest)
    remainder = n - n_full * chunk_size
    if remainder:
        with tf.control_dependencies(tf.nest.flatten(parts[-1])):
            base = tf.identity(tf.constant(n_full * chunk_size))
        parts.append(_vmap(fn, base + tf.range(remainder)))
    if len(parts) == 1:
        return first
    return tf.nest.map_structure(lambda *ps: tf.concat(ps, axis=0), *parts)
