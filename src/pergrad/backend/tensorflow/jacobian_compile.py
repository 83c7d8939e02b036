"""How `pergrad.jacobian` compiles on TensorFlow: ``tf.function`` traces with a trace counter,
one per structural key, and what a differentiated argument and the user's f become first.

* `Traced` wraps a Python function in ``tf.function(reduce_retracing=True)`` and counts how
  many times TensorFlow traced it (a Python counter bumped inside the traced body: it runs at
  trace time only, never when the compiled graph executes).
* `ShapeDispatch` keeps one `Traced` per *structural key*: the nesting and dtypes of the
  arguments and every shape that fixes the Jacobian's layout (all dimensions, or all but the
  batch dimension when ``batched=True``). Within one key only the batch size can change, so
  ``reduce_retracing`` can relax nothing but the batch dimension: a new batch size retraces at
  most once, and the traced code always sees the static per-example shapes it needs to build
  one-hot bases. (A single relaxed tf.function would, after seeing two shapes, trace with
  ``None`` dimensions that the basis cannot use.)
* `user_function` converts a plain f with AutoGraph, as ``tf.function`` would: our own tracing
  runs with ``autograph=False``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import tensorflow as tf

from pergrad.jacobian._structure import leaf_paths, to_tensor


class _Counted:
    """The traced Python callable: bumps the owner's counter, then runs the computation.

    A callable object rather than a closure: TensorFlow keys its "frequent retracing"
    warning by a function's code object, so closures from separate `Traced` objects would
    share one counter and warn about retracing that is really first traces of new objects.
    """

    def __init__(self, owner: Traced, python_fn: Callable[..., Any], name: str) -> None:
        self._owner = owner
        self._python_fn = python_fn
        self.__name__ = name

    def __call__(self, *args: Any) -> Any:
        self._owner.trace_count += 1
        return self._python_fn(*args)


class Traced:
    """``tf.function(python_fn, reduce_retracing=True)`` plus a trace counter."""

    def __init__(
        self,
        python_fn: Callable[..., Any],
        *,
        name: str,
        jit_compile: bool = False,
        input_signature: Any = None,
    ) -> None:
        self.trace_count = 0
        self.function = tf.function(
            _Counted(self, python_fn, name),
            reduce_retracing=True,
            autograph=False,  # the user's f is converted on its own (see _call.autograph)
            jit_compile=jit_compile,
            input_signature=input_signature,
        )

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


def _leaf_key(leaf: Any, batched: bool) -> Hashable:
    if isinstance(leaf, (tf.Tensor, tf.Variable, np.ndarray, np.generic)):
        shape = tuple(leaf.shape)
        if batched and shape:
            shape = (None,) + shape[1:]
        return ("T", leaf.dtype if isinstance(leaf.dtype, tf.DType) else str(leaf.dtype), shape)
    return ("P", type(leaf).__name__)  # Python values: tf.function keys them itself


def structural_key(args: tuple, batched: bool) -> Hashable:
    """Nesting, dtypes and layout-fixing shapes of `args` (see module docstring)."""
    if all(isinstance(a, tf.Tensor) for a in args):  # fast path: plain tensor arguments
        return ("tensors", tuple(_leaf_key(a, batched) for a in args))
    leaves = tf.nest.flatten(args)
    structure = tf.nest.pack_sequence_as(args, [0] * len(leaves))
    return (repr(structure), tuple(_leaf_key(leaf, batched) for leaf in leaves))


class ShapeDispatch:
    """One `Traced` per structural key; ``build(key)`` makes the Python function to trace."""

    def __init__(
        self,
        build: Callable[[Hashable], Callable[..., Any]],
        *,
        name: str,
        jit_compile: bool,
    ) -> None:
        self._build = build
        self._name = name
        self._jit_compile = jit_compile
        self._by_key: dict[Hashable, Traced] = {}
        self._lock = threading.Lock()

    @property
    def trace_count(self) -> int:
        return sum(t.trace_count for t in self._by_key.values())

    def __call__(self, key: Hashable, *args: Any) -> Any:
        traced = self._by_key.get(key)
        if traced is None:
            with self._lock:
                traced = self._by_key.get(key)
                if traced is None:
                    traced = Traced(
                        self._build(key), name=self._name, jit_compile=self._jit_compile
                    )
                    self._by_key[key] = traced
        return traced(*args)


def dispatch(build: Callable[[Hashable], Callable[..., Any]], f: Any, *, name: str,
             jit_compile: bool) -> ShapeDispatch:
    """One ``tf.function`` per structural key of the arguments, made by ``build(key)``."""
    del f  # the trace reads f's variables itself
    return ShapeDispatch(build, name=name, jit_compile=jit_compile)


def signature_function(run: Callable[..., Any], *, name: str, jit_compile: bool,
                       input_signature: Any, what: str) -> Traced:
    """``run`` traced once for the user's ``input_signature`` (a ``tf.TensorSpec`` list)."""
    del what
    return Traced(run, name=name, jit_compile=jit_compile, input_signature=input_signature)


def user_function(f: Callable[..., Any]) -> Callable[..., Any]:
    """f converted by AutoGraph (Python control flow on tensors), as `tf.function` would do.

    Our own tracing code runs with ``autograph=False``; only the user's function is converted.
    Callables AutoGraph cannot convert (no source, builtins) are used as they are.
    """
    try:
        return tf.autograph.to_graph(f)
    except Exception:  # noqa: BLE001 - AutoGraph raises many kinds; unconverted f still works
        return f


def convert_argument(arg: Any, pos: int, what: str) -> Any:
    """A differentiated argument: float tensors pass through; others converted or refused."""
    if isinstance(arg, tf.Tensor) and arg.dtype.is_floating:
        return arg  # fast path: the common case costs one isinstance check
    paths = leaf_paths(arg, f"args[{pos}]")
    leaves = tf.nest.flatten(arg)
    converted = [to_tensor(leaf, p, what) for leaf, p in zip(leaves, paths, strict=True)]
    for leaf, p in zip(converted, paths, strict=True):
        if isinstance(leaf, tf.Variable):
            raise TypeError(
                f"{what}: {p} is a tf.Variable; this transform differentiates with "
                "respect to tensor arguments. Pass tf.convert_to_tensor(v) and use it "
                "inside f, or use pergrad.jacobian.jvp/vjp/hvp, which accept variables."
            )
    return tf.nest.pack_sequence_as(arg, converted)
