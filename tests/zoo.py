"""Small models covering every rule, the generic fallback and the model kinds, with random data.

Each builder returns a ``Case``; call it inside the ``float64`` fixture so weights are float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import pytest

L = keras.layers
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
B = 5


@dataclass
class Case:
    model: Any
    loss: Any
    x: Any
    y: Any
    sample_weight: Any = None
    expect_generic: list = field(default_factory=list)
    # Layers whose rule runs on TensorFlow only (the recurrent ones) take the generic rule on JAX.


def _rng(seed=0):
    return np.random.default_rng(seed)


def _classify(inputs, outputs, x, classes=3, **kw) -> Case:
    model = keras.Model(inputs, outputs)
    y = _rng(1).integers(0, classes, size=B)
    return Case(model, SCCE, x, y, **kw)


def mlp():
    model = keras.Sequential([keras.Input((6,)), L.Dense(7, activation="tanh"), L.Dense(5, activation="relu"),
                              L.Dense(3)])
    return Case(model, SCCE, _rng().normal(size=(B, 6)), _rng(1).integers(0, 3, B))


def conv2d(filters=4, kernel=3, strides=1, padding="valid", dilation=1, groups=1,
           data_format="channels_last", channels=3, size=(9, 8)):
    shape = (*size, channels) if data_format == "channels_last" else (channels, *size)
    inputs = keras.Input(shape)
    h = L.Conv2D(filters, kernel, strides=strides, padding=padding, dilation_rate=dilation,
                 groups=groups, data_format=data_format, activation="tanh")(inputs)
    h = L.Conv2D(3, 2, data_format=data_format)(h)
    outputs = L.Dense(3)(L.Flatten()(h))
    return _classify(inputs, outputs, _rng().normal(size=(B, *shape)))


def conv1d(padding="causal", strides=1, dilation=2):
    inputs = keras.Input((10, 3))
    h = L.Conv1D(4, 3, strides=strides, padding=padding, dilation_rate=dilation, activation="relu")(inputs)
    outputs = L.Dense(3)(L.GlobalAveragePooling1D()(h))
    return _classify(inputs, outputs, _rng().normal(size=(B, 10, 3)))


def conv3d(data_format="channels_last"):
    """Keras runs channels_first 3D convolutions through XLA on CPU; 2D ones do not run there."""
    shape = (5, 4, 6, 2) if data_format == "channels_last" else (2, 5, 4, 6)
    inputs = keras.Input(shape)
    h = L.Conv3D(3, (2, 2, 3), strides=(1, 2, 1), padding="same", activation="tanh",
                 data_format=data_format)(inputs)
    outputs = L.Dense(3)(L.Flatten()(h))
    return _classify(inputs, outputs, _rng().normal(size=(B, *shape)))


def embedding():
    inputs = keras.Input((6,), dtype="int32")
    h = L.Embedding(11, 4)(inputs)
    outputs = L.Dense(3)(L.Flatten()(h))
    ids = _rng().integers(0, 5, size=(B, 6))  # few distinct ids: repeats within an example
    return _classify(inputs, outputs, ids)


def layer_norm(rms=False):
    inputs = keras.Input((4, 6))
    h = L.Dense(6)(inputs)
    if rms and not hasattr(L, "RMSNormalization"):
        pytest.skip("RMSNormalization needs Keras >= 3.9 (the oldest Keras CI runs is 3.5)")
    h = L.RMSNormalization()(h) if rms else L.LayerNormalization()(h)
    h = L.LayerNormalization(axis=[1, 2])(h)
    outputs = L.Dense(3)(L.Flatten()(h))
    return _classify(inputs, outputs, _rng().normal(size=(B, 4, 6)))


def group_norm():
    inputs = keras.Input((6, 6, 2))
    h = L.Conv2D(4, 3)(inputs)
    h = L.GroupNormalization(groups=2)(h)
    outputs = L.Dense(3)(L.Flatten()(h))
    return _classify(inputs, outputs, _rng().normal(size=(B, 6, 6, 2)))


def batch_norm_inference():
    inputs = keras.Input((6,))
    h = L.Dense(5)(inputs)
    bn = L.BatchNormalization()
    h = bn(h)
    outputs = L.Dense(3)(h)
    case = _classify(inputs, outputs, _rng().normal(size=(B, 6)))
    bn.moving_mean.assign(_rng(3).normal(size=5))
    bn.moving_variance.assign(_rng(4).uniform(0.5, 2.0, size=5))
    return case


def transformer(seq=5, d=8, vocab=13):
    ids = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, d)(ids)
    attn = L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = L.LayerNormalization()(h + attn)
    ff = L.Dense(d)(L.Dense(16, activation="gelu")(h))
    h = L.LayerNormalization()(h + ff)
    outputs = L.Dense(3)(L.GlobalAveragePooling1D()(h))
    return _classify(ids, outputs, _rng().integers(0, vocab, size=(B, seq)))


def einsum_dense():
    inputs = keras.Input((4, 6))
    h = L.EinsumDense("btd,dhk->bthk", output_shape=(4, 2, 3), bias_axes="hk", activation="tanh")(inputs)
    h = L.Reshape((4, 6))(h)
    h = L.EinsumDense("abc,cd->abd", output_shape=(4, 5), bias_axes="d")(h)
    h = L.EinsumDense("...c,cd->...d", output_shape=(3,))(h)
    outputs = L.EinsumDense("abc,bc->ab", output_shape=(4,))(h)  # b is a group axis
    return Case(keras.Model(inputs, outputs), "mse", _rng().normal(size=(B, 4, 6)),
                _rng(1).normal(size=(B, 4)))


def lstm():
    inputs = keras.Input((4, 3))
    h = L.LSTM(5, return_sequences=True)(inputs)
    h = L.GRU(4)(h)
    outputs = L.Dense(3)(h)
    return _classify(inputs, outputs, _rng().normal(size=(B, 4, 3)))


def shared_layer():
    a, b = keras.Input((6,)), keras.Input((6,))
    shared = L.Dense(4, activation="tanh")
    h = L.Concatenate()([shared(a), shared(b)])
    outputs = L.Dense(3)(h)
    x = [_rng().normal(size=(B, 6)), _rng(5).normal(size=(B, 6))]
    return _classify([a, b], outputs, x)


def nested():
    inner_in = keras.Input((5,))
    inner = keras.Model(inner_in, L.Dense(4, activation="tanh")(L.Dense(5)(inner_in)), name="inner")
    block = keras.Sequential([L.Dense(5, activation="relu"), L.Dense(5)], name="block")
    inputs = keras.Input((6,))
    outputs = L.Dense(3)(inner(block(L.Dense(5)(inputs))))
    return _classify(inputs, outputs, _rng().normal(size=(B, 6)))


def multi_input_output():
    a, b = keras.Input((6,), name="a"), keras.Input((3,), name="b")
    h = L.Dense(5, activation="tanh")(L.Concatenate()([a, b]))
    out1 = L.Dense(3, name="cls")(h)
    out2 = L.Dense(2, name="reg")(h)
    model = keras.Model({"a": a, "b": b}, [out1, out2])
    x = {"a": _rng().normal(size=(B, 6)), "b": _rng(2).normal(size=(B, 3))}
    y = [_rng(1).integers(0, 3, B), _rng(3).normal(size=(B, 2))]
    return Case(model, [SCCE, keras.losses.MeanSquaredError()], x, y)


class Scaled(keras.Model):
    """A subclassed model with a raw variable used outside any layer."""

    def __init__(self):
        super().__init__()
        self.hidden = L.Dense(5, activation="tanh")
        self.out = L.Dense(3)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(5,), initializer="random_normal", name="scale")
        self.hidden.build(input_shape)
        self.out.build((None, 5))

    def call(self, x):
        return self.out(self.hidden(x) * self.scale + 0.1)


def subclassed():
    model = Scaled()
    model.build((None, 6))
    return Case(model, SCCE, _rng().normal(size=(B, 6)), _rng(1).integers(0, 3, B))


class Affine(keras.layers.Layer):
    """A user's layer with weights and no rule: takes the generic rule."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")
        self.b = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")

    def call(self, x):
        return keras.ops.sin(x * self.w) + self.b


def custom_and_depthwise():
    inputs = keras.Input((6, 6, 2))
    h = L.DepthwiseConv2D(3, depth_multiplier=2)(inputs)
    h = Affine()(L.Flatten()(h))
    h = L.TimeDistributed(L.Dense(2))(L.Reshape((8, 8))(h))
    outputs = L.Dense(3)(L.Flatten()(h))
    return _classify(inputs, outputs, _rng().normal(size=(B, 6, 6, 2)),
                     expect_generic=["Affine", "TimeDistributed"])


def separable_and_shared_depthwise():
    """A SeparableConv1D, then one DepthwiseConv1D called twice (its per-example kernel
    gradients from both calls add up)."""
    if keras.backend.backend() == "torch":
        import pytest  # the documented gap of test_rules_depthwise.py
        pytest.skip("float64 SeparableConv on Keras's torch backend raises a dtype error")
    inputs = keras.Input((11, 3))
    h = L.SeparableConv1D(4, 3, strides=2, padding="same", depth_multiplier=2)(inputs)
    depthwise = L.DepthwiseConv1D(2, activation="tanh")
    h = depthwise(depthwise(h))
    outputs = L.Dense(3)(L.Flatten()(h))
    return _classify(inputs, outputs, _rng().normal(size=(B, 11, 3)))


def _l1(x):
    """``0.01 * sum |x|``, as ``activity_regularizer="l1"``: Keras < 3.14's ``L1`` keeps its
    factor as a float32 tensor, which fails in float64 (the oldest Keras CI runs is 3.5), and
    ``L1L2`` adds in place, which ``torch.func.vmap`` cannot batch."""
    return 0.01 * keras.ops.sum(keras.ops.absolute(x))


def weighted_regularized():
    model = keras.Sequential([keras.Input((6,)),
                              L.Dense(5, activation="tanh", kernel_regularizer="l2",
                                      activity_regularizer=_l1),
                              L.Dense(3, bias_regularizer="l2")])
    return Case(model, SCCE, _rng().normal(size=(B, 6)), _rng(1).integers(0, 3, B),
                sample_weight=_rng(2).uniform(0.2, 2.0, B))


ALL = {
    "mlp": mlp,
    "conv2d_valid": conv2d,
    "conv2d_same_stride2": lambda: conv2d(strides=2, padding="same", size=(9, 8)),
    "conv2d_dilated": lambda: conv2d(kernel=(3, 2), padding="same", dilation=2),
    "conv2d_groups": lambda: conv2d(filters=6, groups=3, channels=3),
    "conv3d_channels_first": lambda: conv3d(data_format="channels_first"),
    "conv1d_causal": conv1d,
    "conv1d_same_stride2": lambda: conv1d(padding="same", strides=2, dilation=1),
    "conv3d": conv3d,
    "embedding": embedding,
    "layer_norm": layer_norm,
    "rms_norm": lambda: layer_norm(rms=True),
    "group_norm": group_norm,
    "batch_norm_inference": batch_norm_inference,
    "transformer": transformer,
    "einsum_dense": einsum_dense,
    "lstm_gru": lstm,
    "shared_layer": shared_layer,
    "nested": nested,
    "multi_input_output": multi_input_output,
    "subclassed_raw_variable": subclassed,
    "generic_layers": custom_and_depthwise,
    "separable_shared_depthwise": separable_and_shared_depthwise,
    "sample_weight_regularizers": weighted_regularized,
}
