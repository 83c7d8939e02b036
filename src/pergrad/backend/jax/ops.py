"""JAX's array primitives: ``keras.ops`` compositions XLA compiles well, ``jax.vjp``, and chunks
of examples under ``lax.map`` (each choice measured: docs/benchmarks.md, "Route
measurements")."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
from keras import ops

from pergrad.backend.neutral import broadcast_outer_products, scan_recurrence, static_or_none


def matmul_ta(a: Any, b: Any) -> Any:
    """``a^T b``: XLA folds the transpose into the dot on its own."""
    return ops.matmul(ops.swapaxes(a, -1, -2), b)


def outer_products(a: Any, d: Any) -> Any:
    return broadcast_outer_products(a, d)


def segment_sum(values: Any, segments: Any, num_segments: Any) -> Any:
    return ops.segment_sum(values, segments, num_segments)


def row_squared_norms(t: Any) -> Any:
    """``(B,)``: XLA fuses the squares into the sum. (The row length is spelled out: a
    ``[B, -1]`` reshape of an empty batch is ambiguous, and JAX refuses it.)"""
    return ops.sum(ops.square(ops.reshape(t, [t.shape[0], math.prod(t.shape[1:])])), axis=1)


def vjp(fn: Callable[[Any], Any], primal: Any, cotangent: Any) -> Any:
    _, pullback = jax.vjp(fn, primal)
    return pullback(cotangent)[0]


def map_in_chunks(fn: Callable[..., Any], arrays: tuple, chunk: int) -> Any:
    """``fn(*arrays)`` over consecutive chunks of ``chunk`` rows, one ``lax.map`` over the chunks
    (a remainder chunk after it), so that a chunk's intermediates stay in cache; ``fn(*arrays)``
    itself when one chunk holds every row. ``fn`` must treat rows independently."""
    batch = static_or_none(arrays[0].shape[0])
    if batch is None or chunk >= batch:
        return fn(*arrays)
    whole = batch // chunk * chunk
    stacked = tuple(ops.reshape(a[:whole], [batch // chunk, chunk, *a.shape[1:]])
                    for a in arrays)
    out = jax.lax.map(lambda parts: fn(*parts), stacked)
    out = ops.reshape(out, [whole, *out.shape[2:]])
    if whole < batch:
        out = ops.concatenate([out, fn(*(a[whole:] for a in arrays))], axis=0)
    return out


def concatenate_over_range(fn: Callable[[Any], Any], count: int) -> Any:
    """``concatenate([fn(k) for k in range(count)])`` as one ``lax.map`` over ``k``, a traced
    ``int32``: XLA compiles ``fn`` once instead of ``count`` times (the example-mixing check's
    one-example model calls: half its compile time)."""
    out = jax.lax.map(fn, ops.arange(count, dtype="int32"))
    return ops.reshape(out, [count * out.shape[1], *out.shape[2:]])


def image_patches(x: Any, kernel_size: Any, strides: Any, dilation: Any, padding: str) -> Any:
    """None: XLA has no patch kernel worth taking (``Routes.wide_patches_by_slices``)."""
    return None


def trace_token() -> Any:
    """``None``: under ``jax.jit`` XLA merges repeated subcomputations itself, so no cache is
    needed (and a tracer must never leak out of a ``lax.cond`` branch)."""
    return None


def snapshot(t: Any) -> Any:
    """``t`` itself: JAX arrays are immutable."""
    return t


def static_value(t: Any) -> Any:
    """``t``'s value outside a trace, ``None`` for a tracer."""
    if isinstance(t, jax.core.Tracer):
        return None
    return float(t)


def assert_positive(t: Any, message: str) -> Any:
    """``t``: JAX shapes are static, so counts taken from shapes are known while tracing."""
    return t


def wide_float() -> str:
    """float64 with ``jax_enable_x64``, else float32."""
    return "float64" if jax.config.jax_enable_x64 else "float32"


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """Nothing to do: XLA's precision settings are left as the user set them."""
    yield


def unique_row_squared_norms(ids: Any, flat_d: Any, num_rows: int) -> Any:
    raise NotImplementedError("no unique route here: Routes.embedding_norms is 'sorted'")


recurrence = scan_recurrence
