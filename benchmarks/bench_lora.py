"""LoRA fine-tuning: per-example norms and clipped sums of a tiny transformer whose Dense and
EinsumDense layers run with ``enable_lora(4)`` (as KerasHub's ``backbone.enable_lora`` sets
them up: the base weights frozen, the adapters trained), on TensorFlow.

Prints the median time of one batch gradient and, as ratios to it (measured in the same run,
timed in turn round after round), pergrad's ``norms``, ``clipped_sum`` and ``gradients`` with
the LoRA layers on their factored rules (``rules``) and on the generic per-layer VJPs they
took before the rules handled LoRA (``generic``: the rules re-registered with the old
``applies=plain_weights`` for this measurement only).

    python benchmarks/bench_lora.py [--batch 32] [--tokens 32] [--width 64] [--ffn 128]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import pergrad  # noqa: E402
from pergrad.bench.timing import alternating_medians  # noqa: E402
from pergrad.rules import _RULES, plain_weights, register  # noqa: E402

L = keras.layers
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
VOCAB, WIDTH, HEADS, FFN, BLOCKS, CLASSES, RANK = 1000, 64, 4, 128, 2, 2, 4


def lora_transformer(tokens: int, width: int = WIDTH, ffn: int = FFN) -> keras.Model:
    """Embedding, ``BLOCKS`` pre-norm blocks (MultiHeadAttention, a GELU MLP), mean pooling and
    a Dense head. LoRA (rank 4) on the attention's query and value projections (KerasHub's
    default targets) and on both MLP layers; embedding and normalization frozen; the head
    trained."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((tokens,), dtype="int32")
    h = L.Embedding(VOCAB, width, trainable=False)(inputs)
    targets = []
    for _ in range(BLOCKS):
        attention = L.MultiHeadAttention(HEADS, width // HEADS)
        n = L.LayerNormalization(trainable=False)(h)
        h = h + attention(n, n)
        up, down = L.Dense(ffn, activation="gelu"), L.Dense(width)
        h = h + down(up(L.LayerNormalization(trainable=False)(h)))
        targets += [attention, up, down]
    outputs = L.Dense(CLASSES)(L.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(0)
    for layer in targets:
        parts = ([layer._query_dense, layer._value_dense]
                 if isinstance(layer, L.MultiHeadAttention) else [layer])
        if isinstance(layer, L.MultiHeadAttention):  # KerasHub freezes what it does not adapt
            for frozen in (layer._key_dense, layer._output_dense):
                frozen.trainable = False
        for part in parts:
            part.enable_lora(RANK)
            b = part.lora_kernel_b  # Keras starts B at zero: give it values as after training
            b.assign(rng.normal(scale=0.02, size=b.shape).astype(b.dtype))
    return model


@contextlib.contextmanager
def lora_on_generic_rule():
    """Dense and EinsumDense with the ``applies`` they had before their rules handled LoRA."""
    saved = {cls: _RULES[cls] for cls in (L.Dense, L.EinsumDense)}
    try:
        for cls, rule in saved.items():
            def old_applies(layer, now=rule.applies):
                return plain_weights(layer) and (now is None or now(layer))
            register(cls, splits_activation=rule.splits_activation, check_call=rule.check_call,
                     applies=old_applies, forward=rule.forward)(rule.fn)
        yield
    finally:
        _RULES.update(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--ffn", type=int, default=FFN)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)

    model = lora_transformer(args.tokens, args.width, args.ffn)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.integers(0, VOCAB, (args.batch, args.tokens)), tf.int32)
    y = tf.constant(rng.integers(0, CLASSES, args.batch), tf.int32)
    variables = model.trainable_variables
    params = sum(int(np.prod(v.shape)) for v in variables)
    frozen = sum(int(np.prod(v.shape)) for v in model.non_trainable_variables)

    @tf.function
    def batch_gradient(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(LOSS(y, model(x, training=False)))
        return tape.gradient(loss, variables)

    ruled = pergrad.PerExample(model, LOSS)
    with lora_on_generic_rule():
        generic = pergrad.PerExample(model, LOSS)
        generic_plan = generic.plan
    for name, pex in (("rules", ruled), ("generic", generic)):
        plan = pex.plan.describe()
        print(f"{name}: {sum(how == 'rule' for *_, how in plan)} layers on rules, "
              f"{sum(how == 'generic' for *_, how in plan)} generic")
    assert generic_plan.generic and not ruled.plan.generic

    calls = {"batch gradient": lambda: batch_gradient(x, y)}
    for name, pex in (("rules", ruled), ("generic", generic)):
        calls[f"norms ({name})"] = lambda p=pex: p.norms(x, y)
        calls[f"clipped_sum ({name})"] = lambda p=pex: p.clipped_sum(x, y, 1.0)
        calls[f"gradients ({name})"] = lambda p=pex: p.gradients(x, y)
    # Same numbers either way (the generic rule is exact too).
    np.testing.assert_allclose(ruled.norms(x, y), generic.norms(x, y), rtol=1e-4)
    medians = alternating_medians(calls, args.rounds)

    print(f"\nLoRA transformer (rank {RANK}, {BLOCKS} blocks, width {args.width}, MLP {args.ffn}), "
          f"batch {args.batch}, "
          f"{args.tokens} tokens, TensorFlow {tf.__version__}, Keras {keras.__version__}: "
          f"{params} trainable parameters, {frozen} frozen")
    print("| computation | ms | x batch gradient |")
    print("|---|---:|---:|")
    base = medians["batch gradient"]
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
