"""Compile once: one compiled object per f for the one-shot products (`jvp`, `vjp`, `hvp`).

`compiled_for(f, kind, options, build)` caches one compiled object per (f, kind, options)
without keeping f alive, so that the one-shot helpers called in a loop with the same f reuse
one trace; `trace_counts(f)` reports those traces. What a compiled object is belongs to the
backend (``pergrad.backend.<name>.jacobian``: a ``tf.function`` on TensorFlow, a ``jax.jit`` on
JAX, torch.func transforms run eagerly on PyTorch).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

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
