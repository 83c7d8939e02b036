"""The generic rule of the functional engines (JAX and PyTorch), written once over the
differentiation each backend provides (:class:`Differentiation`); TensorFlow's, built on
``pfor``, is :mod:`pergrad.backend.tensorflow.generic`.

A layer without a rule gets, for every trainable variable ``W`` of the layer,

    ``g_i = d/dW <f(x_i; W), D_i>``

where ``f`` is the layer's ``stateless_call``, ``x_i`` example ``i``'s inputs to the call and
``D_i`` the gradient of the summed loss at the layer's outputs (the taps) for that example: one
VJP of the layer per example, vectorized over the batch (``jax.vmap`` / ``torch.func.vmap`` of
``grad``). Where the backend's vmap cannot run the layer (PyTorch: an op without a batching
rule, a data-dependent branch) a per-example loop of the same function computes the same
numbers, with one warning per layer.

A layer that draws random numbers in training mode (dropout) would draw other numbers for one
example alone. It is replayed on the whole batch with the state its call ran with
(``call.saved``, and on PyTorch the generators' state) and differentiated per example: the
Jacobian (``jacrev``) of ``s_i(W) = <f(x; W)_i, D_i>``, exact for the masks the forward pass
drew.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras

from pergrad._compat import autocast_scope
from pergrad.engine.functional import one_example_call
from pergrad.engine.plan import draws_random
from pergrad.rules import LayerCall
from pergrad.rules.forms import Materialized


@dataclass(frozen=True)
class Differentiation:
    """One functional backend's transforms and the few array operations the rule needs.

    ``grad(f)(x)`` / ``vmap(f)(*args)`` / ``jacrev(f)(x)`` are the backend's own transforms;
    ``values(variables)`` the values the variables read as now (traced inside a JAX trace,
    detached on PyTorch); ``cast(t, like)`` is ``t`` in ``like``'s dtype; ``total(t)`` the sum
    of every element; ``row_sums(t)`` the sum over every axis but the first; ``stack`` stacks a
    list on a new first axis; ``vectorizing()`` the scope vmap runs in; ``replaying(call)`` the
    scope a random layer is replayed in; ``loops_where_vmap_fails`` whether a vmap error falls
    back to the per-example loop (on JAX every layer vectorizes, and an error is the user's)."""

    grad: Callable[[Callable], Callable]
    vmap: Callable[[Callable], Callable]
    jacrev: Callable[[Callable], Callable]
    values: Callable[[list], list]
    is_array: Callable[[Any], bool]
    is_floating: Callable[[Any], bool]
    cast: Callable[[Any, Any], Any]
    total: Callable[[Any], Any]
    row_sums: Callable[[Any], Any]
    stack: Callable[[list], Any]
    vectorizing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    replaying: Callable[[LayerCall], contextlib.AbstractContextManager] = \
        lambda call: contextlib.nullcontext()
    loops_where_vmap_fails: bool = False

    def floating_leaves(self, structure: Any) -> list:
        """The floating-point arrays of ``structure``, flattened."""
        return [t for t in keras.tree.flatten(structure)
                if self.is_array(t) and self.is_floating(t)]


def generic_forms(diff: Differentiation, layer: Any, call: LayerCall, grads: list,
                  training: bool, warned: set) -> list[Materialized]:
    """``g_i = d/dW <f(x_i; W), D_i>`` for every trainable variable ``W`` of ``layer``, one
    :class:`Materialized` form each; ``grads`` holds ``D`` for each floating output of the
    call, ``(B, ...)``. ``warned`` holds the ids of the layers already warned about."""
    if training and draws_random(layer):
        return _replayed_forms(diff, layer, call, grads)
    variables = layer.trainable_variables
    values = diff.values(variables)
    frozen = diff.values(layer.non_trainable_variables)
    leaves = keras.tree.flatten((call.args, call.kwargs))
    batch = grads[0].shape[0]
    batched = [i for i, leaf in enumerate(leaves)
               if diff.is_array(leaf) and len(leaf.shape) > 0 and leaf.shape[0] == batch]

    def one_example(example_leaves, example_grads):
        args, kwargs = one_example_call(call, leaves, batched, example_leaves)

        def inner(vals):
            with autocast_scope(layer):
                out, _ = layer.stateless_call(vals, frozen, *args, **kwargs)
            return sum(diff.total(o * diff.cast(g[None], o))
                       for o, g in zip(diff.floating_leaves(out), example_grads, strict=True))

        return diff.grad(inner)(values)

    example_leaves = [leaves[i] for i in batched]
    try:
        with diff.vectorizing():
            per_example = diff.vmap(one_example)(example_leaves, list(grads))
    except Exception as error:  # noqa: BLE001 - vmap raises several types for what it cannot batch
        if not diff.loops_where_vmap_fails:
            raise
        warn_of_the_loop(layer, error, warned)
        rows = [one_example([t[i] for t in example_leaves], [g[i] for g in grads])
                for i in range(batch)]
        per_example = [diff.stack(list(column)) for column in zip(*rows, strict=True)]
    return [Materialized(v, diff.cast(g, value))
            for v, value, g in zip(variables, values, per_example, strict=True)]


def warn_of_the_loop(layer: Any, error: Exception, warned: set) -> None:
    """One ``RuntimeWarning`` per layer (every backend's generic rule): ``layer`` could not be
    vectorized (``error``) and runs as a per-example loop. ``warned`` holds the layers' ids."""
    if id(layer) in warned:
        return
    warned.add(id(layer))
    warnings.warn(
        f"pergrad: layer {layer.name!r} ({type(layer).__name__}) could not be vectorized "
        f"({type(error).__name__}: {' '.join(str(error).split())[:240]}); its per-example "
        "gradients are computed with a per-example loop, which is slower but exact.",
        RuntimeWarning, stacklevel=3)


def _replayed_forms(diff: Differentiation, layer: Any, call: LayerCall,
                    grads: list) -> list[Materialized]:
    variables = layer.trainable_variables
    frozen = call.saved  # the layer's non-trainable values when the call ran (seed states)

    def per_example(values):
        with autocast_scope(layer):
            out, _ = layer.stateless_call(values, frozen, *call.args, **call.kwargs)
        return sum(diff.row_sums(o * diff.cast(g, o))
                   for o, g in zip(diff.floating_leaves(out), grads, strict=True))

    values = diff.values(variables)
    with diff.replaying(call):
        jacobians = diff.jacrev(per_example)(values)
    return [Materialized(v, diff.cast(j, value))
            for v, value, j in zip(variables, values, jacobians, strict=True)]
