"""The JAX primitives of `pergrad.jacobian._modes` and `pergrad.jacobian._functional`: ``jax.vjp``, ``jax.jvp``, ``jax.grad``
and ``jax.vmap`` inside one ``jax.jit`` over the values of the Keras variables f reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pergrad.backend.jax.engine import compile_function
from pergrad.jacobian._functional import (  # noqa: F401 - what JAX and PyTorch share
    convert_argument,
    convert_leaf,
    dispatch,
    flatten,
    hvp_product,
    jvp_product,
    pack_as,
    signature_function,
    structural_key,
    user_function,
    vjp_product,
)
from pergrad.jacobian._structure import (
    jvp_through_zeros,
    no_batch_assert,
    no_dependencies,
    num_elements,
    pull_through_zeros,
    static_batch_size,
)

TRACES = True  # `compile` traces its body once per shape: `trace_count` counts the traces


def compile(state: Any, body: Callable[..., Any]) -> Callable[..., Any]:
    """``body(*args)`` as one ``jax.jit`` over ``args`` and the values of ``state.variables``,
    writing back what the body assigned (`_functional.keep`)."""
    return compile_function(state, body, lambda: None)


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def is_float_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)


def detach(value: Any) -> Any:
    return value  # a JAX array carries no autograd history


def as_array(value: Any, like: Any, *, cast: bool = False) -> Any:
    """`value` as an array of `like`'s dtype; an array passes unchanged unless ``cast``."""
    if isinstance(value, jax.Array) and not cast:
        return value
    return jnp.asarray(value, dtype=like.dtype)


def vjp(fn: Callable[[Any], tuple[Any, Any]], x: Any) -> tuple[Any, Callable, Any]:
    """``(y, pullback, aux)`` for ``fn(x) = (y, aux)``."""
    return jax.vjp(fn, x, has_aux=True)


def jvp(fn: Callable[..., tuple[Any, Any]], primals: tuple, tangents: tuple) -> tuple:
    """``(y, J t, aux)`` for ``fn(*primals) = (y, aux)``."""
    return jax.jvp(fn, primals, tangents, has_aux=True)


def grad(fn: Callable[[Any], tuple[Any, Any]]) -> Callable[[Any], tuple[Any, Any]]:
    """``x -> (d fn(x)[0] / dx, aux)``."""
    return jax.grad(fn, has_aux=True)


def eval_shape(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)``'s structure, shapes and dtypes, abstractly (nothing runs)."""
    return jax.eval_shape(fn, x)


def stack_map(fn: Callable[[Any], Any], n: int, chunk_size: int | None, like: Any) -> Any:
    """``fn(i)`` for i in range(n), stacked: one vmap, or chunks of `chunk_size` in sequence."""
    del like  # one device: XLA places the indices
    indices = jnp.arange(n)
    if chunk_size is None or chunk_size >= n:
        return jax.vmap(fn)(indices)
    return jax.lax.map(fn, indices, batch_size=chunk_size)


def basis(index: Any, shape: list[int], dtype: Any, like: Any) -> Any:
    """The one-hot e_index of `shape`, broadcast to the shape of `like` if given (batched)."""
    e = jnp.reshape(jax.nn.one_hot(index, num_elements(shape), dtype=dtype), shape)
    return e if like is None else jnp.broadcast_to(e, like.shape)


def one_example(t: Any, index: Any) -> Any:
    """``t[index:index + 1]`` (a traced index: a dynamic slice)."""
    return jax.lax.dynamic_index_in_dim(t, index, 0, keepdims=True)


def zeros(shape: list[int], dtype: Any, like: Any) -> Any:
    del like  # one device: XLA places it
    return jnp.zeros(shape, dtype)


zeros_like = jnp.zeros_like
reshape = jnp.reshape
moveaxis = jnp.moveaxis
sum = jnp.sum  # noqa: A001 - the primitive's name in every backend module


def cast(t: Any, dtype: Any) -> Any:
    return t.astype(dtype)


# -- what `pergrad.jacobian._modes` needs beyond the transforms: shapes are static here ------
batch_size = static_batch_size
batch_assert = no_batch_assert
depending_on = no_dependencies
pull_one = pull_through_zeros
jvp_along = jvp_through_zeros
