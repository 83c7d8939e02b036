"""The backend-neutral half of every engine: from the recorded calls and the gradients at their
taps to one :class:`PerExampleResult`.

Each backend's engine (``pergrad.backend.{tensorflow,jax,torch}.engine``) does what
only it can: run the forward pass with taps, take one backward pass of ``L = sum_i l_i`` to every
tap, and offer a generic rule (per-example VJPs of one layer). What follows is the same math on
every backend and lives here once:

- a layer call ``c`` with a rule gives forms ``rule(layer, c, dL/dz_c)``; a call without one
  gives the generic rule's materialized ``g_i = d/dW <f(x_i; W), D_i>``;
- a variable read by several calls (shared layers, tied embeddings) has
  ``g_i = sum_c g_i^{(c)}``: its forms are combined (:func:`pergrad.rules.combine`);
- a variable reached by no tapped call (``plan.residual``) gets its rows ``dl_i/dW`` from the
  backend's per-example Jacobian of the losses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from keras import ops

from pergrad.engine.plan import Plan
from pergrad.engine.result import PerExampleResult
from pergrad.rules import LayerCall, combine
from pergrad.rules.forms import Form, Materialized

#: ``generic(call, grads) -> forms``: a backend's per-example VJPs of one layer call.
GenericRule = Callable[[LayerCall, list], list]


def in_groups(flat: Sequence, counts: Iterable[int]) -> list[list]:
    """``flat`` cut into consecutive groups of ``counts`` items (one group per recorded call)."""
    groups, position = [], 0
    for count in counts:
        groups.append(list(flat[position:position + count]))
        position += count
    if position != len(flat):
        raise ValueError(f"{len(flat)} tap gradients for {position} taps")
    return groups


def forms_by_variable(plan: Plan, calls: Iterable[tuple[LayerCall, list]],
                      generic: GenericRule) -> dict[int, list[Form]]:
    """The forms of every variable that the recorded ``calls`` reach, keyed by ``id(variable)``:
    a ruled layer's rule applied to the gradient at its (single) tap, any other layer's
    ``generic`` rule."""
    rules = {id(layer): rule for layer, rule in plan.ruled}
    by_variable: dict[int, list[Form]] = {}
    for call, grads in calls:
        rule = rules.get(id(call.layer))
        forms = rule.fn(call.layer, call, grads[0]) if rule is not None else generic(call, grads)
        for form in forms:
            by_variable.setdefault(id(form.variable), []).append(form)
    return by_variable


def add_rows(by_variable: dict[int, list[Form]], variables: Sequence, rows: Sequence) -> None:
    """Add materialized per-example rows ``(B, *var.shape)`` for ``variables`` (the residual
    variables' ``dl_i/dW``), cast to each variable's dtype."""
    for variable, grad in zip(variables, rows, strict=True):
        by_variable.setdefault(id(variable), []).append(
            Materialized(variable, ops.cast(grad, variable.dtype)))


def assembled_result(model, by_variable: dict[int, list[Form]], losses: Any,
                     predictions: Any) -> PerExampleResult:
    """One form per trainable variable of ``model`` (the combination of its calls' forms;
    ``None`` where the loss does not reach it)."""
    variables = list(model.trainable_variables)
    forms = [combine(by_variable[id(v)]) if id(v) in by_variable else None for v in variables]
    return PerExampleResult(variables, forms, losses, predictions)


def materialized_result(model, grads: Sequence, losses: Any, predictions: Any) -> PerExampleResult:
    """A whole-model baseline's result: ``grads[k]`` is ``(B, *var.shape)`` for the ``k``-th
    trainable variable, cast to its dtype."""
    variables = list(model.trainable_variables)
    forms = [Materialized(v, ops.cast(g, v.dtype)) for v, g in zip(variables, grads, strict=True)]
    return PerExampleResult(variables, forms, losses, predictions)
