"""KerasHub backbones: per-example norms and clipped sums of tiny BERT, GPT-2, Gemma, Mistral and
ViT models, without and with LoRA (``backbone.enable_lora(4)``), on TensorFlow in float32.

Prints, per model, the median time of one batch gradient (a ``tf.function`` over a
``GradientTape`` of the mean loss) and, as ratios to it (measured in the same run, timed in
turn round after round), pergrad's ``norms`` and ``clipped_sum`` with every layer on its rule
(``rules``) and as before ``pergrad.rules.keras_hub`` and the ``ReversibleEmbedding`` rule
existed and before the plan found the adapters inside the layers ``enable_lora`` freezes
(``before``: those rules unregistered and the old plan, for this measurement only; the adapters
then became residual variables with a per-example Jacobian). Also prints which layers take the
generic rule and how many variables are residual.

    python benchmarks/bench_keras_hub.py [--batch 16] [--tokens 16] [--vocabulary 50]
        [--width 16] [--models bert gpt2 gemma mistral vit]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import pergrad  # noqa: E402
import pergrad.rules.keras_hub as hub_rules  # noqa: E402
from pergrad.bench.timing import alternating_medians  # noqa: E402
from pergrad.engine import plan as plan_module  # noqa: E402
from pergrad.rules import _RULES  # noqa: E402

LM_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@contextlib.contextmanager
def before():
    """No KerasHub or ReversibleEmbedding rules, and the plan's old test for a layer to visit
    (``layer.trainable_variables``, empty for the frozen parents of LoRA targets)."""
    classes = [keras.layers.ReversibleEmbedding, hub_rules._POSITION, hub_rules._VIT,
               *hub_rules.RMS_NORMALIZATION_CLASSES]
    saved = {cls: _RULES.pop(cls) for cls in classes if cls in _RULES}
    has_trainable = plan_module._has_trainable
    plan_module._has_trainable = lambda layer: bool(layer.trainable_variables)
    try:
        yield
    finally:
        _RULES.update(saved)
        plan_module._has_trainable = has_trainable


def build(name: str, args, rng):
    """``(model, backbone, loss, x, y)``: a Dense head on BERT's pooled output or ViT's class
    token; the backbone's own ``token_embedding(h, reverse=True)`` as the head of GPT-2, Gemma
    and Mistral, with a next-token loss over the unpadded positions."""
    hub, b, t, v, w = keras_hub.models, args.batch, args.tokens, args.vocabulary, args.width
    lengths = rng.integers(t // 2, t + 1, size=b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype("int32")
    ids = rng.integers(1, v, size=(b, t)).astype("int32") * mask
    tokens = {"token_ids": ids, "padding_mask": mask}
    common = dict(num_layers=2, hidden_dim=w, intermediate_dim=2 * w)
    if name in ("bert", "vit"):
        if name == "bert":
            backbone = hub.BertBackbone(vocabulary_size=v, num_heads=2, max_sequence_length=t,
                                        **common)
            x = {**tokens, "segment_ids": np.zeros_like(ids)}
        else:
            backbone = hub.ViTBackbone(image_shape=(16, 16, 3), patch_size=4, num_layers=2,
                                       num_heads=2, hidden_dim=w, mlp_dim=2 * w)
            x = rng.normal(size=(b, 16, 16, 3)).astype("float32")
        features = backbone(backbone.input)
        features = features["pooled_output"] if name == "bert" else features[:, 0]
        model = keras.Model(backbone.input, keras.layers.Dense(3)(features))
        return model, backbone, SCCE, x, rng.integers(0, 3, b)
    if name == "gpt2":
        backbone = hub.GPT2Backbone(vocabulary_size=v, num_heads=2, max_sequence_length=t,
                                    **common)
    else:
        cls = hub.GemmaBackbone if name == "gemma" else hub.MistralBackbone
        extra = {"head_dim": w // 2} if name == "gemma" else {}
        backbone = cls(vocabulary_size=v, num_query_heads=2, num_key_value_heads=1, **common,
                       **extra)
    model = keras.Model(backbone.input,
                        backbone.token_embedding(backbone(backbone.input), reverse=True))
    y = np.full_like(ids, -1)
    y[:, :-1] = np.where(mask[:, 1:] == 1, ids[:, 1:], -1)
    return model, backbone, LM_LOSS, tokens, y


def measure(name: str, lora: bool, args) -> str:
    """One table row: the batch gradient, and the ratios to it."""
    keras.utils.set_random_seed(0)
    model, backbone, loss, x, y = build(name, args, np.random.default_rng(0))
    if lora:
        backbone.enable_lora(4)
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.convert_to_tensor(y)
    mean_loss = type(loss).from_config(loss.get_config())
    variables = model.trainable_variables

    @tf.function
    def batch_gradient(x, y):
        with tf.GradientTape() as tape:
            value = mean_loss(y, model(x))
        return tape.gradient(value, variables)

    ruled = pergrad.PerExample(model, loss)
    assert not ruled.plan.generic and not ruled.plan.residual, ruled.plan.describe()
    with before():
        old = pergrad.PerExample(model, loss)
        old_plan = old.plan
    calls = {"batch": lambda: batch_gradient(x, y)}
    for label, pex in (("rules", ruled), ("before", old)):
        calls[f"norms {label}"] = lambda p=pex: p.norms(x, y)
        calls[f"clipped {label}"] = lambda p=pex: p.clipped_sum(x, y, 1.0)
    np.testing.assert_allclose(ruled.norms(x, y), old.norms(x, y), rtol=1e-4)
    medians = alternating_medians(calls, args.rounds)
    base = medians["batch"]
    generic = sorted({type(layer).__name__ for layer in old_plan.generic})
    return (f"| {name} | {'yes' if lora else 'no'} | {base * 1e3:.1f} ms | "
            f"{medians['norms rules'] / base:.2f}x | {medians['clipped rules'] / base:.2f}x | "
            f"{medians['norms before'] / base:.2f}x | {medians['clipped before'] / base:.2f}x | "
            f"{', '.join(generic) or '-'}; {len(old_plan.residual)} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--vocabulary", type=int, default=50)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2", "gemma", "mistral", "vit"])
    args = parser.parse_args(argv)

    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, KerasHub "
          f"{keras_hub.__version__}; batch {args.batch}, {args.tokens} tokens, vocabulary "
          f"{args.vocabulary}, width {args.width}, 2 layers, float32")
    print("| model | LoRA | batch gradient | norms | clipped sum | before: norms | before: "
          "clipped sum | before: generic layers, residual variables |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for name in args.models:
        for lora in (False, True):
            print(measure(name, lora, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
