"""Aggregators that need every per-example gradient: coordinate-wise order statistics, custom.

These materialize ``g_i`` (``(B, *var.shape)`` per variable). Only the ``n`` *included*
examples count: finite, and of nonzero sample weight (so Poisson padding rows are left out).
Under ``tf.distribute`` the per-example gradients of all replicas are gathered
(``all_gather``), so the statistic is over the global batch and matches one device.
"""

from __future__ import annotations

import inspect
import math

from keras import ops

from pergrad.aggregate.base import (
    Aggregator,
    Partial,
    gathering_local,
    register,
    require_rows,
)
from pergrad.backend.ops import add_n, dtype_of, rank, wide_float
from pergrad.engine.arguments import real


def _sorted_included(v, include):
    """``v`` sorted along the examples axis, excluded rows moved to the end (as ``+inf``)."""
    mask = ops.reshape(include > 0, [-1] + [1] * (rank(v) - 1))
    return ops.sort(ops.where(mask, v, ops.full_like(v, math.inf)), axis=0)


def _count(include):
    return ops.cast(ops.sum(include), "int32")


@register
def median() -> Aggregator:
    """Coordinate-wise median of the included ``g_i``: for every coordinate ``j``,
    ``median_i g_i[j]`` (the mean of the two middle values when ``n`` is even; 0 if ``n = 0``).
    """

    def finalize(partial: Partial, key) -> list:
        require_rows(partial.rows, "median")
        n = _count(partial.include)
        lo, hi = ops.maximum((n - 1) // 2, 0), ops.maximum(n // 2, 0)
        out = []
        for v in partial.values:
            s = _sorted_included(v, partial.include)
            m = 0.5 * (ops.take(s, lo, axis=0) + ops.take(s, hi, axis=0))
            out.append(ops.where(n > 0, m, ops.zeros_like(m)))
        return out

    return Aggregator("median", {}, gathering_local, finalize, gathers=True)


@register
def trimmed_mean(fraction: float) -> Aggregator:
    """Coordinate-wise trimmed mean: for every coordinate, drop the ``k = floor(fraction * n)``
    smallest and ``k`` largest of the ``n`` included values and average the other ``n - 2k``.
    ``fraction`` must lie in ``[0, 0.5)``; ``fraction=0`` is the mean over included examples.
    """
    fraction = real(fraction, "fraction", minimum=0.0, below=0.5)

    def finalize(partial: Partial, key) -> list:
        require_rows(partial.rows, "trimmed_mean")
        n = _count(partial.include)
        k = ops.cast(ops.floor(fraction * ops.cast(n, wide_float())), "int32")
        out = []
        for v in partial.values:
            s = _sorted_included(v, partial.include)
            position = ops.reshape(ops.arange(ops.shape(v)[0], dtype="int32"),
                                   [-1] + [1] * (rank(v) - 1))
            window = ops.logical_and(position >= k, position < n - k)
            total = ops.sum(ops.where(window, s, ops.zeros_like(s)), axis=0)
            out.append(total / ops.cast(ops.maximum(n - 2 * k, 1), dtype_of(v)))
        return out

    return Aggregator("trimmed_mean", {"fraction": fraction}, gathering_local, finalize,
                      gathers=True)


@register
def custom(fn) -> Aggregator:
    """``fn(per_example_grads, norms) -> grads``: any function of all per-example gradients.

    ``per_example_grads`` is a list aligned with the trainable variables, each ``(B, *var.shape)``
    (rows of dropped or zero-weight examples are zero); ``norms`` is ``||g_i||``, ``(B,)``. ``fn``
    must return one tensor per variable with the variable's shape, traceable by ``tf.function``.

    If ``fn`` has a parameter named ``losses`` or ``predictions`` (or ``**kwargs``), it also
    receives them by keyword: ``losses`` is ``w_i l_i``, ``(B,)`` (sample weights applied), and
    ``predictions`` the model's outputs for the batch (a tensor, or the model's list/dict of
    them), rows of dropped or zero-weight examples zero like the gradients. Under
    ``tf.distribute`` both are gathered over the replicas with the gradients. So
    ``fn(grads, norms, losses, predictions)`` can weight examples by their loss or confidence.

    To save a model that uses it, register ``fn`` with
    ``keras.saving.register_keras_serializable``.
    """
    if not callable(fn):
        raise TypeError(f"custom(fn) needs a callable, got {fn!r}.")
    wanted = _example_keywords(fn)

    def finalize(partial: Partial, key) -> list:
        values = list(partial.values)
        dtype = "float64" if any(dtype_of(v) == "float64" for v in values) else "float32"
        norms = ops.sqrt(add_n([
            ops.sum(ops.square(ops.reshape(ops.cast(v, dtype), [ops.shape(v)[0], -1])), axis=1)
            for v in values]))
        extras = {name: partial.examples[name] for name in wanted}
        out = fn(values, norms, **extras)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        if len(out) != len(values):
            raise ValueError(f"The custom aggregator {getattr(fn, '__name__', fn)!r} returned "
                             f"{len(out)} tensors for {len(values)} trainable variables; return "
                             "one gradient per variable, aligned with model.trainable_variables.")
        checked = []
        for k, (g, v) in enumerate(zip(out, values, strict=True)):
            g = ops.convert_to_tensor(g)
            if tuple(g.shape) != tuple(v.shape[1:]):
                raise ValueError(f"The custom aggregator {getattr(fn, '__name__', fn)!r} returned "
                                 f"shape {tuple(g.shape)} for variable {k}, expected "
                                 f"{tuple(v.shape[1:])} (the variable's shape).")
            checked.append(ops.cast(g, dtype_of(v)))
        return checked

    def local(result, batch) -> Partial:
        return gathering_local(result, batch, with_examples=bool(wanted))

    return Aggregator("custom", {"fn": fn}, local, finalize, gathers=True)


_EXAMPLE_KEYWORDS = ("losses", "predictions")


def _example_keywords(fn) -> tuple[str, ...]:
    """Which of ``losses``/``predictions`` ``fn`` accepts by name (all with ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the two-argument form
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return _EXAMPLE_KEYWORDS
    return tuple(name for name in _EXAMPLE_KEYWORDS if name in parameters)
