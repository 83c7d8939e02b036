"""What PyTorch's runtime says about the computation: eager, one process, its precision."""

from __future__ import annotations

from typing import Any

from keras import ops


def is_tracing(x: Any) -> bool:
    """False: PyTorch runs eagerly, nothing is traced."""
    return False


def has_strategy() -> bool:
    return False


def process_count() -> int:
    return 1


def tensor_float_32() -> bool:
    """False: pergrad's float32 checks run under ``full_float32``, which turns TensorFloat-32
    off."""
    return False


def layer_rounding(layer: Any, dtype: str) -> str:
    """Keras's dtype promotion on PyTorch reaches ``keras.ops.matmul`` itself
    (``result_type("float64", "float64")`` is ``"float32"`` there, and the torch backend
    multiplies in that dtype), so every layer of a float64 model rounds as float32."""
    return "float32" if dtype == "float64" else dtype


def wide_scalar(value: float) -> Any:
    """``value`` as a float64 scalar tensor."""
    return ops.convert_to_tensor(value, "float64")
