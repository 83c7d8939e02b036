"""PyTorch's array primitives. PyTorch runs eagerly: each ``keras.ops`` call costs its dispatch
(about 10 us), so the hot ones are single native calls, and intermediates are built only when
read."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from keras import ops

from pergrad.backend.neutral import broadcast_outer_products, scan_recurrence


def matmul_ta(a: Any, b: Any) -> Any:
    return ops.matmul(ops.swapaxes(a, -1, -2), b)


def outer_products(a: Any, d: Any) -> Any:
    return broadcast_outer_products(a, d)


def segment_sum(values: Any, segments: Any, num_segments: Any) -> Any:
    """``index_add_`` adds the rows in place (Keras's ``segment_sum`` copies all the rows again,
    and adds them in float32), unless ``Routes.native_segment_sums`` is off."""
    from pergrad.backend import torch as package  # this module's own package

    if not package.ROUTES.native_segment_sums:
        return ops.segment_sum(values, segments, num_segments)
    out = torch.zeros((num_segments, *values.shape[1:]), dtype=values.dtype,
                      device=values.device)
    return out.index_add_(0, segments.long(), values)


def row_squared_norms(t: Any) -> Any:
    """``(B,)``: one native call instead of three dispatched ``keras.ops``. (The row length is
    spelled out: a ``(B, -1)`` reshape of an empty batch is ambiguous, and torch refuses it.)"""
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return (flat * flat).sum(dim=1)


def vjp(fn: Callable[[Any], Any], primal: Any, cotangent: Any) -> Any:
    _, pullback = torch.func.vjp(fn, primal)
    return pullback(cotangent)[0]


def map_in_chunks(fn: Callable[..., Any], arrays: tuple, chunk: int) -> Any:
    """``fn(*arrays)`` at once."""
    return fn(*arrays)


def image_patches(x: Any, kernel_size: Any, strides: Any, dilation: Any, padding: str) -> Any:
    """None: wide patches are gathered by slices (``Routes.wide_patches_by_slices``)."""
    return None


_EAGER = object()


def trace_token() -> Any:
    """One token for the process: everything runs eagerly, so a form's intermediates are
    computed once and shared."""
    return _EAGER


def snapshot(t: Any) -> Any:
    """A copy: Keras assigns a PyTorch variable in place (``copy_``), and ``variable.value`` is
    the variable's own storage."""
    return t.detach().clone()


def static_value(t: Any) -> Any:
    """Every tensor holds its value (eager)."""
    return float(t)


def assert_positive(t: Any, message: str) -> Any:
    """``t``: its value is always known (:func:`static_value`), so nothing is left to check."""
    return t


def wide_float() -> str:
    return "float64"


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """Turns TensorFloat-32 off for cuDNN convolutions and CUDA matrix products inside the block
    (PyTorch uses it for cuDNN convolutions by default) and restores both settings after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def unique_row_squared_norms(ids: Any, flat_d: Any, num_rows: int) -> Any:
    raise NotImplementedError("no unique route here: Routes.embedding_norms is 'sorted'")


recurrence = scan_recurrence
