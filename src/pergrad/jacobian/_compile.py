"""Compile once: traced functions with a trace counter, shape-keyed dispatch, a cache per f.

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
* `compiled_for(f, kind, options, build)` caches one compiled object per (f, kind, options)
  without keeping f alive, so that one-shot helpers (`jvp`, `vjp`, `hvp`) called in a loop with
  the same f reuse one trace.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from pergrad.backend.lazy import tensorflow as tf


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


# ---------------------------------------------------------------------------------------------
# Per-f cache for the one-shot helpers.

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STRONG_CACHE: dict[int, tuple[Any, dict]] = {}  # for callables that cannot be weakly referenced
_CACHE_LOCK = threading.Lock()


def _owner_and_key(f: Any) -> tuple[Any, Hashable]:
    """Bound methods are recreated on every attribute access: key them by (instance, function)."""
    if hasattr(f, "__self__") and hasattr(f, "__func__"):
        return f.__self__, ("method", f.__func__)
    return f, ("callable",)


def _slot(owner: Any) -> dict:
    try:
        return _CACHE.setdefault(owner, {})
    except TypeError:  # not weakly referenceable: keep it (and f) alive
        entry = _STRONG_CACHE.setdefault(id(owner), (owner, {}))
        return entry[1]


def compiled_for(f: Any, kind: str, options: Hashable, build: Callable[[Callable], Any]) -> Any:
    """The cached compiled object for (f, kind, options), built by ``build(f_ref)`` once.

    ``build`` receives a zero-argument function returning f (a weak reference where possible),
    so the compiled object does not keep f alive through the cache.
    """
    owner, fkey = _owner_and_key(f)
    with _CACHE_LOCK:
        slot = _slot(owner)
        key = (fkey, kind, options)
        compiled = slot.get(key)
        if compiled is None:
            compiled = build(_weak_getter(f))
            slot[key] = compiled
    return compiled


def _weak_getter(f: Any) -> Callable[[], Any]:
    if hasattr(f, "__self__") and hasattr(f, "__func__"):
        try:
            return weakref.WeakMethod(f)  # type: ignore[return-value]
        except TypeError:
            return lambda: f
    try:
        return weakref.ref(f)
    except TypeError:
        return lambda: f


def trace_counts(f: Callable[..., Any]) -> dict[str, int]:
    """How many times the one-shot helpers traced for f, by kind (``{"jvp": 1, ...}``; on
    PyTorch, which traces nothing, how many primal layouts they were built for).

    Calling `jvp`, `vjp` or `hvp` again with the same f and the same argument shapes and
    dtypes must leave these numbers unchanged; use it to check a training loop does not retrace.
    """
    owner, fkey = _owner_and_key(f)
    with _CACHE_LOCK:
        try:
            slot = _CACHE.get(owner)
        except TypeError:
            slot = _STRONG_CACHE.get(id(owner), (None, None))[1]
    counts: dict[str, int] = {}
    for (key_f, kind, _), compiled in (slot or {}).items():
        if key_f == fkey:
            counts[kind] = counts.get(kind, 0) + compiled.trace_count
    return counts
