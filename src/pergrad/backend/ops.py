"""Array primitives the rules and forms need beyond :mod:`keras.ops`.

The backend-neutral ones are written once (:mod:`pergrad.backend.neutral`); the others come
from the running backend's package (:func:`pergrad.backend.native`), chosen once when this
module is imported: a transposed batched product, outer products, segment sums, row norms, a
vector-Jacobian product, chunks of examples, the token a cached intermediate belongs to, a
snapshot of a value, the widest float and a block without TensorFloat-32.
"""

from __future__ import annotations

from pergrad.backend import native
from pergrad.backend.neutral import (
    add_n,
    batch_size,
    broadcast_outer_products,
    divide_no_nan,
    dtype_of,
    is_floating,
    maximum,
    minimum,
    rank,
    static_or_none,
    zero_rows,
)

_native = native()

matmul_ta = _native.matmul_ta
outer_products = _native.outer_products
segment_sum = _native.segment_sum
row_squared_norms = _native.row_squared_norms
vjp = _native.vjp
map_in_chunks = _native.map_in_chunks
trace_token = _native.trace_token
snapshot = _native.snapshot
wide_float = _native.wide_float
full_float32 = _native.full_float32

__all__ = ["add_n", "batch_size", "broadcast_outer_products", "divide_no_nan", "dtype_of",
           "full_float32", "is_floating", "map_in_chunks", "matmul_ta", "maximum", "minimum",
           "outer_products",
           "rank", "row_squared_norms", "segment_sum", "snapshot", "static_or_none",
           "trace_token", "vjp", "wide_float", "zero_rows"]
