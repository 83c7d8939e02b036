"""The math, once for every backend: Jacobians in reverse and forward mode, Hessians
forward-over-reverse, on the running backend's primitives (``pergrad.backend.<name>.jacobian``:
a persistent ``GradientTape``, ``ForwardAccumulator`` and ``vectorized_map`` on TensorFlow;
``jax.vjp``, ``jax.jvp`` and ``jax.vmap``; ``torch.func``'s). Each function runs inside one
compiled trace (TensorFlow's ``tf.function``, JAX's ``jax.jit``) or, on PyTorch, one eager
call.

Notation: f maps inputs x = (x_1, ..., x_L) (the leaves of a nested structure) to outputs
y = (y_1, ..., y_K). The Jacobian block J_kl = d y_k / d x_l has shape
(*shape(y_k), *shape(x_l)); with ``batched=True`` it has shape (B, *ex(y_k), *ex(x_l)),
ex() being the per-example shape, and row b is d y_k[b] / d x_l[b].

Reverse mode (``rev``): one forward pass (``vjp``), then for each output leaf k the pullbacks
``u -> u^T J_k`` of every one-hot u over y_k's M_k elements, vectorized over u: M_k rows at
the cost of one vectorized backward pass.

Forward mode (``fwd``): for each input leaf l the JVPs ``t -> J_l t`` for every one-hot t over
x_l's N_l elements, vectorized over t; the primal computation does not depend on the tangent,
so the vectorization leaves it unbatched.

Hessians: column i of H is the JVP of the gradient along e_i (forward-over-reverse).

Batched: since examples are independent, J[b, b'] = 0 for b != b', so one cotangent
u[b] = e_j shared by every example gives sum_b' J[b', b]^T e_j = J[b, b]^T e_j, i.e. row j
of every example's Jacobian at once; likewise a tangent t[b] = e_i gives column i. The
vectorized width is the per-example size, not B times it. A batch size known only at run time
(TensorFlow) is checked by an assertion that runs with the result.

Batched forward mode, one example at a time: a tangent e_i shared by every example is still a
tangent of the whole batch, so a linear first layer pushes B copies of it. Where the backend's
``Routes.per_example_forward_mode`` says so (TensorFlow, JAX), f runs in inference (nothing
of it reads the batch) and every batch size is known at trace time, forward mode instead maps over the examples, calling f on a batch of one with the
tangent e_i of that one example: the tangent then does not depend on the example, and the
vectorization leaves every product of it with what does not either (the first layer's JVP) to
run once instead of B times, as ``jax.vmap(jax.jacfwd(f))`` does.

Cost rule of thumb: rev does sum_k M_k VJPs, fwd does sum_l N_l JVPs, each a small multiple
of one forward pass. ``choose_mode`` picks the smaller cost. ``chunk_size`` vectorizes at most
that many products at once, chunks in sequence. Random layers see one seed state per call:
every product of a call draws the same dropout mask, as the one forward pass of reverse mode
does. On JAX and PyTorch f runs as a pure function of the traced state
(:func:`pergrad.jacobian._functional.pure`) and what it assigns is written once (``keep``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from pergrad import backend
from pergrad.jacobian._functional import first_writes, keep, pure
from pergrad.jacobian._structure import (
    block_shape,
    check_float_outputs,
    check_static_batch,
    flatten,
    leaf_paths,
    num_elements,
    pack_as,
    pack_blocks,
    single_output,
    static_shape,
)

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


def _backend() -> ModuleType:
    """The running backend's primitives (:class:`pergrad.backend.protocol.ModePrimitives`)."""
    return backend.part("jacobian")


def _shapes(ts: list, paths: list[str], batched: bool, what: str) -> list[list[int]]:
    return [static_shape(t, p, batched=batched, what=what) for t, p in zip(ts, paths, strict=True)]


def _unit(shape_of: list[int], dtype: Any, like: Any, batched: bool, index: Any) -> Any:
    """The one-hot e_index of `shape_of`, broadcast over the batch of `like` when batched."""
    return _backend().basis(index, shape_of, dtype, like if batched else None)


def _batch_message(path: str, what: str) -> str:
    return (f"{what}: batched=True but the {path} of f does not keep the batch size of the "
            "inputs (f must map a batch to a batch)")


def _check_output_batch(ys: list, paths: list[str], batch: Any, what: str,
                        run_time: bool = True) -> list:
    """``batched=True``: each output keeps the inputs' batch size. Checked now where both are
    static; else (``run_time``) by assertions to run with the result, returned."""
    static = batch if isinstance(batch, int) else None
    deps = []
    for y, path in zip(ys, paths, strict=True):
        check_static_batch(y, path, static, what)
        if run_time and (y.shape[0] is None or static is None):
            deps.append(_backend().batch_assert(y, 0, batch, _batch_message(path, what)))
    return deps


def jacobian_rev(fn: Callable[[Any], Any], x: Any, *, batched: bool, chunk_size: int | None,
                 x_paths: list[str], what: str = "jacobian") -> Any:
    """Reverse mode: one ``vjp``, the pullback of every one-hot cotangent, vectorized."""
    B = _backend()
    y, pullback, writes = B.vjp(pure(fn), x)
    keep(writes)
    xs, ys = flatten(x), flatten(y)
    y_paths = leaf_paths(y, "output")
    check_float_outputs(ys, y_paths, what)
    in_shapes = _shapes(xs, x_paths, batched, what)
    batch = B.batch_size(xs[0]) if batched else None
    deps = _check_output_batch(ys, y_paths, batch, what) if batched else []
    any_input = any(num_elements(s) for s in in_shapes)
    blocks = []
    for k, (y_k, out_shape) in enumerate(zip(ys, _shapes(ys, y_paths, batched, what),
                                             strict=True)):
        m = num_elements(out_shape)
        if m == 0 or not any_input:
            blocks.append([B.zeros(block_shape(batch, out_shape, s), y_k.dtype, y_k)
                           for s in in_shapes])
            continue

        def row(j, k=k, y_k=y_k, out_shape=out_shape):
            return B.pull_one(pullback, y, k, _unit(out_shape, y_k.dtype, y_k, batched, j))

        rows = B.stack_map(row, m, chunk_size, y_k)  # per input leaf: (m, [B,] *in_shape)
        blocks.append([
            B.depending_on(deps, B.cast(B.reshape(B.moveaxis(r, 0, 1) if batched else r,
                                                  block_shape(batch, out_shape, s)), y_k.dtype))
            for r, s in zip(rows, in_shapes, strict=True)
        ])
    return pack_blocks(y, x, blocks)


def jacobian_fwd(fn: Callable[[Any], Any], x: Any, *, batched: bool, chunk_size: int | None,
                 x_paths: list[str], what: str = "jacobian", inference: bool = False) -> Any:
    """Forward mode: the JVP along every one-hot tangent of each input leaf, vectorized; with
    ``batched`` and ``inference`` (f's examples are apart: it may run on one at a time) one
    example at a time where the backend's routes say so and every batch size is known at trace
    time (see the module notes)."""
    B = _backend()
    f = pure(fn)
    xs = flatten(x)
    y, _ = B.eval_shape(f, x)  # the outputs' structure, shapes and dtypes
    ys = flatten(y)
    y_paths = leaf_paths(y, "output")
    check_float_outputs(ys, y_paths, what)
    in_shapes = _shapes(xs, x_paths, batched, what)
    out_shapes = _shapes(ys, y_paths, batched, what)
    batch = B.batch_size(xs[0]) if batched else None
    if batched:  # at run time below, on the columns: `ys` are abstract
        _check_output_batch(ys, y_paths, batch, what, run_time=False)
    if (batched and inference and backend.native().ROUTES.per_example_forward_mode
            and isinstance(batch, int) and all(t.shape[0] is not None for t in ys)):
        # Every batch size is known now (checked above): nothing is left to run-time checks.
        return _jacobian_fwd_per_example(f, x, y, in_shapes, out_shapes, batch, chunk_size)
    blocks = [[B.zeros(block_shape(batch, o, s), t.dtype, xs[0]) for s in in_shapes]
              for o, t in zip(out_shapes, ys, strict=True)]
    kept = False
    for l_index, (x_l, in_shape) in enumerate(zip(xs, in_shapes, strict=True)):
        n = num_elements(in_shape)
        if n == 0:
            continue

        def column(i, l_index=l_index, x_l=x_l, in_shape=in_shape):
            t = _unit(in_shape, x_l.dtype, x_l, batched, i)
            _, out, writes = B.jvp_along(f, x, l_index, t)
            return flatten(out), writes

        columns, writes = B.stack_map(column, n, chunk_size, x_l)  # per output: (n, [B,] *out)
        if not kept:  # every product ran f from the same state: write once
            keep(first_writes(writes))
            kept = True
        for k, (c, out_shape) in enumerate(zip(columns, out_shapes, strict=True)):
            unknown = not isinstance(batch, int) or ys[k].shape[0] is None
            deps = ([B.batch_assert(c, 1, batch, _batch_message(y_paths[k], what))]
                    if batched and unknown else [])
            blocks[k][l_index] = B.depending_on(
                deps, B.reshape(B.moveaxis(c, 0, -1), block_shape(batch, out_shape, in_shape)))
    return pack_blocks(y, x, blocks)


def _jacobian_fwd_per_example(f: Callable[[Any], Any], x: Any, y: Any, in_shapes: list,
                              out_shapes: list, batch: int, chunk_size: int | None) -> Any:
    """Batched forward mode mapped over the examples: for example b, the JVPs of the pure f on
    the batch of one ``x[b:b+1]`` along every one-hot tangent of one example, vectorized over
    the tangents and then over the examples. J_kl[b] = d f(x[b:b+1])_k / d x_l[b:b+1], one
    example's block, since f treats examples apart. ``y`` is f's abstract output on the batch,
    whose batch sizes are all ``batch`` (checked by the caller)."""
    B = _backend()
    xs, ys = flatten(x), flatten(y)

    def example(b):
        one = [B.one_example(leaf, b) for leaf in xs]  # (1, *ex) each
        x_b = pack_as(x, one)
        columns_by_leaf, writes_by_leaf = [], []
        for l_index, (x_l, in_shape) in enumerate(zip(one, in_shapes, strict=True)):
            n = num_elements(in_shape)
            if n == 0:
                columns_by_leaf.append(None)
                continue

            def column(i, l_index=l_index, x_l=x_l, in_shape=in_shape):
                t = B.reshape(_unit(in_shape, x_l.dtype, None, False, i), [1, *in_shape])
                _, out, writes = B.jvp_along(f, x_b, l_index, t)
                return flatten(out), writes

            columns, writes = B.stack_map(column, n, chunk_size, x_l)  # (n, 1, *out) each
            columns_by_leaf.append(columns)
            writes_by_leaf.append(first_writes(writes))
        return columns_by_leaf, (writes_by_leaf[0] if writes_by_leaf else [])

    per_leaf, writes = B.stack_map(example, batch, None, xs[0])  # (B, n, 1, *out) each
    keep(first_writes(writes))
    blocks = []
    for k, (o, t) in enumerate(zip(out_shapes, ys, strict=True)):
        row = []
        for columns, s in zip(per_leaf, in_shapes, strict=True):
            shape = block_shape(batch, o, s)
            if columns is None:
                row.append(B.zeros(shape, t.dtype, xs[0]))
            else:  # (B, n, 1, *out) -> (B, *out, n) -> (B, *out, *in)
                c = B.reshape(columns[k], [batch, num_elements(s), *o])
                row.append(B.reshape(B.moveaxis(c, 1, -1), shape))
        blocks.append(row)
    return pack_blocks(y, x, blocks)


def output_sizes(fn: Callable[[Any], Any], x: Any, *, batched: bool, what: str) -> int:
    """Total (per-example if batched) number of output elements, from ``eval_shape`` (nothing
    of it runs on TensorFlow and JAX, and f's writes in it are dropped)."""
    y, _ = _backend().eval_shape(pure(fn), x)
    ys, paths = flatten(y), leaf_paths(y, "output")
    check_float_outputs(ys, paths, what)
    return sum(num_elements(s) for s in _shapes(ys, paths, batched, what))


def hessian_fwd_over_rev(fn: Callable[[Any], Any], x: Any, *, batched: bool,
                         chunk_size: int | None, x_paths: list[str],
                         what: str = "hessian") -> Any:
    """H_{l1 l2} = d^2 f / dx_l1 dx_l2, column by column: H e_i is the JVP of the gradient
    along e_i, vectorized over the one-hot tangents of each input leaf. With ``batched=True``
    f returns one scalar per example (shape (B,)), the gradient of their sum is every
    example's gradient (examples independent), and a tangent shared across the batch gives
    every example's Hessian."""
    B = _backend()
    f = pure(fn)
    xs = flatten(x)
    in_shapes = _shapes(xs, x_paths, batched, what)
    batch = B.batch_size(xs[0]) if batched else None
    checks: list = []  # the output's run-time batch assertions, which every column waits for

    def objective(d):
        y, writes = f(d)
        y = single_output(y, batched, what)
        if batched:
            checks[:] = _check_output_batch([y], ["output"], batch, what)
            y = B.sum(y)
        return y, writes

    if not any(num_elements(s) for s in in_shapes):
        B.eval_shape(objective, x)  # f's output checked even when every input is empty
    gradient = B.grad(objective)
    columns_by_tangent = []
    for l_index, (x_l, in_shape) in enumerate(zip(xs, in_shapes, strict=True)):
        n = num_elements(in_shape)
        if n == 0:
            columns_by_tangent.append(None)
            continue

        def column(i, l_index=l_index, x_l=x_l, in_shape=in_shape):
            t = _unit(in_shape, x_l.dtype, x_l, batched, i)
            _, hv, writes = B.jvp_along(gradient, x, l_index, t)
            return [B.depending_on(checks, h) for h in flatten(hv)], writes

        columns, writes = B.stack_map(column, n, chunk_size, x_l)
        if all(c is None for c in columns_by_tangent):
            keep(first_writes(writes))
        columns_by_tangent.append(columns)
    blocks = []
    for l1, (x1, shape1) in enumerate(zip(xs, in_shapes, strict=True)):
        row = []
        for columns, shape2 in zip(columns_by_tangent, in_shapes, strict=True):
            shape = block_shape(batch, shape1, shape2)
            if columns is None or num_elements(shape1) == 0:
                row.append(B.zeros(shape, x1.dtype, x1))
            else:
                row.append(B.reshape(B.moveaxis(columns[l1], 0, -1), shape))
        blocks.append(row)
    return pack_blocks(x, x, blocks)
