"""Embedding: ``z[t] = E[ids[t]]``.

    dL_i/dE[n] = sum_t [ids_i[t] = n] dL/dz_i[t]

a ``Rows`` form: repeated ids within one example add up before any norm is taken.
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.backend.ops import batch_size
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.forms import Rows


@register(keras.layers.Embedding, applies=plain_weights)
def embedding_rule(layer, call: LayerCall, grad) -> list:
    ids = ops.cast(call.args[0], "int32")
    batch = batch_size(ids)
    d = ops.cast(grad, layer.embeddings.dtype)
    return [Rows(layer.embeddings, ops.reshape(ids, [batch, -1]),
                 ops.reshape(d, [batch, -1, layer.embeddings.shape[-1]]))]
