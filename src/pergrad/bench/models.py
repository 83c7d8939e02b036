"""The benchmark models of the engine issue: an MLP, a small CNN and a 2-block transformer."""

from __future__ import annotations

import keras
import numpy as np

L = keras.layers


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
    h = L.Embedding(vocab, d)(ids)
    h = h + L.Embedding(seq, d)(np.arange(seq)[None])
    for _ in range(blocks):
        a = L.LayerNormalization()(h)
        h = h + L.MultiHeadAttention(heads, d // heads)(a, a)
        m = L.LayerNormalization()(h)
        h = h + L.Dense(d)(L.Dense(4 * d, activation="gelu")(m))
    h = L.LayerNormalization()(h)
    return keras.Model(ids, L.Dense(10)(L.GlobalAveragePooling1D()(h)), name="transformer")


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def batch(name: str, size: int, seed: int = 0):
    """Random inputs and integer labels for model ``name``."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, size)
    if name == "mlp":
        return rng.normal(size=(size, 784)).astype("float32"), y
    if name == "cnn":
        return rng.normal(size=(size, 28, 28, 1)).astype("float32"), y
    return rng.integers(0, 1000, size=(size, 64)).astype("int32"), y
