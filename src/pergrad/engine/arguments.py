"""Validation of the public numeric arguments: Python and NumPy numbers alike, never a bool.

Every refusal is a ``ValueError`` naming the argument, as :mod:`pergrad.aggregate`'s checks are.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _scalar(value: Any, name: str) -> np.ndarray:
    """``value`` as a 0-d NumPy array of integer or floating kind."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a number, got the bool {value!r}.")
    try:
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    except Exception:  # noqa: BLE001 - a symbolic tensor or an object NumPy cannot read
        array = None
    if array is None or array.ndim != 0 or array.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be a Python or NumPy number, got {value!r} "
                         f"({type(value).__name__}).")
    return array


def positive_real(value: Any, name: str) -> float:
    """``value`` as a Python float; it must be a finite number ``> 0`` (``np.float32(1.0)``
    is fine, ``True``, ``nan`` and ``inf`` are not)."""
    number = float(_scalar(value, name))
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {number}.")
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {number}.")
    return number


def positive_integer(value: Any, name: str) -> int:
    """``value`` as a Python int ``>= 1`` (``np.int64(8)`` and ``8.0`` are fine, ``8.5``,
    ``True``, ``nan`` and ``inf`` are not)."""
    array = _scalar(value, name)
    if array.dtype.kind == "f":
        number = float(array)
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite number, got {number}.")
        if not number.is_integer():
            raise ValueError(f"{name} must be a whole number, got {number}.")
    integer = int(array)
    if integer < 1:
        raise ValueError(f"{name} must be positive, got {integer}.")
    return integer
