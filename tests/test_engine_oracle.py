"""Every rule, model kind and method of PerExample against the float64 loop oracle."""

from __future__ import annotations

import hashlib

import keras
import numpy as np
import pytest
import zoo
from oracle import assert_close, keras_loss, loop_gradients

import pergrad

#: The loop oracle of each zoo case this worker has computed, by case name and a digest of the
#: numbers (weights, inputs, labels, sample weights): several tests compare against the same
#: case, built from the same seed (the ``float64`` fixture), and on JAX each oracle compiles.
_ORACLES: dict[tuple[str, str], tuple] = {}


def _digest(case) -> str:
    numbers = [*(v.value for v in case.model.variables),
               *keras.tree.flatten((case.x, case.y, case.sample_weight))]
    digest = hashlib.sha256()
    for number in numbers:
        array = np.asarray(keras.ops.convert_to_numpy(number))
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _oracle(name: str, case) -> tuple[list, np.ndarray]:
    """Per-example gradients and losses of zoo case ``name`` by the float64 loop (a copy)."""
    key = (name, _digest(case))
    if key not in _ORACLES:
        _ORACLES[key] = loop_gradients(case.model, keras_loss(case.loss), case.x, case.y,
                                       case.sample_weight)
    grads, losses = _ORACLES[key]
    return [g.copy() for g in grads], losses.copy()


@pytest.mark.parametrize("name", sorted(zoo.ALL))
def test_auto_matches_loop_oracle(name, float64):
    case = zoo.ALL[name]()
    expected, expected_losses = _oracle(name, case)
    pex = pergrad.PerExample(case.model, case.loss)
    generic = {type(layer).__name__ for layer in pex.plan.generic}
    expect = set(case.expect_generic)
    assert generic == expect, pex.plan.describe()

    grads = pex.gradients(case.x, case.y, case.sample_weight)
    # Relative to the largest gradient entry: some entries are exactly zero in exact arithmetic
    # (attention's key bias) and only rounding noise in both computations.
    scale = max(np.max(np.abs(e)) for e in expected)
    for g, e, v in zip(grads, expected, case.model.trainable_variables, strict=True):
        assert_close(g, e, atol=1e-6 * scale, what=f"{name}: {v.path}")
    assert_close(pex.losses(case.x, case.y, case.sample_weight), expected_losses, what="losses")

    flat = np.concatenate([e.reshape(len(e), -1) for e in expected], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    assert_close(pex.norms(case.x, case.y, case.sample_weight), norms, what="norms")

    rng = np.random.default_rng(7)
    vectors = [rng.normal(size=v.shape) for v in case.model.trainable_variables]
    flat_v = np.concatenate([v.ravel() for v in vectors])
    assert_close(pex.dot(case.x, case.y, vectors, case.sample_weight), flat @ flat_v.T, what="dot")

    clip = float(np.median(norms))
    summed, clip_norms = pex.clipped_sum(case.x, case.y, clip, case.sample_weight)
    factors = np.minimum(1.0, clip / norms)
    expected_sums = [np.tensordot(factors, e, axes=1) for e in expected]
    sum_scale = max(np.max(np.abs(e)) for e in expected_sums)
    for s, e in zip(summed, expected_sums, strict=True):
        assert_close(s, e, atol=1e-6 * sum_scale, what="clipped_sum")
    assert_close(clip_norms, norms, what="clipped_sum norms")
    pex.check(case.x, case.y, case.sample_weight)  # no example mixing, sum_i g_i = batch gradient


@pytest.mark.parametrize("name", ["mlp", "conv2d_same_stride2", "generic_layers", "embedding",
                                  "separable_shared_depthwise"])
def test_clipped_sum_drops_non_finite_examples(name, float64):
    """A NaN input row (example 1) and an infinite sample weight (example 3) are dropped as the
    aggregators drop them; the sum over the other examples matches the oracle, and the norms
    show the dropped examples as non-finite."""
    case = zoo.ALL[name]()
    expected, _ = _oracle(name, case)  # examples are independent: the clean batch's gradients
    x = np.array(case.x)
    if name != "embedding":  # integer ids cannot be NaN: only the weight drops one there
        x[1] = np.nan
    weights = np.ones(zoo.B)
    weights[3] = np.inf
    dropped = np.isin(np.arange(zoo.B), [3] if name == "embedding" else [1, 3])
    pex = pergrad.PerExample(case.model, case.loss)
    flat = np.concatenate([e.reshape(zoo.B, -1) for e in expected], axis=1)
    clean_norms = np.linalg.norm(flat, axis=1)
    clip = float(np.median(clean_norms))
    summed, norms = pex.clipped_sum(x, case.y, clip, weights)
    norms = np.asarray(norms)
    assert not np.any(np.isfinite(norms[dropped]))
    assert_close(norms[~dropped], clean_norms[~dropped], what="kept norms")
    factors = np.where(dropped, 0.0, np.minimum(1.0, clip / clean_norms))
    for s, e in zip(summed, expected, strict=True):
        assert np.all(np.isfinite(np.asarray(s)))
        assert_close(s, np.tensordot(factors, e, axes=1), what=f"{name}: clipped sum")


@pytest.mark.parametrize("name", ["conv2d_same_stride2", "separable_shared_depthwise"])
def test_kept_weighted_sum_zeroes_dropped_rows(name, float64):
    """``PerExampleResult.kept_weighted_sum(c, keep)`` in a compiled body: the sum over the kept
    examples only, with any coefficients, whether or not a row is dropped (a NaN input row
    included)."""
    case = zoo.ALL[name]()
    expected, _ = _oracle(name, case)
    pex = pergrad.PerExample(case.model, case.loss)
    coefficients = np.random.default_rng(2).uniform(0.5, 2.0, size=zoo.B)
    body = pex.compiled("kept", lambda x, y, c, keep: pex.compute(x, y).kept_weighted_sum(c, keep))
    for dropped in ([], [1]):
        x = np.array(case.x)
        x[dropped] = np.nan
        keep = ~np.isin(np.arange(zoo.B), dropped)
        summed = body(*pex.prepare(x, case.y)[:2], keras.ops.convert_to_tensor(coefficients),
                      keras.ops.convert_to_tensor(keep))
        factors = np.where(keep, coefficients, 0.0)
        for s, e in zip(summed, expected, strict=True):
            assert_close(s, np.tensordot(factors, e, axes=1), what=f"{name}, dropped {dropped}")


@pytest.mark.parametrize("strategy", ["vmap", "jacobian", "loop"])
@pytest.mark.parametrize("name", ["mlp", "conv2d_same_stride2", "embedding", "shared_layer",
                                  "sample_weight_regularizers", "subclassed_raw_variable"])
def test_baseline_strategies_match_loop_oracle(name, strategy, float64):
    case = zoo.ALL[name]()
    pex = pergrad.PerExample(case.model, case.loss, strategy=strategy)
    expected, _ = _oracle(name, case)
    grads = pex.gradients(case.x, case.y, case.sample_weight)
    for g, e in zip(grads, expected, strict=True):
        assert_close(g, e, what=f"{name}/{strategy}")
    flat = np.concatenate([e.reshape(len(e), -1) for e in expected], axis=1)
    assert_close(pex.norms(case.x, case.y, case.sample_weight), np.linalg.norm(flat, axis=1))


def test_float32_within_1e4_of_the_float64_oracle(rng):
    model = zoo.mlp().model  # float32 weights
    x, y = rng.normal(size=(6, 6)).astype("float32"), rng.integers(0, 3, 6)
    got = pergrad.PerExample(model, zoo.SCCE).gradients(x, y)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:  # the same weights in a float64 twin: the reference
        twin = zoo.mlp().model
        twin.set_weights([w.astype("float64") for w in model.get_weights()])
        expected, _ = loop_gradients(twin, keras_loss(zoo.SCCE), x.astype("float64"), y)
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
    for g, e in zip(got, expected, strict=True):
        assert keras.backend.standardize_dtype(g.dtype) == "float32"
        assert_close(g, e, rtol=1e-4)


def test_regularization_losses_are_excluded(float64):
    """model.losses belong to no example: per-example gradients are those of the data loss
    (the loop oracle differentiates each example's data loss alone)."""
    case = zoo.weighted_regularized()
    case.model(case.x)
    assert case.model.losses, "the model should carry regularization losses"
    pex = pergrad.PerExample(case.model, case.loss)
    grads = pex.gradients(case.x, case.y)
    expected, _ = loop_gradients(case.model, keras_loss(case.loss), case.x, case.y)
    for g, e in zip(grads, expected, strict=True):
        assert_close(g, e)


@pytest.mark.parametrize("mode", ["after_norms", "alone", "rebuilt"])
@pytest.mark.parametrize("name", sorted(zoo.ALL))
def test_several_sums_and_dots_in_one_pass_match_oracle(name, mode, float64):
    """``weighted_sums`` and ``dots_many`` (what the monitor's statistics use) against the loop
    oracle: after the norms the forms read the per-example matrices the norms built, alone they
    take one GEMM over the layer's data, and ``rebuilt`` first rebuilds every form from its
    layer's recorded tensors (what a conditional branch reads), then takes the norms too."""
    case = zoo.ALL[name]()
    expected, _ = _oracle(name, case)
    rng = np.random.default_rng(3)
    batch = len(expected[0])
    coefficients = [rng.normal(size=batch), rng.uniform(size=batch)]
    vector_sets = [[rng.normal(size=v.shape) for v in case.model.trainable_variables]
                   for _ in range(3)]
    pex = pergrad.PerExample(case.model, case.loss)
    x, y, w = pex.prepare(case.x, case.y, case.sample_weight)

    def body(x, y, w, coefficients, vector_sets):
        result = pex.compute(x, y, w)
        if mode == "rebuilt":
            result = result.rebuilt()
        norms = result.norms() if mode != "alone" else None
        return (result.weighted_sums(coefficients), result.dots_many(vector_sets), norms)

    cast = [keras.ops.convert_to_tensor(c, "float64") for c in coefficients]
    vectors = [[keras.ops.convert_to_tensor(v) for v in vs] for vs in vector_sets]
    sums, dots, norms = pex.compiled(f"many_{mode}", body)(x, y, w, cast, vectors)
    for c, got in zip(coefficients, sums, strict=True):
        want = [np.tensordot(c, e, axes=1) for e in expected]
        scale = max(np.max(np.abs(e)) for e in want)
        for g, e in zip(got, want, strict=True):
            assert_close(g, e, atol=1e-6 * scale, what=f"{name}: weighted_sums")
    for vs, got in zip(vector_sets, dots, strict=True):
        want = [e.reshape(batch, -1) @ v.ravel() for e, v in zip(expected, vs, strict=True)]
        scale = max(np.max(np.abs(d)) for d in want)
        for g, e, v in zip(got, want, case.model.trainable_variables, strict=True):
            assert_close(g, e, atol=1e-6 * scale, what=f"{name}: dots_many {v.path}")
    if norms is not None:
        flat = np.concatenate([e.reshape(batch, -1) for e in expected], axis=1)
        assert_close(norms, np.linalg.norm(flat, axis=1), what=f"{name}: norms ({mode})")


@pytest.mark.parametrize("name", ["conv2d_same_stride2", "separable_shared_depthwise",
                                  "shared_layer", "conv1d_causal"])
def test_mean_drops_a_nan_example_through_its_rebuilt_fallback(name, float64):
    """``mean()`` sums plainly and falls back, inside a conditional (``tf.cond``, ``lax.cond``;
    a Python branch on PyTorch), to dropping non-finite examples with the forms rebuilt there
    (``PerExampleResult.rebuilt``): against the loop oracle on the finite examples, divided by
    every row."""
    case = zoo.ALL[name]()
    expected, _ = _oracle(name, case)
    pex = pergrad.PerExample(case.model, case.loss)
    x, y, w = pex.prepare(case.x, case.y, case.sample_weight)
    poisoned = keras.tree.map_structure(np.array, case.x)
    first = keras.tree.flatten(poisoned)[0]
    first.reshape(len(first), -1)[2, 0] = np.nan
    px, _, _ = pex.prepare(poisoned, case.y, case.sample_weight)
    update = pex.compiled("mean_nan", lambda x, y, w: pergrad.aggregate.mean()(
        pex.compute(x, y, w), w))(px, y, w)
    batch = len(expected[0])
    keep = np.arange(batch) != 2
    for u, e in zip(update, expected, strict=True):
        want = e[keep].sum(0) / batch
        assert_close(u, want, atol=1e-6 * max(np.max(np.abs(want)), 1e-12))


def test_dots_many_checks_each_vector_shape(float64):
    case = zoo.ALL["mlp"]()
    pex = pergrad.PerExample(case.model, case.loss)
    kernel = case.model.trainable_variables[0]
    vectors = [np.zeros(v.shape) for v in case.model.trainable_variables]
    vectors[0] = np.zeros(tuple(reversed(kernel.shape)))  # same entries, transposed
    with pytest.raises(ValueError, match="has shape"):
        pex.compute(case.x, case.y).dots_many([vectors])


@pytest.mark.parametrize("name", ["mlp", "conv2d_same_stride2", "embedding", "transformer",
                                  "lstm_gru", "shared_layer"])
def test_gram_matches_oracle(name, float64):
    case = zoo.ALL[name]()
    expected, _ = _oracle(name, case)
    flat = np.concatenate([e.reshape(len(e), -1) for e in expected], axis=1)
    pex = pergrad.PerExample(case.model, case.loss)
    x, y, _ = pex.prepare(case.x, case.y)
    gram = pex.compiled("gram", lambda x, y: pex.compute(x, y).gram())(x, y)
    assert_close(gram, flat @ flat.T, atol=1e-6 * np.max(np.abs(flat @ flat.T)))


@pytest.mark.parametrize("name", ["mlp", "transformer", "lstm_gru", "conv1d_causal"])
@pytest.mark.tensorflow_only(reason=(
    "PerExample(jit_compile=True): the engine's tf.function compiled with XLA (JAX always "
    "compiles with XLA)"))
def test_jit_compile_matches_loop_oracle(name, float64):
    case = zoo.ALL[name]()
    expected, _ = _oracle(name, case)
    pex = pergrad.PerExample(case.model, case.loss, jit_compile=True)
    scale = max(np.max(np.abs(e)) for e in expected)
    for g, e in zip(pex.gradients(case.x, case.y), expected, strict=True):
        assert_close(g, e, atol=1e-6 * scale)
    flat = np.concatenate([e.reshape(len(e), -1) for e in expected], axis=1)
    assert_close(pex.norms(case.x, case.y), np.linalg.norm(flat, axis=1))
