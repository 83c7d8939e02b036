"""Embedding: ``z[t] = E[ids[t]]``.

    dL_i/dE[n] = sum_t [ids_i[t] = n] dL/dz_i[t]

a ``Rows`` form: repeated ids within one example add up before any norm is taken.

ReversibleEmbedding (Keras's, and KerasHub's subclass of it) is an Embedding that can also be
called with ``reverse=True`` on hidden states ``h`` (``(B, ..., H)``) to give logits
``z = h K`` over the vocabulary, with ``K = E^T`` (``tie_weights=True``) or its own
``reverse_embeddings`` ``R`` (``(H, V)``). A reverse call is a Dense layer without bias:

    tied:    dL_i/dE = sum_t dL/dz_i[t]^T h_i[t]        (V x H)
    untied:  dL_i/dR = sum_t h_i[t]^T dL/dz_i[t]        (H x V)

``Factored`` forms. With ``logit_soft_cap`` ``c`` the logits are ``c tanh(z / c)`` and the
gradient at ``z`` is ``dL/dlogits (1 - tanh(z / c)^2)``. A tied table used both ways (GPT-2,
Gemma: the input embedding is the language-model head) gets a ``Rows`` form from the forward
call and a ``Factored`` one from the reverse call; :func:`pergrad.rules.forms.combine` merges
them as one ``Factored`` form. With LoRA or quantization on, the layer takes the generic rule.
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.backend.ops import batch_size
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.forms import Factored, Rows, positions


@register(keras.layers.Embedding, applies=plain_weights)
def embedding_rule(layer, call: LayerCall, grad) -> list:
    ids = ops.cast(call.args[0], "int32")
    batch = batch_size(ids)
    d = ops.cast(grad, layer.embeddings.dtype)
    return [Rows(layer.embeddings, ops.reshape(ids, [batch, -1]),
                 ops.reshape(d, [batch, -1, layer.embeddings.shape[-1]]))]


def _reverse(call: LayerCall) -> bool:
    reverse = call.kwargs.get("reverse", call.args[1] if len(call.args) > 1 else False)
    if not isinstance(reverse, bool):
        raise NotImplementedError(
            f"Layer {call.layer.name!r} (ReversibleEmbedding) was called with a tensor as "
            "`reverse`; pergrad needs a Python bool there (which way the layer runs).")
    return reverse


def reversible_embedding_rule(layer, call: LayerCall, grad) -> list:
    if not _reverse(call):
        return embedding_rule(layer, call, grad)
    table = layer.embeddings if layer.tie_weights else layer.reverse_embeddings
    if not table.trainable:
        return []
    dtype = table.dtype
    h = ops.cast(call.args[0], dtype)
    d = ops.cast(grad, dtype)
    if layer.logit_soft_cap is not None:  # the gradient at the logits before the cap
        kernel = ops.transpose(table.value) if layer.tie_weights else table.value
        if layer.reverse_dtype is not None:
            h_r, kernel = ops.cast(call.args[0], layer.reverse_dtype), ops.cast(
                kernel, layer.reverse_dtype)
        else:
            h_r = call.args[0]
        capped = ops.tanh(ops.cast(ops.matmul(h_r, kernel), dtype) / layer.logit_soft_cap)
        d = d * (1 - ops.square(capped))
    batch = batch_size(h)
    t = positions(h.shape[1:-1])
    hidden, vocabulary = h.shape[-1], d.shape[-1]
    h = ops.reshape(h, [batch, t, 1, hidden])
    d = ops.reshape(d, [batch, t, 1, vocabulary])
    if layer.tie_weights:
        return [Factored(table, d, h, (vocabulary, hidden))]
    return [Factored(table, h, d, (hidden, vocabulary))]


if hasattr(keras.layers, "ReversibleEmbedding"):  # Keras 3.12+ (KerasHub's subclasses it)
    register(keras.layers.ReversibleEmbedding, applies=plain_weights)(reversible_embedding_rule)
