"""Dense and EinsumDense with LoRA on (``layer.enable_lora(rank)``): the layer computes
``x (W + s A B) + b`` with ``W`` frozen, and its rule gives ``A``'s and ``B``'s per-example
gradients as factored forms. Each is checked against the float64 loop oracle (gradients, norms,
dots, clipped sums) with random nonzero ``A`` and ``B`` (Keras starts ``B`` at zero), and the
rule, not the generic fallback, must handle the layer."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import zoo
from oracle import assert_close, keras_loss, loop_gradients
from rule_check import assert_rule_matches_oracle

import pergrad
from pergrad.rules.dense import dense_rule
from pergrad.rules.einsum_dense import einsum_dense_rule
from pergrad.rules.forms import Factored

L = keras.layers
B = 5


def _randomize_lora(layer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for v in (layer.lora_kernel_a, layer.lora_kernel_b):
        v.assign(rng.normal(size=v.shape).astype(v.dtype))


def _lora_model(input_shape, make_layer, rank, lora_alpha=None, head_lora=False):
    """``inputs -> layer (LoRA on) -> flatten -> Dense(3) head``; returns ``(model, layer)``."""
    inputs = keras.Input(input_shape)
    layer = make_layer()
    h = layer(inputs)
    head = L.Dense(3)
    outputs = head(L.Flatten()(h))
    model = keras.Model(inputs, outputs)
    layer.enable_lora(rank, lora_alpha=lora_alpha)
    _randomize_lora(layer, 1)
    if head_lora:
        head.enable_lora(2)
        _randomize_lora(head, 2)
    return model, layer


DENSE_CASES = {
    "2d": ((6,), dict(units=4), 2, None),
    "2d_no_bias_alpha": ((6,), dict(units=4, use_bias=False), 2, 5),
    "2d_activation": ((6,), dict(units=4, activation="tanh"), 4, None),
    "sequence": ((3, 5), dict(units=4), 2, 3),
    "sequence_activation_no_bias": ((3, 5), dict(units=4, activation="gelu", use_bias=False),
                                    4, None),
}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_dense_lora_matches_oracle(float64, rng, case):
    shape, kwargs, rank, alpha = DENSE_CASES[case]
    model, layer = _lora_model(shape, lambda: L.Dense(**kwargs), rank, alpha)
    x = rng.normal(size=(B, *shape))
    y = rng.integers(0, 3, B)
    assert_rule_matches_oracle(model, layer, dense_rule, x, y)


EINSUM_CASES = {
    # equation, output_shape, bias_axes, input shape, activation
    "dense_like": ("abc,cd->abd", (3, 4), "d", (3, 5), None),
    "attention_in": ("abc,cde->abde", (3, 2, 3), "de", (3, 5), "relu"),
    "attention_out": ("abcd,cde->abe", (3, 4), "e", (3, 2, 3), None),
    "grouped": ("abcd,cde->abce", (3, 2, 4), None, (3, 2, 5), None),
    "ellipsis": ("...b,bc->...c", 4, "c", (2, 3, 5), "tanh"),
}


@pytest.mark.parametrize("case", sorted(EINSUM_CASES))
def test_einsum_dense_lora_matches_oracle(float64, rng, case):
    equation, output_shape, bias_axes, shape, activation = EINSUM_CASES[case]
    model, layer = _lora_model(
        shape, lambda: L.EinsumDense(equation, output_shape, bias_axes=bias_axes,
                                     activation=activation), rank=2, lora_alpha=3,
        head_lora=True)
    x = rng.normal(size=(B, *shape))
    y = rng.integers(0, 3, B)
    assert_rule_matches_oracle(model, layer, einsum_dense_rule, x, y)


def test_lora_kernel_last_letter_not_output_takes_the_generic_rule(float64, rng):
    """LoRA factors the kernel along its last axis; when that axis is contracted the rule
    does not apply and the generic rule (still exact) takes the layer."""
    model, layer = _lora_model((3, 5), lambda: L.EinsumDense("abc,dc->abd", (3, 4)), rank=2)
    pex = pergrad.PerExample(model, zoo.SCCE)
    assert [lay.name for lay in pex.plan.generic] == [layer.name]
    x, y = rng.normal(size=(B, 3, 5)), rng.integers(0, 3, B)
    expected, _ = loop_gradients(model, keras_loss(zoo.SCCE), x, y)
    scale = max(np.max(np.abs(e)) for e in expected)
    for g, e, v in zip(pex.gradients(x, y), expected, model.trainable_variables, strict=True):
        assert_close(g, e, atol=1e-6 * scale, what=v.path)


def test_variables_are_the_trainable_ones_after_enable_lora(float64, rng):
    """Only what Keras trains gets a per-example gradient: LoRA's A and B and the biases, never
    the frozen kernels; A and B come as factored forms."""
    inputs = keras.Input((3, 5))
    proj = L.EinsumDense("abc,cde->abde", (3, 2, 3), bias_axes="de")
    dense = L.Dense(4, activation="relu")
    h = dense(L.Flatten()(proj(inputs)))
    model = keras.Model(inputs, L.Dense(3)(h))
    for layer in (proj, dense):
        layer.enable_lora(2)
        _randomize_lora(layer, 3)
    frozen = {id(layer._kernel) for layer in (proj, dense)}
    assert not frozen & {id(v) for v in model.trainable_variables}

    pex = pergrad.PerExample(model, zoo.SCCE)
    assert not pex.plan.generic, pex.plan.describe()
    result = pex.compute(rng.normal(size=(B, 3, 5)), rng.integers(0, 3, B))
    assert [id(v) for v in result.variables] == [id(v) for v in model.trainable_variables]
    assert all(f is not None and f.variable is v
               for f, v in zip(result.forms, result.variables, strict=True))
    for layer in (proj, dense):
        for v in (layer.lora_kernel_a, layer.lora_kernel_b):
            k = [id(w) for w in result.variables].index(id(v))
            assert isinstance(result.forms[k], Factored), v.path
    grads = pex.gradients(rng.normal(size=(B, 3, 5)), rng.integers(0, 3, B))
    assert [tuple(g.shape) for g in grads] == [(B, *v.shape) for v in model.trainable_variables]


def test_lora_with_unknown_sequence_length_matches_oracle(float64, rng):
    """A retrace for a second sequence length leaves the positions unknown to the rules
    (TensorFlow's ``reduce_retracing``): the LoRA forms then reshape with ``-1`` positions."""
    inputs = keras.Input((None, 5))
    dense = L.Dense(4, activation="tanh")
    proj = L.EinsumDense("abc,cde->abde", (None, 2, 3), bias_axes="de")
    h = L.GlobalAveragePooling1D()(L.Reshape((-1, 6))(proj(dense(inputs))))
    model = keras.Model(inputs, L.Dense(3)(h))
    for layer in (dense, proj):
        layer.enable_lora(2, lora_alpha=3)
        _randomize_lora(layer, 4)
    pex = pergrad.PerExample(model, zoo.SCCE)
    assert not pex.plan.generic, pex.plan.describe()
    for t in (3, 4):
        pex.norms(rng.normal(size=(B, t, 5)), rng.integers(0, 3, B))
    x, y = rng.normal(size=(B, 2, 5)), rng.integers(0, 3, B)
    expected, _ = loop_gradients(model, keras_loss(zoo.SCCE), x, y)
    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    assert_close(pex.norms(x, y), norms, what="norms")
    summed, _ = pex.clipped_sum(x, y, float(np.median(norms)))
    factors = np.minimum(1.0, np.median(norms) / norms)
    for s, e, v in zip(summed, expected, model.trainable_variables, strict=True):
        assert_close(s, np.tensordot(factors, e, axes=1), what=f"clipped_sum {v.path}")
