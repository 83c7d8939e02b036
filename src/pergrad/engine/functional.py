"""What the functional engines (JAX, PyTorch) share: one example's call of a layer and one
example's loss, both through ``stateless_call`` on the variables' values. Only the
differentiation around them (``jax.grad``, ``torch.func.grad``) differs per backend."""

from __future__ import annotations

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
