"""KerasHub backbones, without and then with LoRA (``backbone.enable_lora(rank)``), against the
float64 loop oracle: per-example gradients, norms and clipped sums of tiny BERT, GPT-2 and
Gemma (their tied ``ReversibleEmbedding`` as the language-model head), Mistral (untied) and ViT
models built from constructor arguments (no presets, nothing downloaded), and every KerasHub RMS
normalization with a rule. Every layer with weights must take a rule (none generic, no residual
variables), and ``PerExample`` must see exactly the model's trainable variables: after
``enable_lora`` the adapters and what Keras still trains (the query and value biases)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from oracle import keras_loss, loop_gradients

import pergrad

keras_hub = pytest.importorskip("keras_hub", reason="needs keras_hub (pip install pergrad[hub])")

B, T, VOCAB, HIDDEN = 4, 8, 19, 16
LORA_RANK = 4
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Next-token loss: the labels of padded positions are -1 and leave the loss.
LM_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
hub = keras_hub.models


@pytest.fixture
def exact_float64(float64, monkeypatch):
    """float64 models whose float64 is float64 throughout. KerasHub computes some steps in
    float32 whatever the dtype policy (Gemma's, Llama's and Mistral's RMS normalizations, their
    SiLU gates, attention softmax layers built with ``dtype="float32"``): there the oracle and
    pergrad, which multiply in other orders, would agree to float32 precision only. Here
    ``ops.cast`` leaves float64 tensors float64 instead of casting them down, and
    :func:`_float64_layers` gives those float32 layers the float64 policy."""
    cast = keras.ops.cast

    def keep_float64(x, dtype):
        if (keras.backend.standardize_dtype(dtype) == "float32"
                and keras.backend.standardize_dtype(getattr(x, "dtype", "int32")) == "float64"):
            return x
        return cast(x, dtype)

    monkeypatch.setattr(keras.ops, "cast", keep_float64)
    # Keras's type promotion maps float64 to float32 (``result_type("float64", "float32")``
    # is "float32"), so off TensorFlow its LayerNormalization (JAX) and matmul (PyTorch)
    # compute a float64 model in float32: keep float64 there too.
    from keras.src.backend.common import dtypes
    monkeypatch.setattr(dtypes, "BIT64_TO_BIT32_DTYPE",
                        {k: v for k, v in dtypes.BIT64_TO_BIT32_DTYPE.items() if k != "float64"})


def _float64_layers(model) -> None:
    for layer in model._flatten_layers(include_self=False):
        if layer.dtype_policy.name == "float32":
            layer.dtype_policy = "float64"


def _assert_close(actual, expected, tol: float, scale: float, what: str) -> None:
    """``|actual - expected| <= tol (|expected| + scale)``. Unlike ``oracle.assert_close`` the
    tolerance stays ``tol`` on PyTorch: :func:`exact_float64` makes its float64 exact."""
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol,
                               atol=tol * scale, err_msg=what)


def _randomize_lora(model, seed: int) -> None:
    """Keras starts ``lora_kernel_b`` at zero, which would hide a wrong ``A`` gradient; 0.2
    keeps ``W + A B`` of the order of ``W`` (larger ones saturate the attention softmax)."""
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        if "lora_kernel" in v.path:
            v.assign(0.2 * rng.normal(size=v.shape).astype(v.dtype))


def _perturb_norms(backbone, seed: int) -> None:
    """Gemma's RMS scales start at 0 and Llama's at 1: random values test their gradients'
    dependence on the scale (none: the layer is affine in it) and their effect downstream."""
    rng = np.random.default_rng(seed)
    for v in backbone.weights:
        if v.path.endswith("/scale") or v.path.endswith("/gamma"):
            v.assign(np.asarray(v.numpy()) + 0.3 * rng.normal(size=v.shape).astype(v.dtype))


def _prepare(backbone):
    _float64_layers(backbone)
    _perturb_norms(backbone, 1)
    return backbone


def _tokens(rng, segments: bool = False) -> dict:
    """Token ids with right padding (lengths 3..T) and the padding mask."""
    lengths = rng.integers(3, T + 1, size=B)
    lengths[0] = T
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype("int32")
    ids = rng.integers(1, VOCAB, size=(B, T)).astype("int32") * mask
    x = {"token_ids": ids, "padding_mask": mask}
    if segments:
        x["segment_ids"] = (np.arange(T)[None, :] >= lengths[:, None] // 2).astype("int32") * mask
    return x


def _next_tokens(x: dict) -> np.ndarray:
    """Next-token labels: ``ids[t + 1]``, ``-1`` where position ``t + 1`` is padding or past
    the end."""
    ids, mask = x["token_ids"], x["padding_mask"]
    labels = np.full_like(ids, -1)
    labels[:, :-1] = np.where(mask[:, 1:] == 1, ids[:, 1:], -1)
    return labels


def bert_classifier(rng):
    """Token ids, segment ids and padding mask -> BERT -> Dense head on the pooled output."""
    backbone = _prepare(hub.BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                         hidden_dim=HIDDEN, intermediate_dim=32,
                                         max_sequence_length=16))
    inputs = backbone.input
    outputs = keras.layers.Dense(3, name="head")(backbone(inputs)["pooled_output"])
    return (keras.Model(inputs, outputs), backbone, SCCE, _tokens(rng, segments=True),
            rng.integers(0, 3, B))


def _causal_lm(backbone, rng):
    """``backbone -> backbone.token_embedding(h, reverse=True)``: logits from the (tied or
    untied) reverse embedding, a per-token next-token loss over the unpadded positions."""
    backbone = _prepare(backbone)
    inputs = backbone.input
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    x = _tokens(rng)
    return keras.Model(inputs, logits), backbone, LM_LOSS, x, _next_tokens(x)


def gpt2_lm(rng):
    return _causal_lm(hub.GPT2Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                       hidden_dim=HIDDEN, intermediate_dim=32,
                                       max_sequence_length=16), rng)


def gemma_lm(rng):
    return _causal_lm(hub.GemmaBackbone(vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
                                        num_key_value_heads=1, hidden_dim=HIDDEN,
                                        intermediate_dim=32, head_dim=8), rng)


def mistral_lm(rng):
    return _causal_lm(hub.MistralBackbone(vocabulary_size=VOCAB, num_layers=1,
                                          num_query_heads=2, num_key_value_heads=1,
                                          hidden_dim=HIDDEN, intermediate_dim=32), rng)


def vit_classifier(rng):
    """Images -> ViT -> Dense head on the class token's output."""
    # attention_dropout (inactive: training=False) keeps Keras's MultiHeadAttention off its
    # fused dot_product_attention, whose softmax runs in float32 on JAX.
    backbone = _prepare(hub.ViTBackbone(image_shape=(8, 8, 3), patch_size=4, num_layers=1,
                                        num_heads=2, hidden_dim=HIDDEN, mlp_dim=32,
                                        attention_dropout=0.1))
    inputs = backbone.input
    outputs = keras.layers.Dense(3, name="head")(backbone(inputs)[:, 0])
    return (keras.Model(inputs, outputs), backbone, SCCE, rng.normal(size=(B, 8, 8, 3)),
            rng.integers(0, 3, B))


# Llama is Mistral's architecture (its LlamaLayerNorm is tested below); GPT-2 and Gemma tie the
# embedding to the head, Mistral does not.
MODELS = {"bert": bert_classifier, "gpt2": gpt2_lm, "gemma": gemma_lm, "mistral": mistral_lm,
          "vit": vit_classifier}


def _assert_matches_oracle(model, loss, x, y) -> None:
    pex = pergrad.PerExample(model, loss)
    if keras.backend.backend() == "tensorflow":  # an eager compute is slow on JAX
        result = pex.compute(x, y)
        assert [id(v) for v in result.variables] == [id(v) for v in model.trainable_variables]
        assert all(f is not None and f.variable is v
                   for f, v in zip(result.forms, result.variables, strict=True))
    # Keras creates LoRA adapters in float32 whatever the dtype policy: their gradients, and
    # the norms and clip factors that include them, are float32-precise in the oracle and in
    # pergrad alike.
    tols = [1e-9 if keras.backend.standardize_dtype(v.dtype) == "float64" else 1e-6
            for v in model.trainable_variables]
    expected, _ = loop_gradients(model, keras_loss(loss), x, y)
    scale = max(np.max(np.abs(e)) for e in expected)
    grads = pex.gradients(x, y)
    assert len(grads) == len(model.trainable_variables)
    for g, e, v, tol in zip(grads, expected, model.trainable_variables, tols, strict=True):
        _assert_close(g, e, tol, scale, v.path)

    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    tol = max(tols)
    _assert_close(pex.norms(x, y), norms, tol, 0.0, "norms")

    clip = float(np.median(norms))
    summed, clip_norms = pex.clipped_sum(x, y, clip)
    factors = np.minimum(1.0, clip / norms)
    expected_sums = [np.tensordot(factors, e, axes=1) for e in expected]
    sum_scale = max(np.max(np.abs(e)) for e in expected_sums)
    for s, e, v in zip(summed, expected_sums, model.trainable_variables, strict=True):
        _assert_close(s, e, tol, sum_scale, f"clipped_sum {v.path}")
    _assert_close(clip_norms, norms, tol, 0.0, "clipped_sum norms")
    # Last, so that a wrong number is reported before a slow route.
    assert not pex.plan.generic and not pex.plan.residual, pex.plan.describe()


#: The decoder backbones with the largest graphs (25 s each on JAX) are slow checks; BERT, GPT-2
#: and ViT run by default.
SLOW_BACKBONES = ("gemma", "mistral")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow(
    reason="a decoder backbone's oracle with and without LoRA: ~25 s on JAX"))
    if name in SLOW_BACKBONES else name for name in sorted(MODELS)])
def test_backbone_matches_oracle_without_and_with_lora(exact_float64, rng, name):
    model, backbone, loss, x, y = MODELS[name](rng)
    _assert_matches_oracle(model, loss, x, y)

    backbone.enable_lora(LORA_RANK)
    _randomize_lora(backbone, 3)
    paths = [v.path for v in model.trainable_variables]
    assert sum("lora_kernel" in p for p in paths) == 4, paths  # query and value: A and B
    assert not any(p.endswith(("/kernel", "/embeddings", "/scale", "/gamma"))
                   for p in paths if not p.startswith("head/")), paths
    _assert_matches_oracle(model, loss, x, y)


def test_rms_normalizations_take_their_rule(exact_float64, rng):
    """Every KerasHub RMS normalization with a rule (Gemma's ``n (1 + scale)``, Llama's and
    its kin's ``n scale``), stacked with Dense layers between them, against the oracle."""
    from pergrad.rules.keras_hub import RMS_NORMALIZATION_CLASSES

    inputs = keras.Input((T, HIDDEN))
    h, norms = inputs, []
    for cls in RMS_NORMALIZATION_CLASSES:
        norm = cls(epsilon=1e-5)
        norms.append(norm)
        h = keras.layers.Dense(HIDDEN, activation="tanh")(norm(h))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    _float64_layers(model)
    _perturb_norms(model, 2)
    x, y = rng.normal(size=(B, T, HIDDEN)), rng.integers(0, 3, B)
    pex = pergrad.PerExample(model, SCCE)
    ruled = {id(layer) for layer, _ in pex.plan.ruled}
    assert all(id(norm) in ruled for norm in norms), pex.plan.describe()
    assert not pex.plan.generic and not pex.plan.residual, pex.plan.describe()

    expected, _ = loop_gradients(model, keras_loss(SCCE), x, y)
    scale = max(np.max(np.abs(e)) for e in expected)
    for g, e, v in zip(pex.gradients(x, y), expected, model.trainable_variables, strict=True):
        _assert_close(g, e, 1e-9, scale, v.path)
    norms_ = np.linalg.norm(np.concatenate([e.reshape(B, -1) for e in expected], 1), axis=1)
    _assert_close(pex.norms(x, y), norms_, 1e-9, 0.0, "norms")
