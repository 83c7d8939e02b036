"""Benchmark: the models people fine-tune and train with DP, on the backend Keras runs.

KerasHub transformers built from constructor arguments (tiny configurations; no weights are
downloaded): a BERT classifier, a GPT-2 causal LM (per-token cross-entropy through the tied
``ReversibleEmbedding``), a Gemma causal LM, each with and without ``backbone.enable_lora(4)``
(only the adapters and the task head trained, as KerasHub sets it up); and two
``keras.applications`` CNNs (``weights=None``) made DP-ready by
:func:`pergrad.keras.replace_batch_normalization`.

For each model it prints the median time of the model's own batch gradient (the backend's
gradient of the summed loss: ``tf.GradientTape``, ``jax.grad`` or ``torch.autograd``, through
the engine's ``batch_gradient``) and, as ratios to it, pergrad's per-example ``norms`` and
``clipped_sum``; and the median time of a plain Keras training step (SGD, ``train_on_batch``)
and, as a ratio to it, a ``PerExampleModel(dp_mean)`` step of the same model; on JAX, when
``jax-privacy`` is installed, also JAX Privacy 2.0's ``keras_api.make_private`` step of the same
model (its per-example gradients by ``vmap`` of the whole model). All calls of one model are
timed in turn, round after round, in the same process; nothing here asserts on a timing.

    python benchmarks/bench_real_models.py [--quick] [--models bert_lora,gemma_lora]
    pergrad bench --suites real-models              # the same, from the command line
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import keras
import numpy as np

import pergrad
from pergrad import aggregate
from pergrad.bench.timing import alternating_medians
from pergrad.engine.losses import per_example_loss
from pergrad.engine.strategies import engine_module
from pergrad.keras import PerExampleModel, replace_batch_normalization

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
VOCABULARY, TOKENS, WIDTH, HEADS, FFN, LAYERS, RANK = 1000, 32, 64, 4, 128, 2, 4
IMAGE = (64, 64, 3)


def _keras_hub():
    try:
        import keras_hub
    except ImportError as error:  # a test/benchmark extra, not a dependency of pergrad
        raise ImportError("the real-models benchmark needs keras-hub: pip install "
                          "'pergrad[test]' (or pip install keras-hub)") from error
    return keras_hub


def _tokens(batch: int, rng: np.random.Generator, segments: bool = False) -> dict:
    x = {"token_ids": rng.integers(1, VOCABULARY, (batch, TOKENS)).astype("int32"),
         "padding_mask": np.ones((batch, TOKENS), "int32")}
    if segments:
        x["segment_ids"] = np.zeros((batch, TOKENS), "int32")
    return x


def bert(lora: bool, batch: int, rng: np.random.Generator):
    """A 2-layer BERT text classifier (2 classes): the [CLS] output, a Dense head."""
    hub = _keras_hub()
    backbone = hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=LAYERS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=FFN, dropout=0.0, max_sequence_length=TOKENS)
    model = hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None, dropout=0.0)
    if lora:
        backbone.enable_lora(RANK)
    return model, _tokens(batch, rng, segments=True), rng.integers(0, 2, batch).astype("int32")


def gpt2(lora: bool, batch: int, rng: np.random.Generator):
    """A 2-layer GPT-2 causal LM: next-token cross-entropy at every position, the logits from
    the token embedding used in reverse (tied weights)."""
    hub = _keras_hub()
    backbone = hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=LAYERS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=FFN, dropout=0.0, max_sequence_length=TOKENS)
    model = hub.models.GPT2CausalLM(backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(RANK)
    x = _tokens(batch, rng)
    return model, x, np.roll(x["token_ids"], -1, axis=1)


def gemma(lora: bool, batch: int, rng: np.random.Generator):
    """A 2-layer Gemma causal LM (grouped-query attention, rotary positions, RMS norms, a gated
    GELU MLP, tied embedding)."""
    hub = _keras_hub()
    backbone = hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY, num_layers=LAYERS, num_query_heads=HEADS,
        num_key_value_heads=1, hidden_dim=WIDTH, intermediate_dim=FFN,
        head_dim=WIDTH // HEADS)
    model = hub.models.GemmaCausalLM(backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(RANK)
    x = _tokens(batch, rng)
    return model, x, np.roll(x["token_ids"], -1, axis=1)


def _application(build: Callable[..., keras.Model], batch: int, rng: np.random.Generator):
    model = replace_batch_normalization(
        build(weights=None, input_shape=IMAGE, classes=10), verbose=False)
    x = rng.uniform(0, 255, (batch, *IMAGE)).astype("float32")
    return model, x, rng.integers(0, 10, batch).astype("int32")


def mobilenet_v3_small(lora: bool, batch: int, rng: np.random.Generator):
    """``keras.applications.MobileNetV3Small`` after ``replace_batch_normalization``."""
    return _application(keras.applications.MobileNetV3Small, batch, rng)


def efficientnet_v2_b0(lora: bool, batch: int, rng: np.random.Generator):
    """``keras.applications.EfficientNetV2B0`` after ``replace_batch_normalization``."""
    return _application(keras.applications.EfficientNetV2B0, batch, rng)


#: name -> (builder, LoRA rank 4 on the backbone)
MODELS = {
    "bert": (bert, False), "bert_lora": (bert, True),
    "gpt2": (gpt2, False), "gpt2_lora": (gpt2, True),
    "gemma": (gemma, False), "gemma_lora": (gemma, True),
    "mobilenet_v3_small": (mobilenet_v3_small, False),
    "efficientnet_v2_b0": (efficientnet_v2_b0, False),
}
DEFAULT_BATCH = 32
#: the calls ``skip`` may leave out (the two baselines are always timed)
SKIPPABLE = ("norms", "clipped_sum", "dp_mean step", "jax_privacy step")


def _built(name: str, batch: int, seed: int = 0):
    builder, lora = MODELS[name]
    keras.utils.set_random_seed(seed)
    return builder(lora, batch, np.random.default_rng(seed))


def _engine_calls(name: str, batch: int, skip: tuple[str, ...] = ()
                  ) -> dict[str, Callable[[], object]]:
    model, x, y = _built(name, batch)
    model(x)
    pex = pergrad.PerExample(model, LOSS)
    engine, loss_fn = engine_module(), per_example_loss(LOSS)
    batch_gradient = pex.compiled(
        "batch_gradient",
        lambda x, y: engine.batch_gradient(model, loss_fn, x, y, None, False))
    calls = {"batch gradient": lambda: batch_gradient(x, y),
             "norms": lambda: pex.norms(x, y),
             "clipped_sum": lambda: pex.clipped_sum(x, y, 1.0)}
    return {label: call for label, call in calls.items() if label not in skip}


#: JAX Privacy's ``microbatch_size`` per model (``None``: the whole batch in one ``vmap``). On the
#: CNNs its whole-batch step asked XLA for 68 GB at batch 32 (out of memory on 24 GB); 4 examples
#: at a time fit.
JAX_PRIVACY_MICROBATCH = {"mobilenet_v3_small": 4, "efficientnet_v2_b0": 4}


def _jax_privacy():
    """JAX Privacy's Keras API where it can run (the JAX backend, the package installed)."""
    if keras.backend.backend() != "jax":
        return None
    try:
        from jax_privacy import keras_api
    except ImportError:
        return None
    return keras_api


def _step_calls(name: str, batch: int, skip: tuple[str, ...] = ()
                ) -> dict[str, Callable[[], object]]:
    keras_api = _jax_privacy()
    variants = ("keras step", "dp_mean step") + (("jax_privacy step",) if keras_api else ())
    variants = tuple(v for v in variants if v not in skip)
    calls = {}
    for variant in variants:
        model, x, y = _built(name, batch)
        if variant == "dp_mean step":
            model = PerExampleModel(model, aggregate.dp_mean(1.0, 1.1, seed=0))
        elif variant == "jax_privacy step":
            config = keras_api.DPKerasConfig(
                epsilon=8.0, delta=1e-5, clipping_norm=1.0, batch_size=batch,
                gradient_accumulation_steps=1, train_steps=1000, train_size=1000 * batch,
                noise_multiplier=1.1, microbatch_size=JAX_PRIVACY_MICROBATCH.get(name))
            model = keras_api.make_private(model, config)
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=LOSS)
        calls[variant] = lambda m=model, x=x, y=y: m.train_on_batch(x, y)
    return calls


def run(quick: bool = False, models: tuple[str, ...] | None = None,
        batch_size: int | None = None, echo: bool = False,
        skip: tuple[str, ...] = (), rounds: int | None = None) -> list[dict]:
    """One row per model: median seconds of the batch gradient and the plain Keras step, and
    pergrad's norms, clipped sum and ``dp_mean`` step as ratios to them. ``quick``: batch 8,
    3 rounds, the two LoRA models (a smoke run). ``echo``: print each row once measured.
    ``rounds``: alternating rounds per median (default 10, 3 when ``quick``).
    ``skip``: labels of calls not to time (``"norms"``, ``"clipped_sum"``, ``"dp_mean step"``,
    ``"jax_privacy step"``; the two baselines are always timed); their cells print ``-``."""
    unknown = set(skip) - set(SKIPPABLE)
    if unknown:
        raise ValueError(f"skip: unknown labels {sorted(unknown)}")
    models = models or (("bert_lora", "gemma_lora") if quick else tuple(MODELS))
    batch = batch_size or (8 if quick else DEFAULT_BATCH)
    rounds = rounds or (3 if quick else 10)
    rows = []
    for name in models:
        engine = alternating_medians(_engine_calls(name, batch, skip), rounds)
        steps = alternating_medians(_step_calls(name, batch, skip), rounds)

        def ratio(medians, label, base):
            return medians[label] / medians[base] if label in medians else None

        rows.append({"model": name, "backend": keras.backend.backend(), "batch": batch,
                     "batch_gradient_s": engine["batch gradient"],
                     "norms": ratio(engine, "norms", "batch gradient"),
                     "clipped_sum": ratio(engine, "clipped_sum", "batch gradient"),
                     "keras_step_s": steps["keras step"],
                     "dp_step": ratio(steps, "dp_mean step", "keras step"),
                     "jax_privacy_step": ratio(steps, "jax_privacy step", "keras step")})
        if echo:
            print(markdown(rows[-1:], header=len(rows) == 1), flush=True)
    return rows


def markdown(rows: list[dict], header: bool = True) -> str:
    lines = (["| model | backend | batch | batch gradient (ms) | norms | clipped sum "
              "| Keras step (ms) | dp_mean step | JAX Privacy step |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"] if header else [])
    def cell(value):
        return "-" if value is None else f"{value:.2f}x"

    for r in rows:
        lines.append(f"| {r['model']} | {r['backend']} | {r['batch']} | "
                     f"{1000 * r['batch_gradient_s']:.1f} | {cell(r['norms'])} | "
                     f"{cell(r['clipped_sum'])} | {1000 * r['keras_step_s']:.1f} | "
                     f"{cell(r['dp_step'])} | {cell(r.get('jax_privacy_step'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, 3 rounds, LoRA models")
    parser.add_argument("--models", default=None,
                        help=f"comma list from {','.join(MODELS)} (default: all)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"batch size (default {DEFAULT_BATCH}; --quick: 8)")
    parser.add_argument("--skip", default="",
                        help="comma list of calls not to time, from norms,clipped_sum,"
                             "dp_mean step,jax_privacy step")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternating rounds per median (default 10; --quick: 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    skip = tuple(label for label in args.skip.split(",") if label)
    models = tuple(m for m in (args.models or "").split(",") if m) or None
    unknown = [m for m in models or () if m not in MODELS]
    if unknown or (args.batch_size is not None and args.batch_size < 1):
        parser.error(f"unknown models {unknown}" if unknown else "--batch-size must be positive")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be positive")
    unknown_skip = set(skip) - set(SKIPPABLE)
    if unknown_skip:
        parser.error(f"--skip: unknown labels {sorted(unknown_skip)}; from {','.join(SKIPPABLE)}")
    rows = run(quick=args.quick, models=models, batch_size=args.batch_size, echo=True, skip=skip,
               rounds=args.rounds)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0
