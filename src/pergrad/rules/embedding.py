"""Embedding: ``z[t] = E[ids[t]]``.

    dL_i/dE[n] = sum_t [ids_i[t] = n] dL/dz_i[t]

a ``Rows`` form: repeated ids within one example add up before any norm is taken.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.forms import Rows


@register(keras.layers.Embedding, applies=plain_weights)
def embedding_rule(layer, call: LayerCall, grad: tf.Tensor) -> list:
    ids = tf.cast(call.args[0], tf.int32)
    batch = tf.shape(ids)[0]
    d = tf.cast(grad, layer.embeddings.dtype)
    return [Rows(layer.embeddings, tf.reshape(ids, [batch, -1]),
                 tf.reshape(d, [batch, -1, layer.embeddings.shape[-1]]))]
