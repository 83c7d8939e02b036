"""Reaching host (NumPy) state from a compiled JAX function: ordered ``io_callback``s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import io_callback
from keras import ops


def host_call(fn: Callable[..., Any], results: list | None, *args: Any) -> Any:
    """``fn(*args)`` on the host, in program order (``io_callback(ordered=True)``), its results
    ``[(shape, dtype), ...]`` (``None``: it returns nothing); ``args`` arrive as NumPy arrays."""
    spec = None if results is None else tuple(
        jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in results)
    return io_callback(fn, spec, *args, ordered=True)


def branch(predicate: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``true_fn()`` where ``predicate`` holds, else ``false_fn()``: a ``lax.cond`` (both
    branches are compiled, one runs)."""
    return ops.cond(predicate, true_fn, false_fn)


def wait_for_host_callbacks() -> None:
    """Let every dispatched computation's host callbacks finish (``jax.effects_barrier``)."""
    jax.effects_barrier()
