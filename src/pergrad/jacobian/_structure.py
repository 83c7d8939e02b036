"""Nested structures: leaf paths for error messages, input checks, Jacobian block packing.

Everything here runs in Python at call or trace time; nothing here builds graph ops except
`to_tensor` (a conversion) and the small shape helpers used by the modes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf


def leaf_paths(structure: Any, root: str) -> list[str]:
    """Human-readable paths (``args[0]['w']``) of the leaves of `structure`, in tf.nest order.

    Falls back to ``root<leaf i>`` for nest types this walker does not know, so that error
    messages never fail.
    """
    paths: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, Mapping):
            for key in sorted(node):
                walk(node[key], f"{path}[{key!r}]")
        elif isinstance(node, tuple) and hasattr(node, "_fields"):
            for field in node._fields:
                walk(getattr(node, field), f"{path}.{field}")
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")
        else:
            paths.append(path)

    walk(structure, root)
    n = len(tf.nest.flatten(structure))
    if len(paths) != n:
        paths = [f"{root}<leaf {i}>" for i in range(n)]
    return paths


def is_tensor_like(x: Any) -> bool:
    """True for the leaves we treat as array data (tensors, variables, NumPy arrays)."""
    return isinstance(x, (tf.Tensor, tf.Variable, np.ndarray, np.generic))


def to_tensor(x: Any, path: str, what: str) -> tf.Tensor | tf.Variable:
    """Converts one leaf to a tensor (variables are kept as they are) and checks it is floating.

    Raises:
      TypeError: naming `path` when the leaf is not floating point.
    """
    if not isinstance(x, tf.Variable):
        try:
            x = tf.convert_to_tensor(x)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"{what}: {path} is a {type(x).__name__}, which cannot be converted to a tensor. "
                "Pass tensors, NumPy arrays or Python floats."
            ) from err
    if not x.dtype.is_floating:
        raise TypeError(
            f"{what}: {path} has dtype {x.dtype.name}; derivatives are defined for floating "
            f"inputs only. Cast it first, e.g. tf.cast(x, tf.float32), or leave it out of the "
            f"differentiated arguments (argnums)."
        )
    return x


def check_float_outputs(ys: Sequence[tf.Tensor], paths: Sequence[str], what: str) -> None:
    """Raises TypeError naming the output leaf when f returns something non-floating."""
    for y, path in zip(ys, paths, strict=True):
        if not isinstance(y, (tf.Tensor, tf.Variable)) or not y.dtype.is_floating:
            kind = y.dtype.name if hasattr(y, "dtype") else type(y).__name__
            raise TypeError(
                f"{what}: f's {path} is {kind}; derivatives need floating outputs. "
                "Return only floating tensors from f (cast, or drop integer outputs)."
            )


def static_shape(t: tf.Tensor, path: str, *, batched: bool, what: str) -> list[int]:
    """The static shape that indexes Jacobian rows or columns: per-example if `batched`.

    Raises:
      ValueError: when that shape is not fully known at trace time (the one-hot basis needs
        its size), or when `batched` and the tensor has no batch dimension.
    """
    shape = t.shape
    if shape.rank is None:
        raise ValueError(f"{what}: {path} has unknown rank; Jacobians need static shapes.")
    if batched:
        if shape.rank == 0:
            raise ValueError(
                f"{what}: batched=True but {path} is a scalar; every input and output needs a "
                "leading batch dimension. Use batched=False for the full Jacobian."
            )
        dims = shape[1:]
    else:
        dims = shape
    if not dims.is_fully_defined():
        free = "every non-batch dimension" if batched else "every dimension"
        raise ValueError(
            f"{what}: {path} has shape {shape}, with {free} needed statically to build the "
            "Jacobian basis. Pass inputs with static shapes, or an input_signature that fixes "
            f"{free}."
        )
    return [int(d) for d in dims]


def num_elements(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def move_first_axis_last(t: tf.Tensor) -> tf.Tensor:
    """(n, d1, ..., dk) -> (d1, ..., dk, n)."""
    rank = t.shape.rank
    if rank == 1:
        return t
    return tf.transpose(t, list(range(1, rank)) + [0])


def batch_first(t: tf.Tensor) -> tf.Tensor:
    """(n, B, d...) -> (B, n, d...)."""
    rank = t.shape.rank
    return tf.transpose(t, [1, 0] + list(range(2, rank)))


def block_shape(
    batch: int | tf.Tensor | None, out_shape: Sequence[int], in_shape: Sequence[int]
) -> list[int] | tf.Tensor:
    """Final shape of one Jacobian block: ([B,] *out_shape, *in_shape)."""
    dims = list(out_shape) + list(in_shape)
    if batch is None:
        return dims
    if isinstance(batch, int):
        return [batch, *dims]
    return tf.concat([tf.reshape(batch, [1]), tf.constant(dims, tf.int32)], axis=0)


def pack_blocks(outputs: Any, inputs: Any, blocks: list[list[tf.Tensor]]) -> Any:
    """Nest blocks[k][l] (output leaf k, input leaf l) like JAX: outputs outer, inputs inner."""
    rows = [tf.nest.pack_sequence_as(inputs, row) for row in blocks]
    return tf.nest.pack_sequence_as(outputs, rows)
