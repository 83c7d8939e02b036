"""One-shot products: `jvp`, `vjp`, `hvp`, compiled once per f.

These are plain functions (JAX style) rather than factories. Each compiles its computation
with ``tf.function(reduce_retracing=True)`` on TensorFlow (JAX and PyTorch go through
`_functional`) the first time it meets a given f (and `training` flag) and caches it, weakly keyed by f, so calling them in a loop with the same f and
same-shaped arguments traces once. Pass the *same* f object every time: a new lambda per
iteration is a new cache entry and a new trace. `trace_counts(f)` reports the traces.

Primals follow JAX's convention with one Keras-friendly exception: a tuple is the tuple of
positional arguments of f; anything else (a tensor, a list, a dict) is f's single argument.
Primals may be Keras variables or `tf.Variable`s (e.g. ``model.trainable_variables``); f is
called with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from pergrad._compat import backing_tf_variable
from pergrad.backend import is_tensorflow, require_supported
from pergrad.backend.lazy import tensorflow as tf
from pergrad.jacobian._call import make_caller, primal_args
from pergrad.jacobian._compile import Traced, compiled_for
from pergrad.jacobian._structure import leaf_paths, single_output, to_tensor


def _as_tf_variable(leaf: Any) -> tf.Variable | None:
    """The tf.Variable behind a leaf (Keras 3 variables wrap one), or None for data."""
    if isinstance(leaf, tf.Variable):
        return leaf
    if isinstance(leaf, keras.Variable):
        return backing_tf_variable(leaf)
    return None


class _Layout:
    """Where the variables sit among the primal leaves, and the primals' nesting.

    Variables (for a Keras 3 variable, the tf.Variable inside it) are captured by the
    compiled function rather than passed as arguments: passing a Keras variable would convert
    it to a tensor of its value, cut off from f's use of the variable, and the derivative
    would be zero. The layout, with the variables' identities, is part of the cache key.
    """

    def __init__(self, structure: Any, slots: list[tf.Variable | None]) -> None:
        self._structure = structure
        self._slots = slots
        self.key = (repr(structure), tuple(None if v is None else v.ref() for v in slots))

    def merge(self, tensors: list) -> list:
        """All leaves in order: the given tensors where data, the variables elsewhere."""
        it = iter(tensors)
        return [next(it) if v is None else v for v in self._slots]

    def pack(self, flat: list) -> tuple:
        return tf.nest.pack_sequence_as(self._structure, flat)


class _Primals:
    """One call's primals: tensor leaves (compiled-function arguments) and their layout."""

    def __init__(self, args: tuple, what: str) -> None:
        if not args:
            raise ValueError(f"{what}: primals is an empty tuple; pass f's arguments.")
        leaves = tf.nest.flatten(args)
        self.paths = leaf_paths(args, "primals")
        self.tensors: list[tf.Tensor] = []
        slots: list[tf.Variable | None] = []
        for leaf, path in zip(leaves, self.paths, strict=True):
            var = _as_tf_variable(leaf)
            if var is not None:
                if not var.dtype.is_floating:
                    to_tensor(tf.zeros((), var.dtype), path, what)  # raises the dtype error
                slots.append(var)
            else:
                self.tensors.append(to_tensor(leaf, path, what))
                slots.append(None)
        self.layout = _Layout(tf.nest.pack_sequence_as(args, list(range(len(leaves)))), slots)
        self.flat_primals = self.layout.merge(self.tensors)


def _match(primals: _Primals, other: Any, name: str, what: str) -> list[tf.Tensor]:
    """Flat tangents/vectors checked against the primals' structure, dtypes and shapes."""
    other_args, _ = primal_args(other)
    try:
        tf.nest.assert_same_structure(
            primals.layout.pack(list(range(len(primals.flat_primals)))), other_args
        )
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{what}: {name} must have the same nested structure as primals. {err}"
        ) from err
    out = []
    paths = [p.replace("primals", name, 1) for p in primals.paths]
    for p, t, path in zip(primals.flat_primals, tf.nest.flatten(other_args), paths, strict=True):
        t = tf.convert_to_tensor(t, dtype=p.dtype) if not isinstance(t, tf.Tensor) else t
        if t.dtype != p.dtype:
            raise TypeError(f"{what}: {path} has dtype {t.dtype.name}, primal has {p.dtype.name}.")
        if not t.shape.is_compatible_with(p.shape):
            raise ValueError(f"{what}: {path} has shape {t.shape}, primal has shape {p.shape}.")
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------


def _build_forward(training: bool, primals: _Layout) -> Callable[[Callable[[], Any]], Traced]:
    def build(f_ref: Callable[[], Any]) -> Traced:
        def forward(tensors: list) -> Any:
            return make_caller(f_ref(), training, "vjp")(*primals.pack(primals.merge(tensors)))

        return Traced(forward, name="forward")

    return build


def _build_jvp(training: bool, primals: _Layout) -> Callable[[Callable[[], Any]], Traced]:
    def build(f_ref: Callable[[], Any]) -> Traced:
        def run(tensors: list, tangents: list) -> tuple[Any, Any]:
            call = make_caller(f_ref(), training, "jvp")
            leaves = primals.merge(tensors)
            with tf.autodiff.ForwardAccumulator(leaves, tangents) as acc:
                y = call(*primals.pack(leaves))
            out = tf.nest.map_structure(lambda t: acc.jvp(t, unconnected_gradients=tf.UnconnectedGradients.ZERO), y)
            return y, out

        return Traced(run, name="jvp")

    return build


def _build_vjp(training: bool, primals: _Layout) -> Callable[[Callable[[], Any]], Traced]:
    def build(f_ref: Callable[[], Any]) -> Traced:
        def run(tensors: list, cotangents: Any) -> list:
            call = make_caller(f_ref(), training, "vjp")
            leaves = primals.merge(tensors)
            with tf.GradientTape() as tape:
                tape.watch(leaves)
                y = call(*primals.pack(leaves))
            tf.nest.assert_same_structure(y, cotangents)
            return tape.gradient(
                tf.nest.flatten(y),
                leaves,
                output_gradients=tf.nest.flatten(cotangents),
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )

        return Traced(run, name="vjp")

    return build


def _build_hvp(training: bool, primals: _Layout) -> Callable[[Callable[[], Any]], Traced]:
    def build(f_ref: Callable[[], Any]) -> Traced:
        def run(tensors: list, vectors: list) -> list:
            call = make_caller(f_ref(), training, "hvp")
            leaves = primals.merge(tensors)
            with tf.autodiff.ForwardAccumulator(leaves, vectors) as acc:
                with tf.GradientTape() as tape:
                    tape.watch(leaves)
                    y = single_output(call(*primals.pack(leaves)), False, "hvp")
                grads = tape.gradient(y, leaves, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [acc.jvp(g, unconnected_gradients=tf.UnconnectedGradients.ZERO) for g in grads]

        return Traced(run, name="hvp")

    return build


def _compiled(f: Any, kind: str, training: bool, primals: _Primals, builder: Callable) -> Traced:
    flag = bool(training)
    layout = primals.layout
    return compiled_for(f, kind, (flag, layout.key), builder(flag, layout))


# ---------------------------------------------------------------------------------------------


def jvp(
    f: Callable[..., Any], primals: Any, tangents: Any, *, training: bool = False
) -> tuple[Any, Any]:
    """Forward mode: returns ``(f(x), J(x) t)``, the outputs and the Jacobian-vector product.

    ``J(x) t = d/de f(x + e t) at e = 0``, computed in one forward pass with
    `tf.autodiff.ForwardAccumulator` (``jvp`` on JAX and PyTorch). Compiled once per f; see
    the module notes.

    Args:
      f: a Keras model or layer, or a function of the backend's ops.
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
      tangents: the direction t, structured like primals (same dtypes and shapes).
      training: passed to Keras layers and models.

    Returns:
      (outputs, jvp_out), both nested like f's outputs.
    """
    require_supported("pergrad.jacobian.jvp")
    make_caller(f, training, "jvp")  # validates f and `training` now, not at trace time
    if not is_tensorflow():
        from pergrad.jacobian import _functional

        return _functional.jvp(f, primals, tangents, training=training)
    args, _ = primal_args(primals)
    prim = _Primals(args, "jvp")
    tans = _match(prim, tangents, "tangents", "jvp")
    return _compiled(f, "jvp", training, prim, _build_jvp)(prim.tensors, tans)


def vjp(
    f: Callable[..., Any], primals: Any, *, training: bool = False
) -> tuple[Any, Callable[[Any], Any]]:
    """Reverse mode: returns ``(f(x), vjp_fn)`` with ``vjp_fn(u) = u^T J(x)``.

    ``vjp_fn(u)`` is the gradient of ``<u, f(x)>`` with respect to the primals, structured
    like primals (a tuple when primals was a tuple). It is compiled once per f and reused.
    TensorFlow cannot hand a tape from one compiled call to the next, so there each ``vjp_fn``
    call recomputes the forward pass together with the backward pass (one forward + one
    backward); with ``training=True`` and random layers (dropout) that recomputation draws a
    fresh mask. On JAX and PyTorch ``vjp_fn`` holds the pullback and runs only the backward
    pass, with the weights of the call that made it.

    Args:
      f: a Keras model or layer, or a function of the backend's ops.
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
        Variable leaves (Keras variables, `tf.Variable`s) are allowed.
      training: passed to Keras layers and models.
    """
    require_supported("pergrad.jacobian.vjp")
    make_caller(f, training, "vjp")
    if not is_tensorflow():
        from pergrad.jacobian import _functional

        return _functional.vjp(f, primals, training=training)
    args, was_tuple = primal_args(primals)
    prim = _Primals(args, "vjp")
    outputs = _compiled(f, "forward", training, prim, _build_forward)(prim.tensors)
    backward = _compiled(f, "vjp", training, prim, _build_vjp)

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
        grads = prim.layout.pack(backward(prim.tensors, cts))
        return grads if was_tuple else grads[0]

    return outputs, vjp_fn


def hvp(f: Callable[..., Any], primals: Any, vectors: Any, *, training: bool = False) -> Any:
    """Hessian-vector product ``H(x) v`` of a scalar f, forward-over-reverse.

    ``H(x) v = d/de grad f(x + e v) at e = 0``: the forward-mode derivative of the reverse-mode
    gradient along v, one forward and one backward pass (plus tangents), never forming H.

    Args:
      f: a function returning a scalar (for example a loss).
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
        Variable leaves are allowed: ``hvp(loss_fn, model.trainable_variables, v)`` with
        ``loss_fn(weights)`` using the model gives the Hessian of the loss in its weights.
      vectors: v, structured like primals.
      training: passed to Keras layers and models.

    Returns:
      H v, structured like primals (a tuple when primals was a tuple).
    """
    require_supported("pergrad.jacobian.hvp")
    make_caller(f, training, "hvp")
    if not is_tensorflow():
        from pergrad.jacobian import _functional

        return _functional.hvp(f, primals, vectors, training=training)
    args, was_tuple = primal_args(primals)
    prim = _Primals(args, "hvp")
    vecs = _match(prim, vectors, "vectors", "hvp")
    out = prim.layout.pack(_compiled(f, "hvp", training, prim, _build_hvp)(prim.tensors, vecs))
    return out if was_tuple else out[0]
