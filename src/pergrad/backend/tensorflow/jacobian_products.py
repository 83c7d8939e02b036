"""`pergrad.jacobian.jvp`, `vjp` and `hvp` on TensorFlow: each compiled as one
``tf.function(reduce_retracing=True)`` per f (and `training` flag and primal layout), cached by
`pergrad.jacobian._cache.compiled_for`.

Primals may be Keras variables or `tf.Variable`s: the variables are captured by the compiled
function rather than passed as arguments (see `_Layout`). TensorFlow cannot hand a tape from
one compiled call to the next, so ``vjp_fn`` recomputes the forward pass with the backward one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from pergrad._compat import backing_tf_variable, is_keras_variable
from pergrad.backend.tensorflow.jacobian_compile import Traced
from pergrad.jacobian._cache import compiled_for
from pergrad.jacobian._call import make_caller, primal_args
from pergrad.jacobian._structure import leaf_paths, single_output, to_tensor


def _as_tf_variable(leaf: Any) -> tf.Variable | None:
    """The tf.Variable behind a leaf (Keras 3 variables wrap one), or None for data."""
    if isinstance(leaf, tf.Variable):
        return leaf
    if is_keras_variable(leaf):  # a layer's variable is no keras.Variable on Keras 3.5
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


def jvp_product(f: Callable[..., Any], primals: Any, tangents: Any, *,
                training: bool) -> tuple[Any, Any]:
    """``(f(x), J(x) t)`` by ``tf.autodiff.ForwardAccumulator`` (see `pergrad.jacobian.jvp`)."""
    args, _ = primal_args(primals)
    prim = _Primals(args, "jvp")
    tans = _match(prim, tangents, "tangents", "jvp")
    return _compiled(f, "jvp", training, prim, _build_jvp)(prim.tensors, tans)


def vjp_product(f: Callable[..., Any], primals: Any, *,
                training: bool) -> tuple[Any, Callable[[Any], Any]]:
    """``(f(x), vjp_fn)``; each ``vjp_fn`` call runs the forward pass again with the backward
    one (see `pergrad.jacobian.vjp`)."""
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


def hvp_product(f: Callable[..., Any], primals: Any, vectors: Any, *, training: bool) -> Any:
    """``H(x) v``, forward-over-reverse (see `pergrad.jacobian.hvp`)."""
    args, was_tuple = primal_args(primals)
    prim = _Primals(args, "hvp")
    vecs = _match(prim, vectors, "vectors", "hvp")
    out = prim.layout.pack(_compiled(f, "hvp", training, prim, _build_hvp)(prim.tensors, vecs))
    return out if was_tuple else out[0]
