"""The JAX engine: one ``jax.vjp`` to zero perturbations added at the tapped pre-activations,
then the same rules as every backend; and the whole-model baselines ``loop``, ``vmap`` and
``jacobian``, all returning a :class:`PerExampleResult`.

Everything here runs inside the ``jax.jit`` that :class:`pergrad.PerExample` compiles, under a
``keras.StatelessScope`` mapping every model variable to a traced value (:func:`stateless`).

**Taps.** For the summed loss ``L(theta, x)`` and a tapped pre-activation ``z_k``, define
``L_k(e) = L`` with ``z_k`` replaced by ``z_k + e_k``; then ``dL/dz_k = dL/de_k`` at ``e = 0``.
The forward pass runs twice while tracing: once to learn the taps' shapes (dead code that XLA
removes), once inside ``jax.vjp`` with the zeros ``e`` as its input, so a single backward pass
returns the gradient at every tap. The layers' recorded inputs leave the differentiated function
as auxiliary outputs, so the rules see plain traced arrays.

**Generic rule** (:mod:`pergrad.engine.generic_rule` with :data:`DIFFERENTIATION`). A layer
without a rule gets ``g_i = d/dW <f(x_i; W), D_i>`` by ``jax.vmap`` over examples of
``jax.grad`` through ``layer.stateless_call``: XLA vectorizes it, so the TensorFlow hazards (pfor's missing converters, the segfault) do not arise.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import keras

from pergrad.engine.assemble import (
    add_rows,
    assembled_result,
    forms_by_variable,
    in_groups,
    materialized_result,
)
from pergrad.engine.functional import assign_written, batch_losses, example_loss, stateless
from pergrad.engine.generic_rule import Differentiation, generic_forms
from pergrad.engine.intercept import record_calls
from pergrad.engine.losses import weighted_losses
from pergrad.engine.masks import masks_of, with_masks
from pergrad.engine.plan import Plan
from pergrad.engine.result import PerExampleResult
from pergrad.rules import LayerCall


# -- variables as traced values -------------------------------------------------------------------
def current_values(variables: list) -> list:
    """The values ``variables`` read as now: the traced ones inside :func:`stateless`."""
    return [v.value for v in variables]


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, jax.core.Tracer)) or (
        hasattr(leaf, "shape") and hasattr(leaf, "dtype") and not isinstance(leaf, type))


def _floating_leaves(structure) -> list:
    return [t for t in keras.tree.flatten(structure)
            if _is_array(t) and jnp.issubdtype(t.dtype, jnp.floating)]


# -- the forward pass, recorded and tapped ----------------------------------------------------------
class _Pass:
    """One recorded forward pass: the calls in the order they ran, the losses, the predictions
    and the model's variable writes (seed states), all as traced values of its own trace."""

    def __init__(self, model, plan: Plan, loss_fn, x, y, sample_weight, training: bool,
                 values: list, taps: list | None):
        variables = list(model.variables)
        self.order: list[LayerCall] = []
        position = iter(range(1 << 30))

        def tap(tensors):
            if taps is None:
                return tensors

            def add(t):
                if not (_is_array(t) and jnp.issubdtype(t.dtype, jnp.floating)):
                    return t
                return t + taps[next(position)].astype(t.dtype)
            return keras.tree.map_structure(add, tensors)

        with stateless(variables, values) as scope:
            with record_calls(plan, tap=tap, order=self.order):
                self.predictions = model(x, training=training)
            self.losses = weighted_losses(loss_fn(y, self.predictions), sample_weight)
            self.writes = scope.written(variables)
            self.call_losses = list(scope.scope.losses)  # add_loss, activity regularizers

    def tapped(self) -> list:
        return [t for record in self.order for t in _floating_leaves(record.tapped)]


def _record_parts(record: LayerCall) -> tuple[list, Any, list]:
    """The array leaves of a call's arguments (and of what it saved), their structure, and
    which leaves are arrays."""
    structure = (record.args, record.kwargs, record.saved)
    leaves = keras.tree.flatten(structure)
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    return [leaves[i] for i in arrays], (structure, leaves), arrays


def _rebuild(record: LayerCall, parts: tuple, arrays: list, values: list) -> LayerCall:
    structure, leaves = parts
    leaves = list(leaves)
    for i, value in zip(arrays, values, strict=True):
        leaves[i] = value
    args, kwargs, saved = keras.tree.pack_sequence_as(structure, leaves)
    return LayerCall(record.layer, tuple(args), dict(kwargs), None, saved)


def run_auto(model, plan: Plan, loss_fn, x, y, sample_weight, training: bool,
             warned: set) -> PerExampleResult:
    """Record, one ``jax.vjp`` of the summed loss to every tap, then rules."""
    variables = list(model.variables)
    values = current_values(variables)
    residual_ids = {id(v) for v in plan.residual}
    residual_index = [k for k, v in enumerate(variables) if id(v) in residual_ids]

    # Shapes only: XLA removes this pass, and its variable writes are dropped with its scope.
    probe = _Pass(model, plan, loss_fn, x, y, sample_weight, training, values, None)
    for loss in probe.call_losses:  # to the caller's scope, as the forward pass would add them
        model.add_loss(loss)
    zeros = [jnp.zeros(t.shape, t.dtype) for t in probe.tapped()]
    layouts = [_record_parts(r)[1:] for r in probe.order]

    def forward(taps, residual):
        inner = list(values)
        for k, value in zip(residual_index, residual, strict=True):
            inner[k] = value
        recorded = _Pass(model, plan, loss_fn, x, y, sample_weight, training, inner, taps)
        inputs = [_record_parts(r)[0] for r in recorded.order]
        aux = (recorded.predictions, masks_of(recorded.predictions), recorded.writes, inputs)
        return recorded.losses, aux

    residual_values = [values[k] for k in residual_index]
    losses, pullback, (predictions, masks, writes, inputs) = jax.vjp(
        forward, zeros, residual_values, has_aux=True)
    predictions = with_masks(predictions, masks)
    tap_grads, _ = pullback(jnp.ones_like(losses))
    if residual_index:
        eye = jnp.eye(losses.shape[0], dtype=losses.dtype)
        _, residual_grads = jax.vmap(pullback)(eye)
    assign_written(variables, writes)

    counts = [len(_floating_leaves(record.tapped)) for record in probe.order]
    calls = [_rebuild(record, parts, arrays, recorded_inputs)
             for record, (parts, arrays), recorded_inputs in zip(probe.order, layouts, inputs,
                                                                 strict=True)]
    with stateless(variables, values):
        by_variable = forms_by_variable(
            plan, zip(calls, in_groups(tap_grads, counts), strict=True),
            lambda call, grads: generic_forms(DIFFERENTIATION, call.layer, call, grads, training,
                                              warned))
    if residual_index:
        add_rows(by_variable, [variables[k] for k in residual_index], residual_grads)
    return assembled_result(model, by_variable, losses, predictions)


# -- the generic rule ---------------------------------------------------------------------------
#: What :mod:`pergrad.engine.generic_rule` differentiates with on JAX: every layer vectorizes
#: under ``jax.vmap`` inside the trace, so there is no per-example loop to fall back to.
DIFFERENTIATION = Differentiation(
    grad=jax.grad, vmap=jax.vmap, jacrev=jax.jacrev, values=current_values,
    is_array=_is_array, is_floating=lambda t: jnp.issubdtype(t.dtype, jnp.floating),
    cast=lambda t, like: t.astype(like.dtype), total=jnp.sum,
    row_sums=lambda t: jnp.sum(jnp.reshape(t, (t.shape[0], -1)), axis=1), stack=jnp.stack)


# -- whole-model baselines ------------------------------------------------------------------------
def _unit_weights(x, sample_weight):
    if sample_weight is not None:
        return sample_weight
    return jnp.ones([keras.tree.flatten(x)[0].shape[0]], keras.config.floatx())


def _per_example_map(mapper, model, loss_fn, x, y, sample_weight, training: bool):
    values = current_values(model.trainable_variables)
    frozen = current_values(model.non_trainable_variables)
    loss = example_loss(model, loss_fn, training, frozen)
    value_and_grad = jax.value_and_grad(loss)
    w = _unit_weights(x, sample_weight)

    def one(elems):
        xi, yi, wi = elems
        return value_and_grad(values, xi, yi, wi)

    losses, grads = mapper(one, (x, y, w))
    return materialized_result(model, grads, losses, model(x, training=training))


def run_vmap(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """``jax.vmap(jax.grad(...))`` of one example's loss through ``model.stateless_call``."""
    return _per_example_map(lambda f, e: jax.vmap(f)(e), model, loss_fn, x, y, sample_weight,
                            training)


def run_loop(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """One gradient per example in a sequential ``lax.map``: the reference the others match."""
    return _per_example_map(jax.lax.map, model, loss_fn, x, y, sample_weight, training)


def run_jacobian(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """``jax.jacrev`` of the per-example losses with respect to every trainable variable."""
    losses_of = batch_losses(model, loss_fn, x, y, sample_weight, training,
                             current_values(model.non_trainable_variables))

    def with_aux(values):
        losses, predictions = losses_of(values)
        return losses, (losses, predictions, masks_of(predictions))

    values = current_values(model.trainable_variables)
    grads, (losses, predictions, masks) = jax.jacrev(with_aux, has_aux=True)(values)
    return materialized_result(model, grads, losses, with_masks(predictions, masks))


RUNNERS: dict[str, Any] = {"jacobian": run_jacobian, "vmap": run_vmap, "loop": run_loop}


# -- the batch gradient and compilation -----------------------------------------------------------
def batch_gradient(model, loss_fn, x, y, sample_weight, training: bool) -> list:
    """``d/dtheta sum_i l_i`` by ``jax.grad`` of the whole model: what :meth:`PerExample.check`
    compares ``sum_i g_i`` with."""
    losses_of = batch_losses(model, loss_fn, x, y, sample_weight, training,
                             current_values(model.non_trainable_variables))
    return jax.grad(lambda values: jnp.sum(losses_of(values)[0]))(
        current_values(model.trainable_variables))


def compile_function(model, body, on_trace, jit_compile: bool = False) -> Any:
    """``body(*args)`` as one ``jax.jit`` over the model's variable values and ``args``
    (always compiled by XLA: ``jit_compile`` changes nothing).

    The compiled function reads the variables' values at every call (so it sees training
    updates without retracing) and writes back what the body assigned (seed states)."""

    def traced(values, *args):
        on_trace()
        variables = list(model.variables)
        with stateless(variables, values) as scope:
            out = body(*args)
            writes = scope.written(variables)
        return out, writes

    jitted = jax.jit(traced)

    def call(*args):
        variables = list(model.variables)
        out, writes = jitted([v.value for v in variables], *args)
        assign_written(variables, writes)
        return out

    return call
