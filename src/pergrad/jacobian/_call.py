"""How f is called: Keras layers get `training=`, and positional args split by `argnums`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras

from pergrad import backend

Argnums = int | Sequence[int] | None


def make_caller(f: Callable[..., Any], training: bool, what: str) -> Callable[..., Any]:
    """Returns ``g(*args)`` that calls f, passing ``training=`` when f is a Keras layer or model.

    Keras layers and models default to ``training=False`` (inference: dropout off, BatchNorm
    with moving statistics). A plain function controls its own behaviour, so asking for
    ``training=True`` there is an error rather than a silently ignored flag. A plain function
    is what the backend's ``user_function`` makes of it: converted by AutoGraph on TensorFlow;
    as it is on JAX, which traces Python control flow, and on PyTorch, which runs it.
    """
    if not callable(f):
        raise TypeError(f"{what}: f must be callable (a Keras model or layer, or a function).")
    if isinstance(f, keras.Layer):
        layer = f

        def call_layer(*args: Any) -> Any:
            return layer(*args, training=training)

        return call_layer
    if training:
        raise ValueError(
            f"{what}: training=True applies to Keras layers and models only; f is a "
            f"{type(f).__name__}. Call your model with training=True inside f instead."
        )
    return backend.part("jacobian").user_function(f)


def primal_args(primals: Any) -> tuple[tuple, bool]:
    """`jvp`/`vjp`/`hvp` primals as (f's positional args, whether primals was that tuple).

    JAX's convention with one Keras-friendly exception: a tuple (not a named tuple) is the
    tuple of f's positional arguments; anything else is f's single argument.
    """
    if isinstance(primals, tuple) and not hasattr(primals, "_fields"):
        return primals, True
    return (primals,), False


def normalize_argnums(argnums: Argnums, what: str) -> int | tuple[int, ...] | None:
    """Validates `argnums` (JAX convention): None (all args), an int, or a tuple of ints."""
    if argnums is None:
        return None
    if isinstance(argnums, bool) or not isinstance(argnums, (int, Sequence)):
        raise TypeError(
            f"{what}: argnums must be None, an int or a tuple of ints, got {argnums!r}."
        )
    if isinstance(argnums, int):
        if argnums < 0:
            raise ValueError(f"{what}: argnums must be non-negative, got {argnums}.")
        return argnums
    nums = tuple(argnums)
    if not nums or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in nums):
        raise ValueError(
            f"{what}: argnums must be a non-empty tuple of non-negative ints, got {argnums!r}."
        )
    if len(set(nums)) != len(nums):
        raise ValueError(f"{what}: argnums has repeated entries: {argnums!r}.")
    return nums


def diff_positions(argnums: int | tuple[int, ...] | None, n_args: int, what: str) -> list[int]:
    """The positional indices that are differentiated, checked against the call's arity."""
    if n_args == 0:
        raise ValueError(f"{what}: call it with at least one positional argument to differentiate.")
    if argnums is None:
        return list(range(n_args))
    nums = [argnums] if isinstance(argnums, int) else list(argnums)
    bad = [a for a in nums if a >= n_args]
    if bad:
        raise ValueError(
            f"{what}: argnums={argnums!r} refers to argument {bad[0]}, but the call passed "
            f"only {n_args} positional argument(s)."
        )
    return nums


def split_args(
    args: tuple, argnums: int | tuple[int, ...] | None
) -> tuple[Any, Callable[[Any], tuple]]:
    """Splits args into (the differentiated structure, rebuild).

    The differentiated structure is the single argument when one is differentiated (argnums
    an int, or None with one argument), else the tuple of differentiated arguments.
    ``rebuild(diff)`` returns the full positional-argument tuple with `diff` put back.
    """
    positions = (
        list(range(len(args)))
        if argnums is None
        else ([argnums] if isinstance(argnums, int) else list(argnums))
    )
    single = isinstance(argnums, int) or (argnums is None and len(args) == 1)
    diff = args[positions[0]] if single else tuple(args[p] for p in positions)

    def rebuild(new_diff: Any) -> tuple:
        full = list(args)
        if single:
            full[positions[0]] = new_diff
        else:
            for p, value in zip(positions, new_diff, strict=True):
                full[p] = value
        return tuple(full)

    return diff, rebuild


def diff_root(argnums: int | tuple[int, ...] | None, n_args: int) -> str:
    """Root name of the differentiated structure in error messages."""
    if isinstance(argnums, int):
        return f"args[{argnums}]"
    if argnums is None and n_args == 1:
        return "args[0]"
    return "args"
