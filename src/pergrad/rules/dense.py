"""Dense: ``z = x W + b`` on inputs ``(B, ..., d_in)``.

For example ``i`` with positions ``t`` (all axes between batch and features),

    dL_i/dW = sum_t x_{i,t}^T dL/dz_{i,t}        dL_i/db = sum_t dL/dz_{i,t}

so the kernel is ``Factored`` with ``A = x`` and ``D = dL/dz`` (one group).

With LoRA on (``layer.enable_lora(rank)``), ``z = x (W + s A B) + b`` with ``W`` frozen and
``s = lora_alpha / lora_rank``; then (:mod:`pergrad.rules.lora`)

    dL_i/dA = s sum_t x_{i,t}^T (dL/dz_{i,t} B^T)      dL_i/dB = s sum_t (x_{i,t} A)^T dL/dz_{i,t}

two ``Factored`` forms with factors ``(x, s D B^T)`` and ``(x A, s D)``. Forms are returned for
the trainable variables only (not the frozen ``W``).
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.backend.ops import batch_size
from pergrad.rules import LayerCall, register
from pergrad.rules.forms import Factored, Materialized, positions, unbroadcast
from pergrad.rules.lora import base_kernel, lora_forms, lora_on, unquantized


@register(keras.layers.Dense, splits_activation=True, applies=unquantized)
def dense_rule(layer, call: LayerCall, grad) -> list:
    kernel = base_kernel(layer)
    d_in, d_out = kernel.shape
    x = call.args[0]
    batch = batch_size(x)
    t = positions(x.shape[1:-1])
    forms = []
    if kernel.trainable:
        a = ops.reshape(ops.cast(x, kernel.dtype), [batch, t, 1, d_in])
        d = ops.reshape(ops.cast(grad, kernel.dtype), [batch, t, 1, d_out])
        forms.append(Factored(kernel, a, d, (d_in, d_out)))
    if lora_on(layer):
        rank = layer.lora_kernel_a.shape[-1]
        forms += lora_forms(layer, ops.reshape(x, [batch, t, 1, d_in]),
                            ops.reshape(grad, [batch, t, 1, 1, d_out]),
                            ops.reshape(layer.lora_kernel_a.value, [1, d_in, 1, rank]),
                            (d_in, rank), None)
    if layer.bias is not None and layer.bias.trainable:
        d = ops.cast(grad, layer.bias.dtype)
        forms.append(Materialized(layer.bias, unbroadcast(d, tuple(layer.bias.shape))))
    return forms
