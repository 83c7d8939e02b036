"""Nested structures: leaf paths for error messages, input checks, Jacobian block packing.

Everything here runs in Python at call or trace time; nothing here builds graph ops except
`to_tensor` (a conversion) and the small shape helpers used by the modes. The checks
(`static_shape`, `check_float_outputs`, `single_output`, `check_static_batch`) and
`flatten`/`pack_as` work on every backend: on TensorFlow they use `tf.nest`, elsewhere
`keras.tree` (both order dict keys sorted and treat None as a leaf).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np

from pergrad import backend
from pergrad.backend.ops import is_floating


def flatten(structure: Any) -> list:
    """The leaves of `structure`, in the order `leaf_paths` names them (the backend's
    ``flatten``: ``tf.nest`` on TensorFlow, ``keras.tree`` elsewhere)."""
    return backend.part("jacobian").flatten(structure)


def pack_as(structure: Any, leaves: list) -> Any:
    """`leaves` nested like `structure` (the inverse of `flatten`)."""
    return backend.part("jacobian").pack_as(structure, leaves)


def on_leaf(structure: Any, index: int, value: Any, zeros_like: Callable[[Any], Any]) -> Any:
    """``structure`` with ``value`` at flat leaf ``index`` and zeros at every other leaf (a
    one-leaf tangent or cotangent for the transforms that take a whole structure)."""
    leaves = flatten(structure)
    return pack_as(structure, [value if i == index else zeros_like(leaf)
                               for i, leaf in enumerate(leaves)])


def static_batch_size(t: Any) -> int:
    """``t``'s leading dimension, where every shape is static (JAX traces per shape; PyTorch
    runs eagerly)."""
    return int(t.shape[0])


def no_batch_assert(t: Any, axis: int, batch: Any, message: str) -> None:
    """No run-time assertion where every shape is static: `_modes` checks at trace time."""
    del t, axis, batch, message


def no_dependencies(deps: list, t: Any) -> Any:
    """``t``: there are no run-time assertions to wait for (see :func:`no_batch_assert`)."""
    del deps
    return t


def pull_through_zeros(pullback: Callable, y: Any, k: int, u: Any) -> list:
    """The flat input gradient of the cotangent ``u`` on ``y``'s flat leaf ``k`` and zeros on
    the others, for a pullback that takes a whole structure (``jax.vjp``, ``torch.func.vjp``)."""
    (grads,) = pullback(on_leaf(y, k, u, keras.ops.zeros_like))
    return flatten(grads)


def jvp_through_zeros(fn: Callable, x: Any, index: int, t: Any) -> tuple:
    """The running backend's ``jvp(fn, (x,), (tangents,))`` with the tangent ``t`` on ``x``'s
    flat leaf ``index`` and zeros on the others (JAX, PyTorch)."""
    from pergrad import backend

    return backend.part("jacobian").jvp(fn, (x,), (on_leaf(x, index, t, keras.ops.zeros_like),))


def rank(t: Any) -> int | None:
    """The number of dimensions of `t` (None for a TensorFlow tensor of unknown rank, whose
    shape alone has a ``rank``)."""
    shape = t.shape
    return shape.rank if hasattr(shape, "rank") else len(shape)


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
    n = len(flatten(structure))
    if len(paths) != n:
        paths = [f"{root}<leaf {i}>" for i in range(n)]
    return paths


def to_tensor(x: Any, path: str, what: str) -> Any:
    """Converts one leaf to a tensor and checks it is floating.

    Variables are kept as they are: a `tf.Variable` on TensorFlow, a Keras variable on
    other backends (the backend's ``convert_leaf``; the callers decide what a variable means
    to them).

    Raises:
      TypeError: naming `path` when the leaf is not floating point.
    """
    try:
        x = backend.part("jacobian").convert_leaf(x)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{what}: {path} is a {type(x).__name__}, which cannot be converted to a tensor. "
            "Pass tensors, NumPy arrays or Python floats."
        ) from err
    if not is_floating(x.dtype):
        raise TypeError(
            f"{what}: {path} has dtype {keras.backend.standardize_dtype(x.dtype)}; derivatives "
            "are defined for floating inputs only. Cast it first, e.g. "
            "keras.ops.cast(x, 'float32'), or leave it out of the differentiated arguments "
            "(argnums)."
        )
    return x


def check_float_outputs(ys: Sequence[Any], paths: Sequence[str], what: str) -> None:
    """Raises TypeError naming the output leaf when f returns something non-floating."""
    for y, path in zip(ys, paths, strict=True):
        if not (hasattr(y, "shape") and hasattr(y, "dtype")) or not is_floating(y.dtype):
            kind = (keras.backend.standardize_dtype(y.dtype) if hasattr(y, "dtype")
                    else type(y).__name__)
            raise TypeError(
                f"{what}: f's {path} is {kind}; derivatives need floating outputs. "
                "Return only floating tensors from f (cast, or drop integer outputs)."
            )


def static_shape(t: Any, path: str, *, batched: bool, what: str) -> list[int]:
    """The static shape that indexes Jacobian rows or columns: per-example if `batched`.

    Raises:
      ValueError: when that shape is not fully known at trace time (the one-hot basis needs
        its size), or when `batched` and the tensor has no batch dimension.
    """
    shape = t.shape
    n_dims = rank(t)
    if n_dims is None:
        raise ValueError(f"{what}: {path} has unknown rank; Jacobians need static shapes.")
    if batched:
        if n_dims == 0:
            raise ValueError(
                f"{what}: batched=True but {path} is a scalar; every input and output needs a "
                "leading batch dimension. Use batched=False for the full Jacobian."
            )
        dims = list(shape)[1:]
    else:
        dims = list(shape)
    if any(d is None for d in dims):
        free = "every non-batch dimension" if batched else "every dimension"
        raise ValueError(
            f"{what}: {path} has shape {tuple(shape)}, with {free} needed statically to build the "
            "Jacobian basis. Pass inputs with static shapes, or an input_signature that fixes "
            f"{free}."
        )
    return [int(d) for d in dims]


def num_elements(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def input_size(x: Any, x_paths: list[str], *, batched: bool, what: str) -> int:
    """Total (per-example if batched) number of input elements: the JVPs forward mode needs."""
    return sum(
        num_elements(static_shape(t, p, batched=batched, what=what))
        for t, p in zip(flatten(x), x_paths, strict=True)
    )


def block_shape(batch: Any, out_shape: Sequence[int], in_shape: Sequence[int]) -> list:
    """Final shape of one Jacobian block: ([B,] *out_shape, *in_shape); ``batch`` is an int, a
    scalar tensor known at run time only (TensorFlow packs such a list itself) or None."""
    dims = list(out_shape) + list(in_shape)
    return dims if batch is None else [batch, *dims]


def pack_blocks(outputs: Any, inputs: Any, blocks: list[list[Any]]) -> Any:
    """Nest blocks[k][l] (output leaf k, input leaf l) like JAX: outputs outer, inputs inner."""
    rows = [pack_as(inputs, row) for row in blocks]
    return pack_as(outputs, rows)


def check_static_batch(y: Any, path: str, batch: int | None, what: str) -> None:
    """batched=True: output `y` must keep the inputs' batch size. Raises when that is known
    to fail now; a dimension unknown until run time is left to the caller (an assert op)."""
    if rank(y) == 0:
        raise ValueError(
            f"{what}: batched=True but f's {path} is a scalar; f must map a batch to "
            "a batch (leading dimension B). Use batched=False for the full Jacobian."
        )
    lead = y.shape[0]
    if lead is not None and batch is not None and int(lead) != int(batch):
        raise ValueError(
            f"{what}: batched=True but f's {path} has leading dimension {lead} "
            f"while the inputs have batch size {batch}; f must map a batch to a "
            "batch with independent examples. Use batched=False for the full Jacobian."
        )


def single_output(y: Any, batched: bool, what: str) -> Any:
    """The one floating output of a Hessian's f: a scalar, or (batched) one per example.

    Raises:
      ValueError: when f returns several tensors or the wrong rank.
    """
    ys = flatten(y)
    if len(ys) != 1:
        raise ValueError(f"{what}: f must return a single tensor, got {len(ys)} outputs.")
    (y,) = ys
    check_float_outputs([y], ["output"], what)
    if batched:
        if rank(y) != 1:
            raise ValueError(
                f"{what}: batched=True needs f to return one scalar per example (shape (B,)), "
                f"got shape {tuple(y.shape)}."
            )
    elif rank(y) != 0:
        raise ValueError(
            f"{what}: f must return a scalar, got shape {tuple(y.shape)}. Reduce it (e.g. "
            "keras.ops.sum) or use batched=True for per-example scalars of shape (B,)."
        )
    return y
