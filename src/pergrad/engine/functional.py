"""What the functional engines (JAX, PyTorch) share: one example's call of a layer, one
example's loss and the batch's losses, all through ``stateless_call`` on the variables' values,
and the stateless scope (``stateless``, ``assign_written``) that ``backend.jax.engine`` and
``backend.torch.jacobian`` run f in. Only the differentiation around them (``jax.grad``,
``torch.func.grad``) differs per backend; the generic rule built on them is
:mod:`pergrad.engine.generic_rule`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras

from pergrad._compat import autocast_scope, call_takes_training
from pergrad.engine.losses import weighted_losses
from pergrad.rules import LayerCall


def one_example_call(call: LayerCall, leaves: list, batched: list[int],
                     example_leaves: list) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``call`` with its batched leaves (``leaves[i]`` for ``i`` in
    ``batched``) replaced by one example's, ``example_leaves[k][None]``: a batch of one."""
    full = list(leaves)
    for k, i in enumerate(batched):
        full[i] = example_leaves[k][None]
    return keras.tree.pack_sequence_as((call.args, call.kwargs), full)


def example_loss(model, loss_fn, training: bool, frozen: list) -> Callable[..., Any]:
    """``loss(values, x_i, y_i, w_i) = w_i l(y_i, f(x_i; values))``: one example's weighted
    loss, the model run as a batch of one on the trainable ``values`` (``frozen``: the
    non-trainable ones)."""
    def loss(values, xi, yi, wi):
        xi = keras.tree.map_structure(lambda t: t[None], xi)
        yi = None if yi is None else keras.tree.map_structure(lambda t: t[None], yi)
        kwargs = {"training": training} if call_takes_training(model) else {}
        with autocast_scope(model):
            predictions, _ = model.stateless_call(values, frozen, xi, **kwargs)
        return weighted_losses(loss_fn(yi, predictions), wi[None])[0]
    return loss


def batch_losses(model, loss_fn, x, y, sample_weight, training: bool,
                 frozen: list) -> Callable[..., Any]:
    """``values -> (l, predictions)``: the weighted per-example losses ``l_i = w_i l(y_i,
    f(x_i; values))`` of the whole batch as a function of the trainable ``values``, through
    ``stateless_call`` (``frozen``: the non-trainable values)."""
    kwargs = {"training": training} if call_takes_training(model) else {}

    def losses_of(values):
        with autocast_scope(model):
            predictions, _ = model.stateless_call(values, frozen, x, **kwargs)
        return weighted_losses(loss_fn(y, predictions), sample_weight), predictions

    return losses_of


# -- variables read as given values, writes kept -------------------------------------------------
class _Scope:
    """A ``keras.StatelessScope`` over given values that can tell which variables were written."""

    def __init__(self, variables: list, values: list) -> None:
        self.scope = keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True)),
                                          collect_losses=True)
        self.initial = dict(self.scope.state_mapping)

    def written(self, variables: list) -> list:
        """What each variable was assigned inside the scope; ``None`` where it was not."""
        out = []
        for v in variables:
            value = self.scope.get_current_value(v)
            out.append(None if value is self.initial.get(id(v)) else value)
        return out


@contextlib.contextmanager
def stateless(variables: list, values: list):
    """Every variable of ``variables`` reads as its entry of ``values``; writes are kept in the
    yielded scope (``scope.written(variables)``) and never reach the variables."""
    holder = _Scope(variables, values)
    with holder.scope:
        yield holder


def assign_written(variables: list, written: list) -> None:
    """Assign what :meth:`_Scope.written` found (dropout seed states, moving statistics), as an
    ordinary call would have written it."""
    for variable, value in zip(variables, written, strict=True):
        if value is not None:
            variable.assign(value)
