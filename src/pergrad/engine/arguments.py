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


def real(value: Any, name: str, minimum: float | None = None, strict: bool = False,
         below: float | None = None) -> float:
    """``value`` as a finite Python float with ``value >= minimum`` (``> minimum`` if
    ``strict``) and ``value < below`` where given (``np.float32(1.0)`` is fine, ``True``,
    ``nan`` and ``inf`` are not)."""
    number = float(_scalar(value, name))
    if below is not None:
        wanted = f"in {'(' if strict else '['}{minimum:g}, {below:g})"
    elif minimum is not None:
        wanted = f"a finite number {'>' if strict else '>='} {minimum:g}"
    else:
        wanted = "a finite number"
    if not math.isfinite(number) \
            or (minimum is not None and (number <= minimum if strict else number < minimum)) \
            or (below is not None and not number < below):
        raise ValueError(f"{name} must be {wanted}, got {value!r}.")
    return number


def integer(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as a Python int ``>= minimum`` (``np.int64(8)`` and ``8.0`` are fine;
    ``8.5`` is refused, not rounded, as are ``True``, ``nan`` and ``inf``)."""
    array = _scalar(value, name)
    if array.dtype.kind == "f":
        number = float(array)
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite number, got {number}.")
        if not number.is_integer():
            raise ValueError(f"{name} must be a whole number, got {number}.")
    result = int(array)
    if result < minimum:
        wanted = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {result}.")
    return result


def positive_real(value: Any, name: str) -> float:
    """``value`` as a finite Python float ``> 0``."""
    return real(value, name, minimum=0.0, strict=True)


def positive_integer(value: Any, name: str) -> int:
    """``value`` as a Python int ``>= 1``."""
    return integer(value, name, minimum=1)
