"""The few things that differ between Keras backends, below everything else in pergrad.

As in Keras itself (``keras/src/backend/{tensorflow,jax,torch}``), each backend is a package
exporting the same names, declared by :class:`pergrad.backend.protocol.Backend`: array
primitives ``keras.ops`` lacks, noise keys and draws, and the backend's route choices
(:class:`pergrad.backend.protocol.Routes`). :func:`native` is the running backend's package,
chosen once; rules, forms and aggregators ask it instead of testing which backend runs.

Each package also holds the backend's parts of what is built above ``backend/``, as Keras keeps
its trainers in ``keras/src/backend/*/trainer.py``: ``engine`` (how one forward pass is recorded
with taps, how one backward pass reaches them, the generic rule and the whole-model baselines;
:class:`pergrad.backend.protocol.Engine`), ``trainer`` (the train step's per-backend part and
``PerExampleModel``'s trainer base; :class:`pergrad.backend.protocol.Trainer`) and
``jacobian`` (what :mod:`pergrad.jacobian` differentiates, walks structures, compiles and
computes one-shot products with, :class:`pergrad.backend.protocol.JacobianPrimitives`; on JAX
and PyTorch through :mod:`pergrad.jacobian._functional`,
:class:`pergrad.backend.protocol.FunctionalPrimitives`). :func:`part` imports one of them on
first use; the packages themselves never import them, so the rest of ``backend/`` stays below
everything else.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import TYPE_CHECKING

import keras

if TYPE_CHECKING:
    from pergrad.backend.protocol import Backend

# Where pergrad runs: everything on each of them, but for fit_distributed (tf.distribute's, on
# TensorFlow only: `require_tensorflow`).
SUPPORTED = ("tensorflow", "jax", "torch")
# Where the engine and what is built on it run (pergrad.PerExample, the aggregators,
# PerExampleModel, the monitor, pergrad.stats): every supported backend.
ENGINE_SUPPORTED = SUPPORTED


def name() -> str:
    """The running Keras backend: ``"tensorflow"``, ``"jax"`` or ``"torch"``."""
    return keras.backend.backend()


def is_tensorflow() -> bool:
    return name() == "tensorflow"


def is_jax() -> bool:
    return name() == "jax"


def is_torch() -> bool:
    return name() == "torch"


@functools.cache
def native() -> Backend:
    """The running backend's package (``pergrad.backend.tensorflow``, ``.jax`` or ``.torch``),
    imported on first use and the same for the rest of the process (Keras's backend is fixed
    when Keras is imported)."""
    return importlib.import_module(f"pergrad.backend.{require_supported()}")


def part(name: str) -> ModuleType:
    """The running backend's ``name`` module (``"engine"``, ``"trainer"`` or ``"jacobian"``):
    ``pergrad.backend.<backend>.<name>``, imported on first use."""
    return importlib.import_module(f"pergrad.backend.{require_supported()}.{name}")


def require_supported(what: str = "pergrad", backends: tuple = SUPPORTED) -> str:
    """The backend's name, or a ``NotImplementedError`` that says which backends run ``what``
    (``backends``: :data:`SUPPORTED` unless given, :data:`ENGINE_SUPPORTED` for the engine)."""
    backend = name()
    if backend not in backends:
        raise NotImplementedError(
            f"{what} runs on the Keras backends {', '.join(backends)}; this process runs "
            f"{backend!r}. Set KERAS_BACKEND to one of them (e.g. KERAS_BACKEND=jax) before "
            "importing keras. See "
            "docs/backends.md for what works where.")
    return backend


def require_tensorflow(what: str) -> None:
    """A ``NotImplementedError`` naming ``what`` unless the backend is TensorFlow: the parts of
    pergrad not yet ported to the backend-neutral core (docs/backends.md lists them)."""
    if not is_tensorflow():
        raise NotImplementedError(
            f"{what} runs on the TensorFlow backend only in this release; this process runs "
            f"Keras on {name()!r}. On JAX, train on several devices or processes with "
            "keras.distribution.DataParallel and PerExampleModel.fit (docs/distributed.md). "
            "docs/backends.md says what works where.")


__all__ = ["ENGINE_SUPPORTED", "SUPPORTED", "is_jax", "is_tensorflow", "is_torch", "name", "native",
           "require_supported", "require_tensorflow"]
