"""The benchmark models: those of the engine issue (an MLP, a small CNN and a 2-block transformer)
and realistic workloads (a small ResNet, a MobileNetV2-style network, a text CNN, a GRU classifier
and an embedding bag), each with random inputs from :func:`batch` and default batch sizes in
:data:`DEFAULT_BATCH`. Every model ends in 10 logits for sparse categorical cross-entropy."""

from __future__ import annotations

import keras
import numpy as np

L = keras.layers


def twin(model: keras.Model, loss=None) -> keras.Model:
    """A copy of ``model`` with the same weights; compiled with SGD (learning rate 0.01) and
    ``loss`` when one is given, so that several steps can be timed from the same state."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    if loss is not None:
        copy.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    return copy


def mlp() -> keras.Model:
    """MLP 784-512-512-10."""
    return keras.Sequential([keras.Input((784,)), L.Dense(512, activation="relu"),
                             L.Dense(512, activation="relu"), L.Dense(10)], name="mlp")


def cnn() -> keras.Model:
    """28x28x1 -> Conv2D(16, 8, s2, same) -> MaxPool(2, s1) -> Conv2D(32, 4, s2, valid) ->
    MaxPool(2, s1) -> Flatten -> Dense(32) -> Dense(10) (the TF Privacy tutorial CNN)."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        L.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
        L.MaxPool2D(2, strides=1),
        L.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
        L.MaxPool2D(2, strides=1),
        L.Flatten(),
        L.Dense(32, activation="relu"),
        L.Dense(10),
    ], name="cnn")


def transformer(d: int = 128, heads: int = 4, seq: int = 64, vocab: int = 1000,
                blocks: int = 2) -> keras.Model:
    """Token embedding + learned positions, ``blocks`` pre-LN transformer blocks (multi-head
    attention, GELU MLP of width 4d), mean pooling, Dense(10)."""
    ids = keras.Input((seq,), dtype="int32")
    # The positions come from the input, so the position table is part of the model (a
    # constant array here would be embedded once, at construction, and never trained).
    positions = L.Lambda(lambda t: keras.ops.zeros_like(t) + keras.ops.arange(seq, dtype=t.dtype),
                         name="positions")(ids)
    h = L.Embedding(vocab, d)(ids) + L.Embedding(seq, d)(positions)
    for _ in range(blocks):
        a = L.LayerNormalization()(h)
        h = h + L.MultiHeadAttention(heads, d // heads)(a, a)
        m = L.LayerNormalization()(h)
        h = h + L.Dense(d)(L.Dense(4 * d, activation="gelu")(m))
    h = L.LayerNormalization()(h)
    return keras.Model(ids, L.Dense(10)(L.GlobalAveragePooling1D()(h)), name="transformer")


def _conv_gn_relu(h, filters: int, kernel: int = 3, strides: int = 1, relu: bool = True):
    h = L.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(h)
    h = L.GroupNormalization(groups=8)(h)
    return L.ReLU()(h) if relu else h


def resnet(widths: tuple[int, ...] = (32, 64, 128), blocks: int = 2) -> keras.Model:
    """A small ResNet for 32x32x3 images (CIFAR-10 shape), 696,618 parameters.

    Stem Conv2D(32, 3x3) + GroupNormalization(8 groups) + ReLU, then 3 stages of ``blocks`` = 2
    basic residual blocks of widths 32, 64, 128 (the first block of stages 2 and 3 has stride 2).
    A block is Conv2D 3x3 + GroupNormalization + ReLU, Conv2D 3x3 + GroupNormalization, added to
    the shortcut (the identity, or a strided 1x1 Conv2D + GroupNormalization where the shape
    changes), then ReLU. Convolutions have no bias (the normalization's offset is the bias).
    Global average pooling, Dense(10). GroupNormalization, not BatchNormalization: the latter
    mixes the examples of a batch in training mode, so per-example gradients do not exist.
    """
    inputs = keras.Input((32, 32, 3))
    h = _conv_gn_relu(inputs, widths[0])
    for stage, width in enumerate(widths):
        for block in range(blocks):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = h
            if strides != 1 or h.shape[-1] != width:
                shortcut = _conv_gn_relu(h, width, 1, strides, relu=False)
            r = _conv_gn_relu(h, width, 3, strides)
            r = _conv_gn_relu(r, width, 3, 1, relu=False)
            h = L.ReLU()(L.Add()([shortcut, r]))
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, outputs, name="resnet")


# MobileNetV2's (expansion t, output channels c, repeats n, first stride s), shortened for 32x32.
_MOBILENET_BLOCKS = ((1, 16, 1, 1), (4, 24, 2, 2), (4, 32, 2, 2), (4, 64, 2, 2))


def mobilenet() -> keras.Model:
    """A MobileNetV2-style network for 32x32x3 images, 97,546 parameters.

    Stem Conv2D(32, 3x3) + GroupNormalization(8 groups) + ReLU6, then inverted residual blocks
    (t, c, n, s) = (1, 16, 1, 1), (4, 24, 2, 2), (4, 32, 2, 2), (4, 64, 2, 2): each a 1x1
    Conv2D expanding the channels t times (skipped when t = 1) + GroupNormalization + ReLU6, a
    3x3 DepthwiseConv2D with stride s on the first repeat + GroupNormalization + ReLU6, and a 1x1
    Conv2D projecting to c channels + GroupNormalization (linear bottleneck), added to its input
    when the shapes match. Then a 1x1 Conv2D(256) + GroupNormalization + ReLU6, global average
    pooling, Dense(10). Convolutions have no bias. No BatchNormalization (it mixes examples).
    """
    def norm(h, relu6: bool = True):
        h = L.GroupNormalization(groups=8)(h)
        return L.ReLU(max_value=6.0)(h) if relu6 else h

    inputs = keras.Input((32, 32, 3))
    h = norm(L.Conv2D(32, 3, padding="same", use_bias=False)(inputs))
    for expansion, channels, repeats, first_stride in _MOBILENET_BLOCKS:
        for repeat in range(repeats):
            strides = first_stride if repeat == 0 else 1
            r = h
            if expansion != 1:
                r = norm(L.Conv2D(expansion * h.shape[-1], 1, use_bias=False)(r))
            r = norm(L.DepthwiseConv2D(3, strides=strides, padding="same", use_bias=False)(r))
            r = norm(L.Conv2D(channels, 1, use_bias=False)(r), relu6=False)
            h = L.Add()([h, r]) if strides == 1 and h.shape[-1] == channels else r
    h = norm(L.Conv2D(256, 1, use_bias=False)(h))
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, outputs, name="mobilenet")


def text_cnn(vocab: int = 10000, seq: int = 128) -> keras.Model:
    """Text classification CNN on 128 token ids, 682,378 parameters: Embedding(10000, 64) ->
    Conv1D(128, 5, ReLU) -> GlobalMaxPooling1D -> Dense(10)."""
    return keras.Sequential([keras.Input((seq,), dtype="int32"), L.Embedding(vocab, 64),
                             L.Conv1D(128, 5, activation="relu"), L.GlobalMaxPooling1D(),
                             L.Dense(10)], name="text_cnn")


def gru(vocab: int = 10000, seq: int = 64) -> keras.Model:
    """Recurrent classifier on 64 token ids, 665,610 parameters: Embedding(10000, 64) -> GRU(64)
    (Keras defaults: reset_after, last state only) -> Dense(10)."""
    return keras.Sequential([keras.Input((seq,), dtype="int32"), L.Embedding(vocab, 64),
                             L.GRU(64), L.Dense(10)], name="gru")


def embedding_bag(vocab: int = 10000, seq: int = 64) -> keras.Model:
    """Bag of embeddings on 64 token ids, 160,170 parameters: Embedding(10000, 16) ->
    GlobalAveragePooling1D -> Dense(10) (a fastText-style classifier: sparse, memory-bound)."""
    return keras.Sequential([keras.Input((seq,), dtype="int32"), L.Embedding(vocab, 16),
                             L.GlobalAveragePooling1D(), L.Dense(10)], name="embedding_bag")


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "resnet": resnet,
          "mobilenet": mobilenet, "text_cnn": text_cnn, "gru": gru, "embedding_bag": embedding_bag}

# Batch sizes a benchmark uses for a model when none are given.
DEFAULT_BATCH = {"mlp": (64, 256), "cnn": (64, 256), "transformer": (64, 256), "resnet": (128,),
                 "mobilenet": (128,), "text_cnn": (256,), "gru": (128,), "embedding_bag": (256,)}

# Input of each model: a float image/vector shape, or (sequence length, vocabulary) of token ids.
_IMAGES = {"mlp": (784,), "cnn": (28, 28, 1), "resnet": (32, 32, 3), "mobilenet": (32, 32, 3)}
_TOKENS = {"transformer": (64, 1000), "text_cnn": (128, 10000), "gru": (64, 10000),
           "embedding_bag": (64, 10000)}


def batch(name: str, size: int, seed: int = 0):
    """Random inputs (standard normal floats, or uniform token ids) and integer labels in
    ``[0, 10)`` for model ``name``."""
    if name not in MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; expected one of {sorted(MODELS)}")
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, size)
    if name in _IMAGES:
        return rng.normal(size=(size, *_IMAGES[name])).astype("float32"), y
    seq, vocab = _TOKENS[name]
    return rng.integers(0, vocab, size=(size, seq)).astype("int32"), y
