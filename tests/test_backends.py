"""What every backend must do alike beyond the oracle: compile once, follow weight updates,
refuse what mixes examples, and say clearly what is not ported."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import zoo
from oracle import assert_close, keras_loss, loop_gradients

import pergrad
from pergrad import backend


def _flat_norms(grads) -> np.ndarray:
    return np.linalg.norm(np.concatenate([g.reshape(len(g), -1) for g in grads], axis=1), axis=1)


def test_new_weights_are_read_without_retracing(float64):
    """The compiled computation reads the variables at every call: after set_weights the norms
    follow the new weights (checked against the oracle), and nothing is traced again."""
    case = zoo.conv2d(strides=2, padding="same")
    pex = pergrad.PerExample(case.model, case.loss)
    before = np.asarray(pex.norms(case.x, case.y))
    rng = np.random.default_rng(3)
    case.model.set_weights([w + 0.3 * rng.normal(size=w.shape) for w in case.model.get_weights()])
    after = np.asarray(pex.norms(case.x, case.y))
    expected, _ = loop_gradients(case.model, keras_loss(case.loss), case.x, case.y)
    assert_close(after, _flat_norms(expected), what="norms after set_weights")
    assert not np.allclose(before, after)
    # PyTorch runs eagerly: nothing is traced, ever.
    assert pex.trace_counts["norms"] == (0 if backend.is_torch() else 1)


def test_a_new_batch_size_traces_once_more(float64):
    case = zoo.mlp()
    pex = pergrad.PerExample(case.model, case.loss)
    for _ in range(2):
        pex.norms(case.x, case.y)
        pex.norms(case.x[:3], case.y[:3])
    assert pex.trace_counts["norms"] <= 2


def test_batch_normalization_in_training_mode_is_refused(float64):
    case = zoo.batch_norm_inference()
    pex = pergrad.PerExample(case.model, case.loss, training=True)
    with pytest.raises(pergrad.MixesExamplesError, match="batch_normalization"):
        pex.norms(case.x, case.y)


def test_check_finds_a_loss_that_mixes_examples(float64):
    case = zoo.mlp()

    def centered(y_true, y_pred):  # subtracts the batch mean: example i sees every example
        per_example = keras.losses.sparse_categorical_crossentropy(y_true, y_pred,
                                                                   from_logits=True)
        return per_example - keras.ops.mean(per_example)

    pex = pergrad.PerExample(case.model, centered)
    with pytest.raises(pergrad.MixesExamplesError):
        pex.check(case.x, case.y)


def test_dropout_draws_fresh_masks_and_advances_its_seed(float64):
    """Training mode with a Dropout layer between ruled layers: every call draws a new mask
    (the seed state the forward pass wrote is kept), as Keras's own call would."""
    inputs = keras.Input((6,))
    h = keras.layers.Dropout(0.5, seed=1)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x, y = np.random.default_rng(0).normal(size=(5, 6)), np.arange(5) % 3
    pex = pergrad.PerExample(model, zoo.SCCE, training=True)
    seeds = [np.asarray(v).copy() for v in model.non_trainable_variables]
    first, second = np.asarray(pex.norms(x, y)), np.asarray(pex.norms(x, y))
    assert not np.allclose(first, second)
    assert any(not np.array_equal(a, np.asarray(v))
               for a, v in zip(seeds, model.non_trainable_variables, strict=True))


def test_clipped_sum_inside_a_compiled_step_of_ones_own(float64):
    """``compute`` is traceable inside the user's own compiled function: ``PerExample.compiled``
    wraps a custom body (a clipped mean) and matches the oracle."""
    case = zoo.embedding()
    pex = pergrad.PerExample(case.model, case.loss)
    x, y, _ = pex.prepare(case.x, case.y)

    def clipped_mean(x, y):
        result = pex.compute(x, y)
        factors = keras.ops.minimum(1.0, 0.5 / result.norms())
        return [s / 5.0 for s in result.weighted_sum(factors)]

    got = pex.compiled("clipped_mean", clipped_mean)(x, y)
    expected, _ = loop_gradients(case.model, keras_loss(case.loss), case.x, case.y)
    factors = np.minimum(1.0, 0.5 / _flat_norms(expected))
    for g, e in zip(got, expected, strict=True):
        assert_close(g, np.tensordot(factors, e, axes=1) / 5.0)


@pytest.mark.skipif(not backend.is_jax(), reason="JAX's unported parts; PyTorch's are tested "
                    "by test_parts_not_ported_to_torch_say_so, TensorFlow runs every part")
def test_parts_not_yet_ported_say_so():
    model = zoo.mlp().model
    with pytest.raises(NotImplementedError, match="TensorFlow backend only.*docs/backends.md"):
        pergrad.keras.fit_distributed(model)


@pytest.mark.skipif(not backend.is_torch(), reason="the parts not ported to PyTorch")
def test_parts_not_ported_to_torch_say_so():
    """On PyTorch everything but tf.distribute's fit_distributed is ported: it refuses to run,
    naming the backend, never running silently wrong."""
    model = zoo.mlp().model
    with pytest.raises(NotImplementedError, match="'torch'"):
        pergrad.keras.fit_distributed(model, np.zeros((2, 6)), np.zeros(2), batch_size=2,
                                      epochs=1, checkpoint_dir="unused")


def test_an_unsupported_backend_is_named(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    with pytest.raises(NotImplementedError, match="'numpy'.*KERAS_BACKEND=jax"):
        backend.require_supported("pergrad's engine", backend.ENGINE_SUPPORTED)
    with pytest.raises(NotImplementedError, match="pergrad.jacobian runs on .*'numpy'"):
        backend.require_supported("pergrad.jacobian")
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    assert backend.require_supported("pergrad's engine", backend.ENGINE_SUPPORTED) == "torch"
    assert backend.require_supported("pergrad.jacobian") == "torch"


def test_recurrent_layers_in_training_mode_match_the_oracle(float64):
    """GRU and LSTM cells own a seed generator even without dropout; in training mode the JAX
    engine replays them on the batch with the state they ran with: exact."""
    case = zoo.lstm()
    expected, _ = loop_gradients(case.model, keras_loss(case.loss), case.x, case.y,
                                 training=True)
    got = pergrad.PerExample(case.model, case.loss, training=True).gradients(case.x, case.y)
    scale = max(np.max(np.abs(e)) for e in expected)
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e, atol=1e-6 * scale)


@pytest.mark.parametrize("seed", [7, None])
def test_dropout_inside_a_generic_layer_is_exact_for_the_mask_drawn(seed, float64):
    """An LSTM with dropout in training mode: the per-example gradients of one call add up to
    the batch gradient of that same call (same masks: the seed state from before the call, and
    without a seed on PyTorch, torch's generators as they were, which Keras's dropout draws
    from there)."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4, 3))
    h = keras.layers.LSTM(5, dropout=0.4, recurrent_dropout=0.3, seed=seed)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x, y = np.random.default_rng(1).normal(size=(5, 4, 3)), np.arange(5) % 3
    seeds = [keras.ops.convert_to_numpy(v).copy() for v in model.non_trainable_variables]
    generators = backend.native().generator_state()
    grads = pergrad.PerExample(model, zoo.SCCE, training=True).gradients(x, y)
    values = [v.value for v in model.trainable_variables]

    def batch_loss(values):
        with backend.native().replaying_generators(generators):
            out, _ = model.stateless_call(values, seeds, x, training=True)
        return keras.ops.sum(zoo.SCCE.call(y, out))

    if backend.is_jax():
        import jax
        expected = jax.grad(batch_loss)(values)
    elif backend.is_torch():
        import torch
        values = [v.detach().clone().requires_grad_() for v in values]
        with torch.enable_grad():
            expected = torch.autograd.grad(batch_loss(values), values)
    else:
        import tensorflow as tf
        values = [tf.convert_to_tensor(v) for v in values]
        with tf.GradientTape() as tape:
            tape.watch(values)
            total = batch_loss(values)
        expected = tape.gradient(total, values)
    for g, e in zip(grads, expected, strict=True):
        assert_close(np.sum(np.asarray(g), axis=0), e, rtol=1e-8)


def _tensor_float_32_flags():
    import torch

    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


def test_example_mixing_check_runs_in_full_float32():
    """On PyTorch with CUDA, cuDNN convolutions use TensorFloat-32 by default, and one example
    alone and in a batch then differ by up to 4e-4 (an H200): over the mixing tolerance, so
    every convolutional PerExampleModel was refused. The check's forward passes run with TF32
    off, and the user's settings come back after it (a no-op elsewhere)."""
    from pergrad.backend.ops import full_float32

    if keras.backend.backend() != "torch":
        with full_float32():
            pass
        return
    import torch

    saved = _tensor_float_32_flags()
    seen = []

    def record(t):
        seen.append(_tensor_float_32_flags())
        return t

    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(record),
                                  keras.layers.Dense(2)])
        seen.clear()
        pex = pergrad.PerExample(model, keras.losses.MeanSquaredError())
        x, y = np.ones((3, 4), "float32"), np.zeros((3, 2), "float32")
        assert float(keras.ops.convert_to_numpy(pex.example_mixing(x, y))) < 1e-6
        assert seen and all(flags == (False, False) for flags in seen), seen
        assert _tensor_float_32_flags() == (True, True)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_maximum_and_minimum_keep_float64_and_nan():
    """``backend.ops.maximum``/``minimum``: the float64 result ``ops.maximum`` should give
    (Keras 3.15's PyTorch ``maximum`` rounds two float64 tensors to float32), NaN where either
    side is NaN, a Python scalar taken in the tensor's dtype."""
    from pergrad.backend.ops import maximum, minimum

    a = np.array([1.0 + 1e-12, np.nan, -2.0, 3.0, np.inf])
    b = np.array([1.0, 0.5, np.nan, 4.0, 1.0])
    for ours, theirs in ((maximum, np.maximum), (minimum, np.minimum)):
        got = ours(keras.ops.convert_to_tensor(a, "float64"),
                   keras.ops.convert_to_tensor(b, "float64"))
        assert keras.backend.standardize_dtype(got.dtype) == "float64"
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), theirs(a, b))
        scalar = ours(keras.ops.convert_to_tensor(a, "float64"), 1.0)
        assert keras.backend.standardize_dtype(scalar.dtype) == "float64"
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(scalar), theirs(a, 1.0))
