"""The PyTorch engine: one ``torch.autograd.grad`` to zero perturbations added at the tapped
pre-activations, then the same rules as every backend; and the whole-model baselines ``loop``,
``vmap`` and ``jacobian``, all returning a :class:`PerExampleResult`.

Keras's torch backend runs eagerly and records every operation on torch's autograd tape, as an
ordinary PyTorch module does; nothing here is compiled (``torch.compile`` did not win, see
docs/backends.md).

**Taps.** For the summed loss ``L`` and a tapped pre-activation ``z_k``, the forward pass adds a
zero tensor ``e_k`` that requires grad (a leaf of the autograd graph) to ``z_k`` as the layer's
call is recorded; ``dL/dz_k = dL/de_k`` at ``e = 0``, so one ``torch.autograd.grad`` of ``L``
with respect to every ``e_k`` returns the gradient at every tap in one backward pass. Autograd
computes only what reaches the taps: no weight gradient is formed. The recorded layer inputs are
detached before the rules see them.

**Generic rule** (:mod:`pergrad.engine.generic_rule` with :data:`DIFFERENTIATION`). A layer
without a rule gets ``g_i = d/dW <f(x_i; W), D_i>`` by ``torch.func.vmap`` over examples of ``torch.func.grad`` through ``layer.stateless_call`` (in
`pergrad._compat.torch_convolutions_in_vmap`, so that Keras's convolutions run under vmap).
Where vmap cannot run the layer (an op without a batching rule that raises, a data-dependent
branch), a per-example loop of the same function computes the same numbers, with one warning
naming the layer. A layer that draws random numbers in training mode (dropout inside an LSTM)
is replayed on the whole batch with the seed state it ran with (the same mask) and differentiated per
example by ``torch.func.jacrev``.
"""

from __future__ import annotations

from typing import Any

import keras
import torch
from keras import ops

from pergrad._compat import torch_convolutions_in_vmap
from pergrad.backend.torch.random import replaying_generators
from pergrad.engine.assemble import (
    add_rows,
    assembled_result,
    forms_by_variable,
    in_groups,
    materialized_result,
)
from pergrad.engine.functional import batch_losses, example_loss
from pergrad.engine.generic_rule import Differentiation, generic_forms
from pergrad.engine.intercept import record_calls
from pergrad.engine.losses import weighted_losses
from pergrad.engine.masks import map_keeping_masks, masks_of, with_masks
from pergrad.engine.plan import Plan
from pergrad.engine.result import PerExampleResult
from pergrad.rules import LayerCall


def _is_tensor(leaf) -> bool:
    return isinstance(leaf, torch.Tensor)


def _is_float_tensor(leaf) -> bool:
    return _is_tensor(leaf) and leaf.is_floating_point()


def _floating_leaves(structure) -> list:
    return [t for t in keras.tree.flatten(structure) if _is_float_tensor(t)]


def _detached(structure):
    return keras.tree.map_structure(lambda t: t.detach() if _is_tensor(t) else t, structure)


def _detached_predictions(predictions):
    """The predictions outside autograd, each with its Keras mask (the report's loss reads it)."""
    return map_keeping_masks(lambda t: t.detach() if _is_tensor(t) else t, predictions,
                             on_mask=lambda m: m.detach() if _is_tensor(m) else m)


def _values(variables: list) -> list:
    """The variables' values as plain tensors, outside autograd."""
    return [v.value.detach() for v in variables]


def _zero_if_none(grads, like: list) -> list:
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, like, strict=True)]


# -- the forward pass, recorded and tapped, and one backward pass ----------------------------------
def run_auto(model, plan: Plan, loss_fn, x, y, sample_weight, training: bool,
             warned: set) -> PerExampleResult:
    """Record, one ``torch.autograd.grad`` of the summed loss to every tap, then rules."""
    taps: list = []

    def tap(tensors):
        def add(t):
            if not _is_float_tensor(t):
                return t
            zero = torch.zeros_like(t.detach(), requires_grad=True)
            taps.append(zero)
            return t + zero
        return keras.tree.map_structure(add, tensors)

    order: list[LayerCall] = []
    with torch.enable_grad():
        with record_calls(plan, tap=tap, order=order):
            predictions = model(x, training=training)
        losses = weighted_losses(loss_fn(y, predictions), sample_weight)
        residual = [v.value for v in plan.residual]
        tap_grads = _zero_if_none(torch.autograd.grad(
            torch.sum(losses), taps, allow_unused=True, retain_graph=bool(residual)), taps) \
            if taps else []
        residual_grads = _per_example_jacobian(losses, residual) if residual else []

    counts = [len(_floating_leaves(record.tapped)) for record in order]
    calls = [LayerCall(record.layer, _detached(record.args), _detached(record.kwargs), None,
                       record.saved, record.generators) for record in order]
    by_variable = forms_by_variable(
        plan, zip(calls, in_groups(tap_grads, counts), strict=True),
        lambda call, grads: generic_forms(DIFFERENTIATION, call.layer, call, grads, training,
                                          warned))
    add_rows(by_variable, plan.residual, residual_grads)
    return assembled_result(model, by_variable, losses.detach(), _detached_predictions(predictions))


def _per_example_jacobian(losses, inputs: list) -> list:
    """``d l_i / d input`` for every example, ``(B, *input.shape)``: one backward pass per
    example, vectorized by autograd (``is_grads_batched``), a loop where that cannot run."""
    eye = torch.eye(losses.shape[0], dtype=losses.dtype, device=losses.device)
    try:
        grads = torch.autograd.grad(losses, inputs, grad_outputs=eye, is_grads_batched=True,
                                    allow_unused=True, retain_graph=True)
        return [torch.zeros((len(eye), *t.shape), dtype=t.dtype, device=t.device)
                if g is None else g
                for g, t in zip(grads, inputs, strict=True)]
    except RuntimeError:
        rows = [_zero_if_none(torch.autograd.grad(losses[i], inputs, allow_unused=True,
                                                  retain_graph=True), inputs)
                for i in range(len(eye))]
        return [torch.stack(list(column)) for column in zip(*rows, strict=True)]


# -- the generic rule ---------------------------------------------------------------------------
#: What :mod:`pergrad.engine.generic_rule` differentiates with on PyTorch: ``torch.func``'s
#: transforms (vmap in :func:`torch_convolutions_in_vmap`, a per-example loop where vmap cannot
#: run a layer), and a random layer replayed with torch's generators as they were when it ran
#: (``call.generators``: Keras's unseeded dropout draws from them), so with the same masks.
DIFFERENTIATION = Differentiation(
    grad=torch.func.grad, vmap=torch.func.vmap, jacrev=torch.func.jacrev, values=_values,
    is_array=_is_tensor, is_floating=lambda t: t.is_floating_point(),
    cast=lambda t, like: t.to(like.dtype), total=torch.sum,
    row_sums=lambda t: torch.sum(torch.reshape(t, (t.shape[0], -1)), dim=1), stack=torch.stack,
    vectorizing=torch_convolutions_in_vmap,
    replaying=lambda call: replaying_generators(call.generators), loops_where_vmap_fails=True)


# -- whole-model baselines ------------------------------------------------------------------------
def _unit_weights(x, sample_weight):
    if sample_weight is not None:
        return sample_weight
    first = keras.tree.flatten(x)[0]
    return torch.ones([first.shape[0]], dtype=getattr(torch, keras.config.floatx()),
                      device=first.device)


def _materialized(model, grads, losses, predictions) -> PerExampleResult:
    return materialized_result(model, grads, losses.detach(), _detached_predictions(predictions))


def _predictions(model, x, training: bool):
    with torch.no_grad():
        return model(x, training=training)


def run_vmap(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """``torch.func.vmap(torch.func.grad(...))`` of one example's loss through
    ``model.stateless_call``."""
    values = _values(model.trainable_variables)
    frozen = _values(model.non_trainable_variables)
    value_and_grad = torch.func.grad_and_value(example_loss(model, loss_fn, training, frozen))

    def one(xi, yi, wi):
        grads, loss = value_and_grad(values, xi, yi, wi)
        return loss, grads

    # vmap maps over tensors only: NumPy inputs and targets become tensors first.
    x, y = (keras.tree.map_structure(lambda t: t if t is None else ops.convert_to_tensor(t), s)
            for s in (x, y))
    try:
        with torch_convolutions_in_vmap():
            losses, grads = torch.func.vmap(one)(x, y, _unit_weights(x, sample_weight))
    except Exception as error:  # noqa: BLE001 - vmap raises several types for what it cannot batch
        raise NotImplementedError(
            "strategy='vmap' on the PyTorch backend: torch.func.vmap cannot run this model "
            f"({type(error).__name__}: {' '.join(str(error).split())[:300]}): one of its ops "
            "has no vmap batching rule. Use strategy='auto' (the default) or 'loop'; see "
            "docs/backends.md.") from error
    return _materialized(model, grads, losses, _predictions(model, x, training))


def run_loop(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """One gradient per example in a Python loop: the reference the others match."""
    values = _values(model.trainable_variables)
    frozen = _values(model.non_trainable_variables)
    value_and_grad = torch.func.grad_and_value(example_loss(model, loss_fn, training, frozen))
    w = _unit_weights(x, sample_weight)
    losses, rows = [], []
    for i in range(w.shape[0]):
        xi = keras.tree.map_structure(lambda t, i=i: t[i], x)
        yi = None if y is None else keras.tree.map_structure(lambda t, i=i: t[i], y)
        grads, loss = value_and_grad(values, xi, yi, w[i])
        losses.append(loss)
        rows.append(grads)
    grads = [torch.stack(list(column)) for column in zip(*rows, strict=True)]
    return _materialized(model, grads, torch.stack(losses), _predictions(model, x, training))


def run_jacobian(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """``torch.func.jacrev`` of the per-example losses with respect to every trainable
    variable."""
    losses_of = batch_losses(model, loss_fn, x, y, sample_weight, training,
                             _values(model.non_trainable_variables))

    def with_aux(values):
        losses, predictions = losses_of(values)
        return losses, (losses, predictions, masks_of(predictions))

    grads, (losses, predictions, masks) = torch.func.jacrev(with_aux, has_aux=True)(
        _values(model.trainable_variables))
    return _materialized(model, grads, losses, with_masks(predictions, masks))


RUNNERS: dict[str, Any] = {"jacobian": run_jacobian, "vmap": run_vmap, "loop": run_loop}


# -- the batch gradient and "compilation" ---------------------------------------------------------
def batch_gradient(model, loss_fn, x, y, sample_weight, training: bool) -> list:
    """``d/dtheta sum_i l_i`` by one ordinary autograd pass: what :meth:`PerExample.check`
    compares ``sum_i g_i`` with."""
    values = [v.value for v in model.trainable_variables]
    with torch.enable_grad():
        total = torch.sum(weighted_losses(loss_fn(y, model(x, training=training)),
                                          sample_weight))
        grads = torch.autograd.grad(total, values, allow_unused=True)
    return _zero_if_none(grads, [v.detach() for v in values])


def compile_function(model, body, on_trace, jit_compile: bool = False) -> Any:
    """``body(*args)``, run eagerly with autograd off (the engine turns it on for its one
    backward pass). Nothing is traced, so ``on_trace`` is never called: ``trace_counts`` stays
    0 on PyTorch, and ``jit_compile`` is ignored."""
    del model, on_trace, jit_compile

    def call(*args):
        with torch.no_grad():
            return body(*args)

    return call
