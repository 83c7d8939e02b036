"""The math: Jacobians in reverse and forward mode, Hessians forward-over-reverse.

All functions here build graph ops and are meant to run inside one `tf.function` trace.
Notation: f maps inputs x = (x_1, ..., x_L) (the leaves of a nested structure) to outputs
y = (y_1, ..., y_K). The Jacobian block J_kl = d y_k / d x_l has shape
(*shape(y_k), *shape(x_l)); with ``batched=True`` it has shape (B, *ex(y_k), *ex(x_l)),
ex() being the per-example shape, and row b is d y_k[b] / d x_l[b].

Reverse mode (``rev``): one forward pass under a tape, then for each output leaf k the VJPs
``u -> u^T J_k`` for every one-hot u over y_k's M_k elements, vectorized over u (pfor):
M_k rows at the cost of one vectorized backward pass.

Forward mode (``fwd``): for each input leaf l the JVPs ``t -> J_l t`` for every one-hot t
over x_l's N_l elements, with `tf.autodiff.ForwardAccumulator`, vectorized over t.

Batched: since examples are independent, J[b, b'] = 0 for b != b', so one cotangent
u[b] = e_j shared by every example gives sum_b' J[b', b]^T e_j = J[b, b]^T e_j, i.e. row j
of every example's Jacobian at once; likewise a tangent t[b] = e_i gives column i. The
vectorized width is the per-example size, not B times it.

Cost rule of thumb: rev does sum_k M_k VJPs, fwd does sum_l N_l JVPs, each a small multiple
of one forward pass. ``choose_mode`` picks the smaller cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pergrad.backend.lazy import tensorflow as tf
from pergrad.jacobian._structure import (
    batch_first,
    block_shape,
    check_float_outputs,
    check_static_batch,
    leaf_paths,
    move_first_axis_last,
    num_elements,
    pack_blocks,
    single_output,
    static_shape,
)
from pergrad.jacobian._vmap import stack_map

ZERO = "zero"  # tf.UnconnectedGradients.ZERO, by value: reading the enum would import TensorFlow
MODES = ("auto", "rev", "fwd")


# The cost of a vectorized JVP relative to a vectorized VJP, as measured on MLPs and small
# CNNs (docs/jacobian.md, docs/benchmarks.md "Route measurements"): forward mode wins only when
# it needs clearly fewer products.
FWD_PRODUCT_COST = 1.5


def choose_mode(n_in: int, n_out: int) -> str:
    """Forward mode iff ``FWD_PRODUCT_COST * N < M``, else reverse mode.

    N (input elements) is the number of JVPs forward mode needs, M (output elements) the
    number of VJPs reverse mode needs, per example when batched.
    """
    return "fwd" if FWD_PRODUCT_COST * n_in < n_out else "rev"


def _basis(
    index: tf.Tensor, shape: list[int], dtype: tf.DType, like: tf.Tensor | None
) -> tf.Tensor:
    """The one-hot tensor e_index of `shape`; broadcast over the batch of `like` if given."""
    e = tf.reshape(tf.one_hot(index, num_elements(shape), dtype=dtype), shape)
    if like is not None:
        e = tf.broadcast_to(e, tf.shape(like))
    return e


def _batch_size(xs: list[tf.Tensor]) -> int | tf.Tensor:
    """The batch size: a Python int when static, else a scalar tensor."""
    static = xs[0].shape[0]
    return int(static) if static is not None else tf.shape(xs[0])[0]


def check_output_batch(
    ys: list[tf.Tensor], y_paths: list[str], batch: int | tf.Tensor, what: str
) -> list:
    """batched=True: each output must keep the batch dimension. Static check, else an assert op."""
    asserts = []
    static_batch = batch if isinstance(batch, int) else None
    for y, path in zip(ys, y_paths, strict=True):
        check_static_batch(y, path, static_batch, what)
        if y.shape[0] is None or static_batch is None:
            asserts.append(
                tf.debugging.assert_equal(
                    tf.shape(y)[0],
                    batch,
                    message=f"{what}: batched=True but the {path} of f does not keep the "
                    "batch size of the inputs (f must map a batch to a batch)",
                )
            )
    return asserts


def jacobian_rev(
    fn: Callable[[Any], Any],
    x: Any,
    *,
    batched: bool,
    chunk_size: int | None,
    x_paths: list[str],
    what: str = "jacobian",
) -> Any:
    """Reverse mode: for each output leaf y_k, rows u^T J_k for one-hot u, vectorized."""
    xs = tf.nest.flatten(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xs)
        y = fn(tf.nest.pack_sequence_as(x, xs))
    ys = tf.nest.flatten(y)
    y_paths = leaf_paths(y, "output")
    check_float_outputs(ys, y_paths, what)
    in_shapes = [
        static_shape(t, p, batched=batched, what=what) for t, p in zip(xs, x_paths, strict=True)
    ]
    batch = _batch_size(xs) if batched else None
    deps = check_output_batch(ys, y_paths, batch, what) if batched else []

    live = [i for i, s in enumerate(in_shapes) if num_elements(s)]  # empty inputs: zero blocks
    live_xs = [xs[i] for i in live]
    blocks = []
    for y_k, path in zip(ys, y_paths, strict=True):
        out_shape = static_shape(y_k, path, batched=batched, what=what)
        m = num_elements(out_shape)
        row_blocks = [tf.zeros(block_shape(batch, out_shape, s), y_k.dtype) for s in in_shapes]
        if m == 0 or not live:
            blocks.append(row_blocks)
            continue

        def vjp_row(j: tf.Tensor, y_k: tf.Tensor = y_k, out_shape: list[int] = out_shape) -> list:
            u = _basis(j, out_shape, y_k.dtype, y_k if batched else None)
            return tape.gradient(y_k, live_xs, output_gradients=u, unconnected_gradients=ZERO)

        rows = stack_map(vjp_row, m, chunk_size)  # per live input leaf: (m, [B,] *in_shape)
        for i, r in zip(live, rows, strict=True):
            if batched:
                r = batch_first(r)  # (B, m, *in_shape)
            with tf.control_dependencies(deps):  # blocks take the output's dtype, as in fwd
                shape = block_shape(batch, out_shape, in_shapes[i])
                row_blocks[i] = tf.reshape(tf.cast(r, y_k.dtype), shape)
        blocks.append(row_blocks)
    return pack_blocks(y, x, blocks)


def jacobian_fwd(
    fn: Callable[[Any], Any],
    x: Any,
    *,
    batched: bool,
    chunk_size: int | None,
    x_paths: list[str],
    what: str = "jacobian",
) -> Any:
    """Forward mode: for each input leaf x_l, columns J_l t for one-hot t, vectorized."""
    xs = tf.nest.flatten(x)
    in_shapes = [
        static_shape(t, p, batched=batched, what=what) for t, p in zip(xs, x_paths, strict=True)
    ]
    batch = _batch_size(xs) if batched else None
    columns_by_input: list[list[tf.Tensor]] = []
    out_info: dict[str, Any] = {}

    for x_l, in_shape in zip(xs, in_shapes, strict=True):
        n = num_elements(in_shape)

        def jvp_col(i: tf.Tensor, x_l: tf.Tensor = x_l, in_shape: list[int] = in_shape) -> list:
            t = _basis(i, in_shape, x_l.dtype, x_l if batched else None)
            with tf.autodiff.ForwardAccumulator(x_l, t) as acc:
                y = fn(tf.nest.pack_sequence_as(x, xs))
            ys = tf.nest.flatten(y)
            _record_outputs(out_info, y, ys, batched, what)
            deps = check_output_batch(ys, out_info["paths"], batch, what) if batched else []
            with tf.control_dependencies(deps):
                return [tf.identity(acc.jvp(y_k, unconnected_gradients=ZERO)) for y_k in ys]

        if n == 0:
            columns_by_input.append([])  # filled with zeros below, once output shapes are known
            continue
        columns_by_input.append(stack_map(jvp_col, n, chunk_size))  # per output: (n, [B,] *out)

    if "y" not in out_info:  # every input is empty: trace f once just to learn the outputs
        y = fn(x)
        _record_outputs(out_info, y, tf.nest.flatten(y), batched, what)
    ys_struct, out_shapes = out_info["y"], out_info["out_shapes"]
    blocks = [[None] * len(xs) for _ in out_shapes]
    for l_index, (cols, in_shape) in enumerate(zip(columns_by_input, in_shapes, strict=True)):
        for k, out_shape in enumerate(out_shapes):
            shape = block_shape(batch, out_shape, in_shape)
            if not cols or num_elements(out_shape) == 0:
                dtype = out_info["dtypes"][k]
                blocks[k][l_index] = tf.zeros(shape, dtype)
                continue
            c = move_first_axis_last(cols[k])  # ([B,] *out_shape, n)
            blocks[k][l_index] = tf.reshape(c, shape)
    return pack_blocks(ys_struct, x, blocks)


def _record_outputs(info: dict, y: Any, ys: list, batched: bool, what: str) -> None:
    """Validates f's outputs once per trace and remembers their structure and shapes."""
    if "y" in info:
        return
    paths = leaf_paths(y, "output")
    check_float_outputs(ys, paths, what)
    info["y"] = y
    info["paths"] = paths
    info["out_shapes"] = [
        static_shape(t, p, batched=batched, what=what) for t, p in zip(ys, paths, strict=True)
    ]
    info["dtypes"] = [t.dtype for t in ys]


def output_sizes(fn: Callable[[Any], Any], x: Any, *, batched: bool, what: str) -> int:
    """Total (per-example if batched) number of output elements, from an unexecuted trace of f.

    The trace lives in its own graph, so nothing of it runs: f's side effects (BatchNorm
    moving statistics with training=True) are not doubled by this probe.
    """
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), x)
    probe = tf.function(fn, autograph=False).get_concrete_function(specs)
    outs = tf.nest.flatten(probe.structured_outputs)
    paths = leaf_paths(probe.structured_outputs, "output")
    check_float_outputs(outs, paths, what)
    return sum(
        num_elements(static_shape(t, p, batched=batched, what=what))
        for t, p in zip(outs, paths, strict=True)
    )


def hessian_fwd_over_rev(
    fn: Callable[[Any], Any],
    x: Any,
    *,
    batched: bool,
    chunk_size: int | None,
    x_paths: list[str],
    what: str = "hessian",
) -> Any:
    """H_{l1 l2} = d^2 f / dx_l1 dx_l2, column by column: H e_i = JVP of the gradient along e_i.

    Each column is a forward-mode derivative (ForwardAccumulator) of the reverse-mode gradient,
    vectorized over the one-hot tangents e_i of each input leaf. With batched=True, f returns
    one scalar per example (shape (B,)), the gradient of their sum is every example's gradient
    (examples independent), and a tangent shared across the batch gives every example's Hessian.
    """
    xs = tf.nest.flatten(x)
    in_shapes = [
        static_shape(t, p, batched=batched, what=what) for t, p in zip(xs, x_paths, strict=True)
    ]
    batch = _batch_size(xs) if batched else None
    cols_by_tangent = []
    for x_l, in_shape in zip(xs, in_shapes, strict=True):
        n = num_elements(in_shape)

        def hvp_col(i: tf.Tensor, x_l: tf.Tensor = x_l, in_shape: list[int] = in_shape) -> list:
            t = _basis(i, in_shape, x_l.dtype, x_l if batched else None)
            with tf.autodiff.ForwardAccumulator(x_l, t) as acc:
                with tf.GradientTape() as tape:
                    tape.watch(xs)
                    y = fn(tf.nest.pack_sequence_as(x, xs))
                    s, deps = scalar_objective(y, batched, batch, what)
                grads = tape.gradient(s, xs, unconnected_gradients=ZERO)
            with tf.control_dependencies(deps):
                return [tf.identity(acc.jvp(g, unconnected_gradients=ZERO)) for g in grads]

        cols_by_tangent.append(stack_map(hvp_col, n, chunk_size) if n else None)

    blocks = []
    for l1, (x1, shape1) in enumerate(zip(xs, in_shapes, strict=True)):
        row = []
        for cols, shape2 in zip(cols_by_tangent, in_shapes, strict=True):
            shape = block_shape(batch, shape1, shape2)
            if cols is None or num_elements(shape1) == 0:
                row.append(tf.zeros(shape, x1.dtype))
            else:
                row.append(tf.reshape(move_first_axis_last(cols[l1]), shape))
        blocks.append(row)
    return pack_blocks(x, x, blocks)


def scalar_objective(y: Any, batched: bool, batch: Any, what: str) -> tuple[tf.Tensor, list]:
    """Checks f returned a scalar (or one scalar per example): (what to differentiate, asserts)."""
    y = single_output(y, batched, what)
    if batched:
        return tf.reduce_sum(y), check_output_batch([y], ["output"], batch, what)
    return y, []
