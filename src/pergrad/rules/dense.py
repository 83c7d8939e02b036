"""Dense: ``z = x W + b`` on inputs ``(B, ..., d_in)``.

For example ``i`` with positions ``t`` (all axes between batch and features),

    dL_i/dW = sum_t x_{i,t}^T dL/dz_{i,t}        dL_i/db = sum_t dL/dz_{i,t}

so the kernel is ``Factored`` with ``A = x`` and ``D = dL/dz`` (one group).
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.backend.ops import batch_size
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.forms import Factored, Materialized, positions, unbroadcast


@register(keras.layers.Dense, splits_activation=True, applies=plain_weights)
def dense_rule(layer, call: LayerCall, grad) -> list:
    x = ops.cast(call.args[0], layer.kernel.dtype)
    d = ops.cast(grad, layer.kernel.dtype)
    d_in, d_out = layer.kernel.shape
    batch = batch_size(x)
    t = positions(x.shape[1:-1])
    a = ops.reshape(x, [batch, t, 1, d_in])
    forms = [Factored(layer.kernel, a, ops.reshape(d, [batch, t, 1, d_out]), (d_in, d_out))]
    if layer.bias is not None:
        forms.append(Materialized(layer.bias, unbroadcast(d, tuple(layer.bias.shape))))
    return forms
