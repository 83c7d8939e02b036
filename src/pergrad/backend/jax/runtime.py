"""What JAX's runtime says about the computation being built: tracing, processes, precision."""

from __future__ import annotations

from typing import Any

import jax
import keras
import numpy as np

from pergrad.backend.jax.ops import wide_float

_STATISTICS_LAYERS = tuple(getattr(keras.layers, name) for name in (
    "LayerNormalization", "RMSNormalization", "GroupNormalization", "BatchNormalization")
    if hasattr(keras.layers, name))


def is_tracing(x: Any) -> bool:
    """Whether ``x`` (its first leaf) is a tracer: a compiled function is being traced."""
    return isinstance(keras.tree.flatten(x)[0], jax.core.Tracer)


def has_strategy() -> bool:
    """False: ``keras.distribution`` shards arrays, it opens no strategy scope."""
    return False


def process_count() -> int:
    """``jax.process_count()``: the processes of a multi-process JAX program."""
    return jax.process_count()


def tensor_float_32() -> bool:
    """Whether float32 matmuls run with TensorFloat-32 or less: JAX's default matmul precision
    on a GPU."""
    return jax.default_backend() == "gpu" and jax.config.jax_default_matmul_precision in (
        None, "default", "bfloat16", "tensorfloat32")


def layer_rounding(layer: Any, dtype: str) -> str:
    """Keras's dtype promotion on JAX maps 64-bit results to 32-bit
    (``keras.backend.result_type("float64", "float32")`` is ``"float32"``, to match JAX's
    default), so normalization layers compute their statistics in float32 even in a float64
    model: they round as float32. Without ``jax_enable_x64`` JAX computes every float64 layer
    in float32 (its arrays are truncated), so every such layer rounds as float32."""
    if dtype == "float64" and (isinstance(layer, _STATISTICS_LAYERS)
                               or not jax.config.jax_enable_x64):
        return "float32"
    return dtype


def wide_scalar(value: float) -> Any:
    """``value`` as a NumPy scalar of the widest float: ``jax.jit`` moves it to the device in
    its C++ dispatch, where an eager ``jnp.asarray`` costs one op dispatch per call (a third of
    the Embedding bag model's whole batch gradient: docs/benchmarks.md, "DP noise, dispatch and
    compilation")."""
    return np.asarray(value, wide_float())
