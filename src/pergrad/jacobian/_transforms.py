"""One-shot products: `jvp`, `vjp`, `hvp`, compiled once per f.

These are plain functions (JAX style) rather than factories. Each compiles its computation
with ``tf.function(reduce_retracing=True)`` the first time it meets a given f (and `training`
flag) and caches it, weakly keyed by f, so calling them in a loop with the same f and
same-shaped arguments traces once. Pass the *same* f object every time: a new lambda per
iteration is a new cache entry and a new trace. `trace_counts(f)` reports the traces.

Primals follow JAX's convention with one Keras-friendly exception: a tuple is the tuple of
positional arguments of f; anything else (a tensor, a list, a dict) is f's single argument.
Primals may be `tf.Variable`s (e.g. ``model.trainable_variables``); f is called with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from pergrad.jacobian._call import make_caller
from pergrad.jacobian._compile import Traced, compiled_for
from pergrad.jacobian._modes import ZERO, scalar_objective
from pergrad.jacobian._structure import leaf_paths, to_tensor


def _as_args(primals: Any) -> tuple[tuple, bool]:
    """(positional args, whether primals was the tuple of args)."""
    if isinstance(primals, tuple) and not hasattr(primals, "_fields"):
        return primals, True
    return (primals,), False


def _check_primals(args: tuple, what: str) -> tuple:
    if not args:
        raise ValueError(f"{what}: primals is an empty tuple; pass f's arguments.")
    out = []
    for i, arg in enumerate(args):
        paths = leaf_paths(arg, f"primals[{i}]")
        leaves = [
            to_tensor(leaf, p, what) for leaf, p in zip(tf.nest.flatten(arg), paths, strict=True)
        ]
        out.append(tf.nest.pack_sequence_as(arg, leaves))
    return tuple(out)


def _match(primals: tuple, other: Any, name: str, what: str) -> tuple:
    """Converts tangents/vectors to the primals' structure, dtypes and shapes, or explains."""
    other_args, _ = _as_args(other)
    try:
        tf.nest.assert_same_structure(primals, other_args)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{what}: {name} must have the same nested structure as primals. {err}"
        ) from err
    flat_p = tf.nest.flatten(primals)
    paths = leaf_paths(primals, name)
    out = []
    for p, t, path in zip(flat_p, tf.nest.flatten(other_args), paths, strict=True):
        t = tf.convert_to_tensor(t, dtype=p.dtype) if not isinstance(t, tf.Tensor) else t
        if t.dtype != p.dtype:
            raise TypeError(f"{what}: {path} has dtype {t.dtype.name}, primal has {p.dtype.name}.")
        if not t.shape.is_compatible_with(p.shape):
            raise ValueError(f"{what}: {path} has shape {t.shape}, primal has shape {p.shape}.")
        out.append(t)
    return tf.nest.pack_sequence_as(primals, out)


# ---------------------------------------------------------------------------------------------


def _build_forward(training: bool) -> Callable[[Callable[[], Any]], Traced]:
    def build(f_ref: Callable[[], Any]) -> Traced:
        def forward(args: tuple) -> Any:
            return make_caller(f_ref(), training, "vjp")(*args)

        return Traced(forward, name="forward")

    return build


def _build_jvp(training: bool) -> Callable[[Callable[[], Any]], Traced]:
    def build(f_ref: Callable[[], Any]) -> Traced:
        def run(args: tuple, tangents: tuple) -> tuple[Any, Any]:
            call = make_caller(f_ref(), training, "jvp")
            with tf.autodiff.ForwardAccumulator(
                tf.nest.flatten(args), tf.nest.flatten(tangents)
            ) as acc:
                y = call(*args)
            out = tf.nest.map_structure(lambda t: acc.jvp(t, unconnected_gradients=ZERO), y)
            return y, out

        return Traced(run, name="jvp")

    return build


def _build_vjp(training: bool) -> Callable[[Callable[[], Any]], Traced]:
    def build(f_ref: Callable[[], Any]) -> Traced:
        def run(args: tuple, cotangents: Any) -> tuple:
            call = make_caller(f_ref(), training, "vjp")
            leaves = tf.nest.flatten(args)
            with tf.GradientTape() as tape:
                tape.watch(leaves)
                y = call(*args)
            tf.nest.assert_same_structure(y, cotangents)
            grads = tape.gradient(
                tf.nest.flatten(y),
                leaves,
                output_gradients=tf.nest.flatten(cotangents),
                unconnected_gradients=ZERO,
            )
            return tf.nest.pack_sequence_as(args, grads)

        return Traced(run, name="vjp")

    return build


def _build_hvp(training: bool) -> Callable[[Callable[[], Any]], Traced]:
    def build(f_ref: Callable[[], Any]) -> Traced:
        def run(args: tuple, vectors: tuple) -> tuple:
            call = make_caller(f_ref(), training, "hvp")
            leaves = tf.nest.flatten(args)
            with tf.autodiff.ForwardAccumulator(leaves, tf.nest.flatten(vectors)) as acc:
                with tf.GradientTape() as tape:
                    tape.watch(leaves)
                    y, _ = scalar_objective(call(*args), False, None, "hvp")
                grads = tape.gradient(y, leaves, unconnected_gradients=ZERO)
            hv = [acc.jvp(g, unconnected_gradients=ZERO) for g in grads]
            return tf.nest.pack_sequence_as(args, hv)

        return Traced(run, name="hvp")

    return build


# ---------------------------------------------------------------------------------------------


def jvp(
    f: Callable[..., Any], primals: Any, tangents: Any, *, training: bool = False
) -> tuple[Any, Any]:
    """Forward mode: returns ``(f(x), J(x) t)``, the outputs and the Jacobian-vector product.

    ``J(x) t = d/de f(x + e t) at e = 0``, computed in one forward pass with
    `tf.autodiff.ForwardAccumulator`. Compiled once per f; see the module notes.

    Args:
      f: a Keras model or layer, or a function of TF ops.
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
      tangents: the direction t, structured like primals (same dtypes and shapes).
      training: passed to Keras layers and models.

    Returns:
      (outputs, jvp_out), both nested like f's outputs.
    """
    make_caller(f, training, "jvp")  # validates f and `training` now, not at trace time
    args, _ = _as_args(primals)
    args = _check_primals(args, "jvp")
    tans = _match(args, tangents, "tangents", "jvp")
    return compiled_for(f, "jvp", (bool(training),), _build_jvp(bool(training)))(args, tans)


def vjp(
    f: Callable[..., Any], primals: Any, *, training: bool = False
) -> tuple[Any, Callable[[Any], Any]]:
    """Reverse mode: returns ``(f(x), vjp_fn)`` with ``vjp_fn(u) = u^T J(x)``.

    ``vjp_fn(u)`` is the gradient of ``<u, f(x)>`` with respect to the primals, structured
    like primals (a tuple when primals was a tuple). It is compiled once per f and reused.
    TensorFlow cannot hand a tape from one compiled call to the next, so each ``vjp_fn`` call
    recomputes the forward pass together with the backward pass (one forward + one backward);
    with ``training=True`` and random layers (dropout) that recomputation draws a fresh mask.

    Args:
      f: a Keras model or layer, or a function of TF ops.
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
        `tf.Variable` leaves are allowed.
      training: passed to Keras layers and models.
    """
    make_caller(f, training, "vjp")
    args, was_tuple = _as_args(primals)
    args = _check_primals(args, "vjp")
    flag = bool(training)
    outputs = compiled_for(f, "forward", (flag,), _build_forward(flag))(args)
    backward = compiled_for(f, "vjp", (flag,), _build_vjp(flag))

    def vjp_fn(cotangents: Any) -> Any:
        try:
            tf.nest.assert_same_structure(outputs, cotangents)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"vjp_fn: cotangents must be structured like f's outputs. {err}"
            ) from err
        cts = tf.nest.map_structure(
            lambda y, u: tf.convert_to_tensor(u, dtype=y.dtype), outputs, cotangents
        )
        for y, u in zip(tf.nest.flatten(outputs), tf.nest.flatten(cts), strict=True):
            if not u.shape.is_compatible_with(y.shape):
                raise ValueError(
                    f"vjp_fn: a cotangent has shape {u.shape}, the matching output {y.shape}."
                )
        grads = backward(args, cts)
        return tuple(grads) if was_tuple else grads[0]

    return outputs, vjp_fn


def hvp(f: Callable[..., Any], primals: Any, vectors: Any, *, training: bool = False) -> Any:
    """Hessian-vector product ``H(x) v`` of a scalar f, forward-over-reverse.

    ``H(x) v = d/de grad f(x + e v) at e = 0``: the forward-mode derivative of the reverse-mode
    gradient along v, one forward and one backward pass (plus tangents), never forming H.

    Args:
      f: a function returning a scalar (for example a loss).
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
        `tf.Variable` leaves are allowed: ``hvp(loss_fn, model.trainable_variables, v)`` with
        ``loss_fn(weights)`` using the model gives the Hessian of the loss in its weights.
      vectors: v, structured like primals.
      training: passed to Keras layers and models.

    Returns:
      H v, structured like primals (a tuple when primals was a tuple).
    """
    make_caller(f, training, "hvp")
    args, was_tuple = _as_args(primals)
    args = _check_primals(args, "hvp")
    vecs = _match(args, vectors, "vectors", "hvp")
    flag = bool(training)
    out = compiled_for(f, "hvp", (flag,), _build_hvp(flag))(args, vecs)
    return tuple(out) if was_tuple else out[0]
