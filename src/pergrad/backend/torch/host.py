"""Host (NumPy) state from PyTorch: everything runs eagerly, so it is called directly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras import ops


def host_call(fn: Callable[..., Any], results: list | None, *args: Any) -> Any:
    """``fn(*args)`` now, ``args`` as NumPy arrays."""
    return fn(*keras.tree.map_structure(ops.convert_to_numpy, args))


def branch(predicate: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """A Python branch: only the taken function runs."""
    return true_fn() if bool(predicate) else false_fn()


def wait_for_host_callbacks() -> None:
    """Nothing to wait for: calls return when done."""
