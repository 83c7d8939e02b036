"""KerasHub's own layers with weights (imported only when KerasHub is: :mod:`pergrad.rules`
loads this module the first time it looks up a rule after ``keras_hub`` was imported).

``PositionEmbedding``: ``z_i[t] = P[s + t]`` broadcast to the input's shape (``s`` the
``start_index``, or ``P[positions[t]]``), so

    dL_i/dP[n] = sum_{t: s + t = n} dL/dz_i[t]

a ``Rows`` form with ids ``s + t`` (summed over any axes between the batch and the positions).

The RMS normalizations of Gemma, Llama, Mistral and their kin: ``z = c(x) + n(x) * scale``
along the last axis, with ``n`` the normalized input (Gemma: ``n (1 + scale)``, so ``c = n``;
Llama, Mistral: ``n scale``, ``c = 0``). The layer is affine in ``scale``, so

    dL_i/dscale = sum_{other axes} dL/dz_i * n_i

materialized (the variable is one vector). ``n`` is the layer itself run with the scale at
which its output is ``n`` (0 for Gemma's ``1 + scale``, 1 for ``scale``), so epsilon and the
float32 computation follow whatever the installed KerasHub does.

``ViTPatchingAndEmbedding``: ``z_i = [class_token; conv(x_i)] + P`` (a stride-``patch``
convolution flattened over the patch grid, the class token as position 0, and position
embeddings ``P`` for every position). Per example the class token's gradient is
``dL/dz_i[0]``, ``P``'s is ``dL/dz_i`` itself, and the convolution's is the convolution rule's
(:mod:`pergrad.rules.conv`) with output gradient ``dL/dz_i[1:]`` laid back on the grid.
"""

from __future__ import annotations

import importlib

from keras import ops

from pergrad.backend.ops import batch_size
from pergrad.rules import LayerCall, register
from pergrad.rules.conv import conv_rule
from pergrad.rules.forms import Materialized, Rows, unbroadcast


def _class(module: str, name: str):
    """``keras_hub.src.<module>.<name>``, or ``None`` where this KerasHub version lacks it."""
    try:
        return getattr(importlib.import_module(f"keras_hub.src.{module}"), name)
    except (ImportError, AttributeError):
        return None


def position_embedding_rule(layer, call: LayerCall, grad) -> list:
    table = layer.position_embeddings
    inputs = call.args[0]
    d = ops.cast(grad, table.dtype)
    batch, width = batch_size(d), d.shape[-1]
    length = inputs.shape[-2] if inputs.shape[-2] is not None else ops.shape(inputs)[-2]
    positions = call.kwargs.get("positions", call.args[2] if len(call.args) > 2 else None)
    if positions is None:
        start = call.kwargs.get("start_index", call.args[1] if len(call.args) > 1 else 0)
        ids = ops.arange(length, dtype="int32") + ops.cast(start, "int32")
    else:
        ids = ops.cast(positions, "int32")
    ids = ops.broadcast_to(ops.reshape(ids, [-1, length]), [batch, length])
    # Axes between the batch and the positions read the same rows: sum them first.
    d = ops.sum(ops.reshape(d, [batch, -1, length, width]), axis=1)
    return [Rows(table, ids, d)]


def _scale_rule(unit: float):
    """The rule of an RMS normalization whose output is ``n(x)`` at ``scale = unit``."""
    def rule(layer, call: LayerCall, grad) -> list:
        scale = layer.scale
        if not scale.trainable:
            return []
        values = [ops.full(v.shape, unit, v.dtype) if v is scale else v.value
                  for v in layer.trainable_variables]
        frozen = [v.value for v in layer.non_trainable_variables]
        normalized, _ = layer.stateless_call(values, frozen, *call.args, **call.kwargs)
        d = ops.cast(grad, scale.dtype) * ops.cast(normalized, scale.dtype)
        return [Materialized(scale, unbroadcast(d, tuple(scale.shape)))]
    return rule


def vit_patching_rule(layer, call: LayerCall, grad) -> list:
    forms = []
    d = grad
    if layer.use_class_token:
        token = layer.class_token
        if token.trainable:
            forms.append(Materialized(token, ops.reshape(ops.cast(d[:, :1], token.dtype),
                                                         [batch_size(d), *token.shape])))
        d = d[:, 1:]
    table = layer.position_embedding.embeddings
    if table.trainable and layer.position_embedding.trainable:  # ids are 0..positions-1
        forms.append(Materialized(table, ops.cast(grad, table.dtype)))
    conv = layer.patch_embedding
    if conv.trainable_variables:
        grid = [s // p for s, p in zip(layer.image_size, layer.patch_size, strict=True)]
        d = ops.reshape(d, [batch_size(d), *grid, d.shape[-1]])
        if conv.data_format == "channels_first":
            d = ops.transpose(d, [0, 3, 1, 2])
        forms += [f for f in conv_rule(conv, LayerCall(conv, call.args[:1], {}, None), d)
                  if f.variable.trainable]
    return forms


def _vit_applies(layer) -> bool:
    """The layer as this KerasHub version builds it: patch grid from ``image_size``, position
    ids ``0..num_positions-1``, a plain (not LoRA, not quantized) convolution and embedding."""
    conv, embedding = layer.patch_embedding, layer.position_embedding
    return (int(embedding.input_dim) == int(layer.num_positions)
            and not getattr(conv, "lora_enabled", False)
            and not getattr(embedding, "lora_enabled", False)
            and not getattr(conv, "quantization_mode", None)
            and not getattr(embedding, "quantization_mode", None))


_POSITION = _class("layers.modeling.position_embedding", "PositionEmbedding")
if _POSITION is not None:
    register(_POSITION)(position_embedding_rule)

# (module, class, the scale at which the layer outputs the normalized input)
_RMS_NORMALIZATIONS = [
    ("models.gemma.rms_normalization", "RMSNormalization", 0.0),
    ("models.gemma3.gemma3_layers", "RMSNormalization", 0.0),
    ("models.llama.llama_layernorm", "LlamaLayerNorm", 1.0),
    ("models.mistral.mistral_layer_norm", "MistralLayerNormalization", 1.0),
    ("models.mixtral.mixtral_layer_norm", "MixtralLayerNormalization", 1.0),
    ("models.qwen.qwen_layernorm", "QwenLayerNorm", 1.0),
    ("models.qwen3.qwen3_layernorm", "Qwen3LayerNorm", 1.0),
    ("models.phi3.phi3_layernorm", "Phi3LayerNorm", 1.0),
]
RMS_NORMALIZATION_CLASSES = []
for _module, _name, _unit in _RMS_NORMALIZATIONS:
    _cls = _class(_module, _name)
    if _cls is not None:
        register(_cls)(_scale_rule(_unit))
        RMS_NORMALIZATION_CLASSES.append(_cls)

_VIT = _class("models.vit.vit_layers", "ViTPatchingAndEmbedding")
if _VIT is not None:
    register(_VIT, applies=_vit_applies)(vit_patching_rule)
