"""The few things that differ between Keras backends, below everything else in pergrad.

Rules, forms and aggregators are written once on :mod:`keras.ops`; this package adds the handful
of array primitives ``keras.ops`` lacks (:mod:`pergrad.backend.ops`) and says which backend is
running. The engine's per-backend parts (how one forward pass is recorded and how one backward
pass reaches the taps) live in :mod:`pergrad.engine.tensorflow` and :mod:`pergrad.engine.jax`.
"""

from __future__ import annotations

import keras

SUPPORTED = ("tensorflow", "jax")


def name() -> str:
    """The running Keras backend: ``"tensorflow"``, ``"jax"`` or ``"torch"``."""
    return keras.backend.backend()


def is_tensorflow() -> bool:
    return name() == "tensorflow"


def is_jax() -> bool:
    return name() == "jax"


def require_supported(what: str = "pergrad") -> str:
    """The backend's name, or a ``NotImplementedError`` that says which backends work."""
    backend = name()
    if backend not in SUPPORTED:
        raise NotImplementedError(
            f"{what} runs on the Keras backends {', '.join(SUPPORTED)}; this process runs "
            f"{backend!r}. Set KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow before importing "
            "keras. The PyTorch backend is not supported yet (docs/backends.md).")
    return backend




def require_tensorflow(what: str) -> None:
    """A ``NotImplementedError`` naming ``what`` unless the backend is TensorFlow: the parts of
    pergrad not yet ported to the backend-neutral core (docs/backends.md lists them)."""
    if not is_tensorflow():
        raise NotImplementedError(
            f"{what} runs on the TensorFlow backend only in this release; this process runs "
            f"Keras on {name()!r}. On JAX, pergrad.PerExample (gradients, norms, losses, dot, "
            "clipped_sum, check) and pergrad.privacy work; see docs/backends.md for what works "
            "where, or set KERAS_BACKEND=tensorflow.")


__all__ = ["SUPPORTED", "is_jax", "is_tensorflow", "name", "require_supported",
           "require_tensorflow"]
