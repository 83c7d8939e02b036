"""PerExample's contract beyond the numbers: errors, retracing, chunking, fallbacks, shortcuts."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import zoo
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from oracle import assert_close, compiled_like_a_user, keras_loss, loop_gradients

import pergrad
import pergrad.backend
import pergrad.engine
import pergrad.rules
from pergrad.backend.lazy import tensorflow as tf  # on first use: TensorFlow may be absent

L = keras.layers


def _oracle(case):
    return loop_gradients(case.model, keras_loss(case.loss), case.x, case.y,
                          case.sample_weight)[0]


def test_batchnorm_in_training_mode_is_refused_by_name():
    inputs = keras.Input((4,))
    outputs = L.Dense(2)(L.BatchNormalization(name="bn_block")(L.Dense(3)(inputs)))
    pex = pergrad.PerExample(keras.Model(inputs, outputs), "mse", training=True)
    with pytest.raises(pergrad.MixesExamplesError, match="bn_block.*GroupNormalization"):
        pex.norms(np.ones((3, 4)), np.ones((3, 2)))


def test_frozen_batchnorm_in_training_mode_is_fine(float64):
    inputs = keras.Input((4,))
    bn = L.BatchNormalization()
    outputs = L.Dense(2)(bn(L.Dense(3)(inputs)))
    bn.trainable = False
    model = keras.Model(inputs, outputs)
    x, y = np.random.default_rng(0).normal(size=(4, 4)), np.ones((4, 2))
    got = pergrad.PerExample(model, "mse", training=True).gradients(x, y)
    expected, _ = loop_gradients(model, keras_loss("mse"), x, y, training=True)
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e)


def test_scalar_loss_gets_an_explanation():
    model = keras.Sequential([keras.Input((3,)), L.Dense(2)])
    pex = pergrad.PerExample(model, lambda y, p: keras.ops.mean(keras.ops.square(y - p)))
    with pytest.raises(ValueError, match="one loss per example"):
        pex.norms(np.ones((4, 3)), np.ones((4, 2)))


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "fast"}, "strategy must be one of"),
    ({"memory_budget_bytes": 0}, "memory_budget_bytes must be positive"),
])
def test_bad_constructor_arguments(kwargs, match):
    model = keras.Sequential([keras.Input((3,)), L.Dense(2)])
    with pytest.raises(ValueError, match=match):
        pergrad.PerExample(model, "mse", **kwargs)


def test_bad_method_arguments():
    model = keras.Sequential([keras.Input((3,)), L.Dense(2)])
    pex = pergrad.PerExample(model, "mse")
    x, y = np.ones((4, 3)), np.ones((4, 2))
    with pytest.raises(ValueError, match="l2_norm_clip must be a finite number > 0"):
        pex.clipped_sum(x, y, 0.0)
    with pytest.raises(ValueError, match="expected \\(3, 2\\)"):
        pex.dot(x, y, [np.ones((2, 3)), np.ones(2)])
    with pytest.raises(ValueError, match="2 vectors for 2|1 vectors for 2"):
        pex.dot(x, y, [np.ones((3, 2))])
    with pytest.raises(ValueError, match="sample_weight has 3 entries for a batch of 4"):
        pex.norms(x, y, sample_weight=np.ones(3))


@pytest.mark.tensorflow_only(reason=(
    "tf.function retracing: trace_counts of the engine's tf.function, whose reduce_retracing "
    "generalizes to any batch size (jax.jit traces each new shape, PyTorch traces nothing)"))
def test_no_retracing_for_new_data_of_the_same_shape():
    case = zoo.mlp()
    pex = pergrad.PerExample(case.model, case.loss)
    rng = np.random.default_rng(3)
    for _ in range(4):
        x = rng.normal(size=(5, 6)).astype("float32")
        y = rng.integers(0, 3, 5)
        pex.gradients(x, y)
        pex.norms(x, y)
        pex.clipped_sum(x, y, 0.5 + rng.uniform())
    assert pex.trace_counts == {"gradients": 1, "norms": 1, "clipped_sum": 1}
    pex.norms(rng.normal(size=(7, 6)).astype("float32"), rng.integers(0, 3, 7))
    pex.norms(rng.normal(size=(9, 6)).astype("float32"), rng.integers(0, 3, 9))
    assert pex.trace_counts["norms"] <= 2  # one more trace, generalized to any batch size


def test_memory_budget_chunks_give_the_same_results(float64):
    case = zoo.conv2d(strides=2, padding="same")
    full = pergrad.PerExample(case.model, case.loss).gradients(case.x, case.y)
    params = sum(int(np.prod(v.shape)) for v in case.model.trainable_variables)
    chunked = pergrad.PerExample(case.model, case.loss, memory_budget_bytes=2 * params * 8)
    got = chunked.gradients(case.x, case.y)
    # Chunks of 2 and the last chunk of 1: two shapes, two traces (PyTorch traces nothing).
    assert chunked.trace_counts["gradients"] == (0 if pergrad.backend.is_torch() else 2)
    for g, f in zip(got, full, strict=True):  # equal up to the summation order of a smaller batch
        assert_close(g, f, rtol=1e-12)


class SortedScale(keras.layers.Layer):
    """Sorts each example's scaled features: tf.sort has no vectorized (pfor) form."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")

    def call(self, x):
        return tf.sort(x * self.scale, axis=-1)


class BranchingScale(keras.layers.Layer):
    """Scales, after a Python branch on its input's values: torch.func.vmap refuses such
    data-dependent control flow, a per-example call runs it."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")

    def call(self, x):
        y = x * self.scale
        return 2.0 * y if bool(keras.ops.all(keras.ops.isfinite(y))) else y


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's generic rule")
def test_torch_generic_layer_vmap_cannot_run_takes_the_loop(float64):
    inputs = keras.Input((5,))
    outputs = L.Dense(2)(BranchingScale(name="branching_scale")(inputs))
    model = keras.Model(inputs, outputs)
    x, y = np.random.default_rng(1).normal(size=(4, 5)), np.ones((4, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = pergrad.PerExample(model, "mse").gradients(x, y)
    messages = [str(w.message) for w in caught if "branching_scale" in str(w.message)]
    assert len(messages) == 1 and "per-example loop" in messages[0]
    expected, _ = loop_gradients(model, keras_loss("mse"), x, y)
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e)


@pytest.mark.tensorflow_only(reason=(
    "the TensorFlow generic rule's tf.vectorized_map (pfor) fallback: tf.sort has no pfor "
    "converter (PyTorch's is test_torch_generic_layer_vmap_cannot_run_takes_the_loop)"))
def test_unvectorizable_layer_falls_back_to_a_loop_and_warns_once(float64):
    inputs = keras.Input((5,))
    outputs = L.Dense(2)(SortedScale(name="sorted_scale")(inputs))
    model = keras.Model(inputs, outputs)
    x, y = np.random.default_rng(0).normal(size=(4, 5)), np.ones((4, 2))
    pex = pergrad.PerExample(model, "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = pex.gradients(x, y)
        pex.norms(x, y)
    messages = [str(w.message) for w in caught if "sorted_scale" in str(w.message)]
    assert len(messages) == 1 and "per-example loop" in messages[0]
    expected, _ = loop_gradients(model, keras_loss("mse"), x, y)
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e)


@pytest.mark.tensorflow_only(reason=(
    "a layer called inside tf.map_fn"))
def test_layer_inside_a_loop_is_reported_by_name():
    class Looping(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner = L.Dense(2, name="looped_dense")

        def call(self, x):
            return tf.map_fn(lambda row: self.inner(row[None])[0], x)

    model = Looping()
    model(np.ones((2, 3)))
    with pytest.raises(NotImplementedError, match="looped_dense"):
        pergrad.PerExample(model, "mse").norms(np.ones((2, 3)), np.ones((2, 2)))


def test_loss_variants(float64):
    model = keras.Sequential([keras.Input((4, 3)), L.Dense(2)])
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(3, 4, 3)), rng.normal(size=(3, 4, 2))
    by_object = pergrad.PerExample(model, keras.losses.MeanSquaredError()).losses(x, y)
    by_name = pergrad.PerExample(model, "mean_squared_error").losses(x, y)
    out = keras.ops.convert_to_numpy(model(x))
    sequence = np.mean((out - y) ** 2, axis=-1).sum(axis=1)  # (B, T) summed over T
    assert_close(by_object, sequence)
    assert_close(by_name, sequence)
    # loss=None: the model's output is the per-example loss; y=None: loss gets y_pred alone.
    assert_close(pergrad.PerExample(model, None).losses(x), out.sum(axis=(1, 2)))
    own = pergrad.PerExample(model, lambda p: keras.ops.sum(p ** 2, axis=(1, 2))).losses(x)
    assert_close(own, (out ** 2).sum(axis=(1, 2)))


@pytest.mark.tensorflow_only(reason=(
    "pergrad.vmap_grad is tf.vectorized_map over a tf.GradientTape (TensorFlow only), checked "
    "against per-example tapes (its per_example_gradients/norms half would run anywhere)"))
def test_shortcuts_and_vmap_grad(float64):
    case = zoo.mlp()
    expected = _oracle(case)
    for g, e in zip(pergrad.per_example_gradients(case.model, case.loss, case.x, case.y),
                    expected, strict=True):
        assert_close(g, e)
    flat = np.concatenate([e.reshape(len(e), -1) for e in expected], axis=1)
    assert_close(pergrad.per_example_norms(case.model, case.loss, case.x, case.y),
                 np.linalg.norm(flat, axis=1))

    def loss(params, x, y):
        hidden = tf.tanh(tf.linalg.matvec(params["w"], x, transpose_a=True) + params["b"])
        return tf.reduce_sum((hidden - y) ** 2)

    rng = np.random.default_rng(2)
    params = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
    xs, ys = rng.normal(size=(6, 3)), rng.normal(size=(6, 2))
    grads = pergrad.vmap_grad(loss)(params, xs, ys)
    for i in range(6):
        with tf.GradientTape() as tape:
            p = {k: tf.constant(v) for k, v in params.items()}
            tape.watch(p)
            value = loss(p, tf.constant(xs[i]), tf.constant(ys[i]))
        one = tape.gradient(value, p)
        assert_close(grads["w"][i], one["w"])
        assert_close(grads["b"][i], one["b"])


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(["dense", "conv"]),
    d_in=st.integers(1, 4), d_out=st.integers(1, 4), steps=st.integers(1, 3),
    kernel=st.integers(1, 3), stride=st.integers(1, 2), dilation=st.integers(1, 2),
    padding=st.sampled_from(["valid", "same"]), size=st.integers(3, 6),
    batch=st.integers(1, 4),
)
def test_random_dense_and_conv_shapes(kind, d_in, d_out, steps, kernel, stride, dilation,
                                      padding, size, batch):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        rng = np.random.default_rng(batch * 100 + size)
        if kind == "dense":
            shape = (steps, d_in)
            layer = L.Dense(d_out, activation="tanh")
        else:
            if stride > 1 and dilation > 1:
                dilation = 1  # Keras rejects strides > 1 with dilation > 1
            if (size - (kernel - 1) * dilation) < 1:
                size = (kernel - 1) * dilation + 1
            # PyTorch's CPU float64 convolution backward (slow_conv2d; torch 2.13) raises
            # "grad_weight must be contiguous" for Keras's permuted kernel with one filter, more
            # than one input channel, a kernel wider than 1 and no dilation: the oracle (plain
            # Keras under torch.autograd.grad) cannot run exactly these shapes there (pergrad can).
            assume(not (keras.backend.backend() == "torch" and d_out == 1 and d_in > 1
                        and kernel > 1 and dilation == 1))
            shape = (size, size + 1, d_in)
            layer = L.Conv2D(d_out, kernel, strides=stride, padding=padding,
                             dilation_rate=dilation, activation="tanh")
        inputs = keras.Input(shape)
        model = keras.Model(inputs, L.Dense(2)(L.Flatten()(layer(inputs))))
        x, y = rng.normal(size=(batch, *shape)), rng.normal(size=(batch, 2))
        pex = pergrad.PerExample(model, "mse")
        expected, _ = loop_gradients(model, keras_loss("mse"), x, y)
        for g, e in zip(pex.gradients(x, y), expected, strict=True):
            assert_close(g, e)
        flat = np.concatenate([e.reshape(batch, -1) for e in expected], axis=1)
        assert_close(pex.norms(x, y), np.linalg.norm(flat, axis=1))
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("name", ["mlp", "conv2d_same_stride2", "embedding"])
def test_masked_and_scaled_results(name, float64):
    """masked(keep) zeroes dropped examples exactly, NaN rows included; scaled(f) scales."""
    case = zoo.ALL[name]()
    x = np.array(case.x, dtype=float if name != "embedding" else None)
    expected = _oracle(case)
    pex = pergrad.PerExample(case.model, case.loss)
    keep = np.array([True, False, True, True, False])
    poisoned = x.copy()
    if name != "embedding":
        poisoned[1] = np.nan  # example 1's gradient is NaN
    c = np.linspace(0.5, 1.5, 5)

    @compiled_like_a_user
    def run(x, y):
        result = pex.compute(x, y)
        kept = result.masked(keras.ops.convert_to_tensor(keep))
        half = result.scaled(0.5)
        return (kept.weighted_sum(keras.ops.convert_to_tensor(c)), kept.norms(), kept.losses,
                half.norms(), half.gradients())

    summed, norms, losses, half_norms, half_grads = run(poisoned, case.y)
    for s, e in zip(summed, expected, strict=True):
        assert_close(s, np.tensordot(c * keep, e, axes=1))
    flat = np.concatenate([e.reshape(5, -1) for e in expected], axis=1)
    assert_close(norms, np.linalg.norm(flat, axis=1) * keep)
    losses = keras.ops.convert_to_numpy(losses)
    assert np.all(np.isfinite(losses)) and losses[1] == 0.0
    if name == "embedding":  # no NaN row: the scaled view is checked against the oracle
        assert_close(half_norms, 0.5 * np.linalg.norm(flat, axis=1))
        for g, e in zip(half_grads, expected, strict=True):
            assert_close(g, 0.5 * e)


def test_generic_layer_with_dropout_uses_the_forward_pass_mask():
    """In training mode a layer that draws random numbers is not replayed: with
    out = dropout(x * w) and the loss sum(out), l_i = <g_i, w> holds exactly for the mask used."""

    class DropScale(keras.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")
            self.drop = L.Dropout(0.5)

        def call(self, x, training=None):
            return self.drop(x * self.w, training=training)

    layer = DropScale()
    inputs = keras.Input((6,))
    model = keras.Model(inputs, layer(inputs))
    pex = pergrad.PerExample(model, None, training=True)
    assert [name for name, _, how in pex.plan.describe()] == [layer.name]
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    result = compiled_like_a_user(
        lambda x: (lambda r: (r.losses, r.gradients()))(pex.compute(x)))(x)
    losses, (grads,) = result
    grads = keras.ops.convert_to_numpy(grads)
    assert np.any(grads == 0.0)  # dropout did drop something
    w = keras.ops.convert_to_numpy(layer.w)
    assert_close(losses, np.sum(grads * w, axis=1), rtol=1e-5)


def test_batchnorm_without_weights_is_still_refused_in_training_mode():
    inputs = keras.Input((4,))
    outputs = L.Dense(2)(L.BatchNormalization(center=False, scale=False, name="bare_bn")(
        L.Dense(3)(inputs)))
    pex = pergrad.PerExample(keras.Model(inputs, outputs), "mse", training=True)
    with pytest.raises(pergrad.MixesExamplesError, match="bare_bn"):
        pex.norms(np.ones((3, 4)), np.ones((3, 2)))


def test_per_timestep_sample_weights_are_refused():
    model = keras.Sequential([keras.Input((4, 3)), L.Dense(2)])
    pex = pergrad.PerExample(model, "mse")
    with pytest.raises(ValueError, match="one weight per example"):
        pex.norms(np.ones((5, 4, 3)), np.ones((5, 4, 2)), sample_weight=np.ones((5, 4)))


def test_einsum_equation_without_a_factored_form_takes_the_generic_rule(float64):
    inputs = keras.Input((4, 6))
    h = L.EinsumDense("abc,cd->ad", output_shape=(5,))(inputs)  # b is summed over, x only
    model = keras.Model(inputs, L.Dense(2)(h))
    pex = pergrad.PerExample(model, "mse")
    assert [how for _, cls, how in pex.plan.describe() if cls == "EinsumDense"] == ["generic"]
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(3, 4, 6)), rng.normal(size=(3, 2))
    expected, _ = loop_gradients(model, keras_loss("mse"), x, y)
    for g, e in zip(pex.gradients(x, y), expected, strict=True):
        assert_close(g, e)


@pytest.mark.tensorflow_only(reason=(
    "tf.function's reduce_retracing relaxing the spatial dimensions (at most two traces for three "
    "image sizes)"))
def test_convolutions_with_dynamic_image_sizes(float64):
    """After reduce_retracing relaxes the spatial dimensions, the convolution rule still works."""
    inputs = keras.Input((None, None, 2))
    h = L.Conv2D(3, 3, strides=2, padding="same", activation="tanh")(inputs)
    outputs = L.Dense(2)(L.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    pex = pergrad.PerExample(model, "mse")
    rng = np.random.default_rng(5)
    for size in (7, 9, 12):
        x, y = rng.normal(size=(3, size, size + 1, 2)), rng.normal(size=(3, 2))
        expected, _ = loop_gradients(model, keras_loss("mse"), x, y)
        for g, e in zip(pex.gradients(x, y), expected, strict=True):
            assert_close(g, e)
        flat = np.concatenate([e.reshape(3, -1) for e in expected], axis=1)
        assert_close(pex.norms(x, y), np.linalg.norm(flat, axis=1))
    assert pex.trace_counts["gradients"] <= 2


@pytest.mark.tensorflow_only(reason=(
    "a tf.function traced with an unknown batch size (tf.TensorSpec([None, ...])) must keep the "
    "positions static"))
def test_positions_stay_static_when_the_batch_dimension_is_dynamic():
    """A retrace with an unknown batch size must keep T static, or the cost model would pick
    the per-example matrices (13x slower norms on the benchmark MLP)."""
    case = zoo.conv2d(strides=2, padding="same")
    pex = pergrad.PerExample(case.model, case.loss)
    seen = []

    @tf.function(input_signature=[tf.TensorSpec([None, 9, 8, 3]), tf.TensorSpec([None], tf.int64)])
    def norms(x, y):
        result = pex.compute(x, y)
        seen.extend(f.a.shape[1] for f in result.forms if isinstance(f, pergrad.rules.Factored))
        return result.norms()

    norms(np.asarray(case.x, "float32"), np.asarray(case.y))
    assert seen and all(t is not None for t in seen), seen


class TiedEmbeddings(keras.Model):
    """Input and output embeddings tied by using the table outside the Embedding layer."""

    def __init__(self):
        super().__init__()
        self.embed = L.Embedding(7, 4)
        self.hidden = L.Dense(4, activation="tanh")

    def call(self, ids):
        h = self.hidden(keras.ops.mean(self.embed(ids), axis=1))
        return keras.ops.matmul(h, keras.ops.transpose(self.embed.embeddings))


def test_check_finds_a_weight_used_outside_its_layer(float64):
    rng = np.random.default_rng(6)
    ids, y = rng.integers(0, 7, size=(5, 3)), rng.integers(0, 7, size=5)
    tied = TiedEmbeddings()
    tied(ids)
    with pytest.raises(ValueError, match="embeddings"):
        pergrad.PerExample(tied, zoo.SCCE).check(ids, y)
    # The whole-model strategy sees the second use, and the check passes.
    pergrad.PerExample(tied, zoo.SCCE, strategy="vmap").check(ids, y)
    # A model whose layers call their sublayers' weights (attention's projections) passes the
    # same check: test_engine_oracle.py runs it on every zoo case, the transformer included.


# -- example mixing ---------------------------------------------------------------------------------

def _center(h):
    """Subtracts the batch mean: every example's output depends on the whole batch."""
    return h - keras.ops.mean(h, 0, keepdims=True)


def _centering_model():
    inputs = keras.Input((4,))
    h = L.Lambda(_center)(L.Dense(3, activation="tanh")(inputs))
    return keras.Model(inputs, L.Dense(2)(h))


def _batch_dependent_loss(y, p):
    """Each example's squared error minus the batch's mean squared error."""
    return keras.ops.mean((y - p) ** 2, -1) - keras.ops.mean((y - p) ** 2)


_MIXING_MESSAGE = (r"Example \d's loss differs by .* when computed alone: a layer or the loss "
                   r"mixes examples of a batch .*DP guarantees would be wrong")


def test_check_refuses_a_layer_that_mixes_examples(float64):
    model = _centering_model()
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 2))
    auto = pergrad.PerExample(model, "mse").norms(x, y)
    loop = pergrad.PerExample(model, "mse", strategy="loop").norms(x, y)
    ratio = keras.ops.convert_to_numpy(auto) / keras.ops.convert_to_numpy(loop)
    assert np.max(np.abs(ratio - 1)) > 0.1  # what the check prevents
    with pytest.raises(pergrad.MixesExamplesError, match=_MIXING_MESSAGE):
        pergrad.PerExample(model, "mse").check(x, y)


def test_check_refuses_a_loss_that_mixes_examples(float64):
    model = keras.Sequential([keras.Input((4,)), L.Dense(2)])
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 2))
    pex = pergrad.PerExample(model, _batch_dependent_loss)
    assert float(pex.example_mixing(x, y)) > 0.1
    with pytest.raises(pergrad.MixesExamplesError, match=_MIXING_MESSAGE):
        pex.check(x, y)


def _independent_mixing(model, loss_fn, x, y, count: int) -> float:
    """The mixing formula by eager calls, one example alone at a time."""
    in_batch = keras.ops.convert_to_numpy(loss_fn(y, model(x, training=False))).astype(np.float64)
    floor = np.mean(np.abs(in_batch))
    worst = 0.0
    for k in range(count):
        alone = float(keras.ops.convert_to_numpy(
            loss_fn(y[k:k + 1], model(x[k:k + 1], training=False)))[0])
        scale = max(abs(in_batch[k]), abs(alone), floor)
        worst = max(worst, abs(in_batch[k] - alone) / scale)
    return worst


def test_example_mixing_matches_an_independent_computation(float64):
    model = _centering_model()
    rng = np.random.default_rng(10)
    x, y = rng.normal(size=(7, 4)), rng.normal(size=(7, 2))
    mse = keras.losses.MeanSquaredError(reduction=None)
    pex = pergrad.PerExample(model, "mse")
    for count in (1, 3, 7, 20):
        expected = _independent_mixing(model, mse, x, y, min(count, 7))
        assert expected > 1e-3
        weights = rng.uniform(0.0, 2.0, 7)  # compared unweighted: weights change nothing
        current = pex.example_mixing(x, y, weights, num_examples=count,
                                     at_perturbed_weights=False)
        assert_close(current, expected)
        # The default also measures perturbed weights and reports the larger difference.
        assert float(pex.example_mixing(x, y, weights, num_examples=count)) >= float(current)
    plain = pergrad.PerExample(keras.Sequential([keras.Input((4,)), L.Dense(2)]), "mse")
    assert float(plain.example_mixing(x, y)) <= pergrad.engine.mixing_tolerance("float64")


def _dict_model(mix: bool) -> keras.Model:
    ids, feats = keras.Input((3,), dtype="int32", name="ids"), keras.Input((4,), name="feats")
    f = L.Dense(3, activation="tanh")(feats)
    if mix:
        f = L.Lambda(_center)(f)
    h = L.Concatenate()([L.Flatten()(L.Embedding(9, 2)(ids)), f])
    return keras.Model({"ids": ids, "feats": feats}, [L.Dense(3)(h), L.Dense(2)(h)])


@pytest.mark.parametrize("mix", [False, True])
@pytest.mark.tensorflow_only(reason=(
    "example_mixing() in a tf.cond branch of a tf.function traced with a dynamic batch "
    "(tf.TensorSpec input signature), as the TensorFlow train step uses it"))
def test_example_mixing_inside_a_cond_branch_with_structured_inputs(mix):
    """The train step's use: traced with a dynamic batch, in one branch of a tf.cond, dict
    inputs with integer ids, a list of targets, sample weights, batches smaller than
    num_examples, and a NaN input row (skipped when it stays in its example)."""
    keras.utils.set_random_seed(3)
    model = _dict_model(mix)
    pex = pergrad.PerExample(model, [zoo.SCCE, "mse"])
    spec = ({"ids": tf.TensorSpec([None, 3], tf.int32), "feats": tf.TensorSpec([None, 4])},
            [tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, 2])], tf.TensorSpec([None]))

    @tf.function(input_signature=[*spec, tf.TensorSpec([], tf.bool)])
    def first_batch(x, y, w, first):
        return tf.cond(first, lambda: pex.example_mixing(x, y, w),
                       lambda: tf.constant(-1.0, tf.float64))

    rng = np.random.default_rng(11)
    tolerance = pergrad.engine.mixing_tolerance(pex.compute_dtype)
    for batch in (6, 2):
        x = {"ids": rng.integers(0, 9, (batch, 3)).astype("int32"),
             "feats": rng.normal(size=(batch, 4)).astype("float32")}
        y = [rng.integers(0, 3, batch), rng.normal(size=(batch, 2)).astype("float32")]
        w = rng.uniform(0.5, 1.5, batch).astype("float32")
        assert float(first_batch(x, y, w, False)) == -1.0
        value = float(first_batch(x, y, w, True))
        assert value > 0.1 if mix else 0.0 <= value <= tolerance, (batch, value)
        x["feats"][1] = np.nan
        value = float(first_batch(x, y, w, True))
        assert value == np.inf if mix else 0.0 <= value <= tolerance, (batch, value)


class _CountsCalls(L.Layer):
    """The identity, counting its calls in a non-trainable weight: state written at inference."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls")

    def call(self, x):
        self.calls.assign(self.calls + 1.0)
        return x


class _AlwaysNoisy(L.Layer):
    """Adds standard normal noise at every call, inference too: a seed state written."""

    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, x):
        return x + keras.random.normal(keras.ops.shape(x), dtype=x.dtype,
                                       seed=self.seed_generator)


def test_the_mixing_check_writes_no_state_and_refuses_a_random_layer(float64):
    """Each of the check's model calls runs in a scope of its own (on JAX inside one
    ``lax.map``, out of which nothing traced may leak): a layer writing a weight at inference
    passes and finds its weight as it was; a layer drawing noise at inference is refused as
    mixing (its draws for an example alone and in the batch differ), its seed state as it was."""
    rng = np.random.default_rng(10)
    x, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 2))
    inputs = keras.Input((4,))
    counter = _CountsCalls()
    model = keras.Model(inputs, L.Dense(2)(counter(L.Dense(3, activation="tanh")(inputs))))
    before = float(keras.ops.convert_to_numpy(counter.calls.value))
    mixing = pergrad.PerExample(model, "mse").example_mixing(x, y)
    assert float(mixing) <= pergrad.engine.mixing_tolerance("float64")
    assert float(keras.ops.convert_to_numpy(counter.calls.value)) == before

    noisy = _AlwaysNoisy()
    model = keras.Model(inputs, L.Dense(2)(noisy(L.Dense(8, activation="tanh")(inputs))))
    seed = keras.ops.convert_to_numpy(noisy.seed_generator.state.value).copy()
    assert float(pergrad.PerExample(model, "mse").example_mixing(x, y)) > 0.1
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(noisy.seed_generator.state.value), seed)


def test_example_mixing_argument_and_trace_cache():
    case = zoo.embedding()
    pex = pergrad.PerExample(case.model, case.loss)
    for _ in range(2):
        value = pex.example_mixing(case.x, case.y, num_examples=np.int64(2))
        assert keras.backend.standardize_dtype(value.dtype) == "float64"
        assert tuple(value.shape) == ()
        assert float(value) <= pergrad.engine.mixing_tolerance("float32")
    # Traced once, the second call reuses it (PyTorch traces nothing).
    assert pex.trace_counts["example_mixing/2"] == (0 if pergrad.backend.is_torch() else 1)
    pex.check(case.x, case.y)


# -- mixed precision --------------------------------------------------------------------------------

@pytest.fixture
def dtype_policy():
    """Sets the global dtype policy; restores floatx and the policy afterwards."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)


def test_tolerances_follow_the_dtype():
    dtypes = ["float64", "float32", "float16", "bfloat16"]
    # The backend's own dtype object (tf.float16, jax's numpy dtype, torch.float16).
    native_float16 = keras.ops.convert_to_tensor(np.zeros(1, "float16")).dtype
    for tolerance in (pergrad.engine.mixing_tolerance, pergrad.engine.gradient_tolerance):
        values = [tolerance(d) for d in dtypes]
        assert values == sorted(values) and values[0] <= 1e-8 and values[1] == 1e-4
        assert tolerance(native_float16) == tolerance("float16")
    with pytest.raises(ValueError, match="floating dtype"):
        pergrad.engine.mixing_tolerance("int32")


@pytest.mark.tensorflow_only(reason=(
    "TensorFlow's TensorFloat-32 switch (tf.config.experimental) and its GPU list, monkeypatched"))
def test_float32_on_a_gpu_with_tensor_float_32_gets_float16_tolerances(monkeypatch):
    """TF32 matmuls round their inputs to float16's 10-bit significand."""
    gpus = [tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: gpus if kind == "GPU" else [])
    monkeypatch.setattr(tf.config.experimental, "tensor_float_32_execution_enabled", lambda: True)
    for tolerance in (pergrad.engine.mixing_tolerance, pergrad.engine.gradient_tolerance):
        assert tolerance("float32") == tolerance("float16")
        assert tolerance("float64") < 1e-6
    monkeypatch.setattr(tf.config.experimental, "tensor_float_32_execution_enabled", lambda: False)
    assert pergrad.engine.gradient_tolerance("float32") == 1e-4


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_check_tolerances_follow_the_compute_dtype(policy, dtype_policy):
    dtype_policy(policy)
    keras.utils.set_random_seed(4)
    case = zoo.conv2d()
    pex = pergrad.PerExample(case.model, case.loss)
    assert keras.backend.standardize_dtype(pex.compute_dtype) == policy.removeprefix("mixed_")
    pex.check(case.x, case.y)  # tolerances of the half-precision dtype
    with pytest.raises(ValueError, match="do not add up"):  # float32's: the old false alarm
        pex.check(case.x, case.y, rtol=1e-4)
    rng = np.random.default_rng(6)
    ids, y = rng.integers(0, 7, size=(5, 3)), rng.integers(0, 7, size=5)
    tied = TiedEmbeddings()
    tied(ids)
    with pytest.raises(ValueError, match="embeddings"):  # still found in half precision
        pergrad.PerExample(tied, zoo.SCCE).check(ids, y)


@pytest.mark.only_on("jax", reason="jax_enable_x64 is JAX's switch for 64-bit arrays")
def test_float64_without_x64_on_jax_gets_float32_tolerances(float64):
    """Without ``jax_enable_x64`` a float64 model computes in float32 on JAX: its checks take
    float32's tolerances (float64's 1e-10 raised a false MixesExamplesError at 5e-8)."""
    import jax

    model = zoo.mlp().model
    assert pergrad.engine.compute_dtype(model) == "float64"
    jax.config.update("jax_enable_x64", False)
    try:
        assert pergrad.engine.compute_dtype(model) == "float32"
    finally:
        jax.config.update("jax_enable_x64", True)


def _generic_layers() -> keras.Model:
    inputs = keras.Input((6, 6, 2))
    h = L.DepthwiseConv2D(3, depth_multiplier=2, activation="tanh")(inputs)
    h = L.SeparableConv2D(3, 2)(h)
    h = L.Conv2DTranspose(2, 2, strides=2)(h)
    h = L.LSTM(4, return_sequences=True)(L.Reshape((6, 12))(h))
    # Recurrent dropout keeps the GRU on the generic rule (no rule reproduces random masks);
    # with training=False it draws none, so the replay is exact.
    return keras.Model(inputs, L.Dense(3)(L.GRU(3, recurrent_dropout=0.1)(h)))


@pytest.mark.slow(reason="every generic layer compiled under mixed_float16: 13-19 s")
def test_generic_layers_under_mixed_float16_match_the_float64_oracle(dtype_policy):
    """Replaying a generic layer must cast its float32 weights to float16 as Layer.__call__
    does; compared with a float64 twin at float16's tolerance (u = 4.9e-4)."""
    dtype_policy("mixed_float16")
    keras.utils.set_random_seed(5)
    model = _generic_layers()
    rng = np.random.default_rng(12)
    x, y = rng.normal(size=(5, 6, 6, 2)), rng.integers(0, 3, 5)
    pex = pergrad.PerExample(model, zoo.SCCE)
    # The GRU (recurrent dropout) takes the generic rule; the LSTM and the convolutions have
    # rules of their own now, and this model checks them under mixed precision too.
    assert {type(layer).__name__ for layer in pex.plan.generic} == {"GRU"}
    assert {"LSTM", "SeparableConv2D"} <= {type(layer).__name__ for layer, _ in pex.plan.ruled}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # SeparableConv2D: no pfor converter
        grads, norms = pex.gradients(x, y), pex.norms(x, y)
    keras.config.set_floatx("float64")
    dtype_policy("float64")
    twin = _generic_layers()
    twin.set_weights([w.astype("float64") for w in model.get_weights()])
    expected, _ = loop_gradients(twin, keras_loss(zoo.SCCE), x, y)
    scale = max(np.max(np.abs(e)) for e in expected)
    for g, e, v in zip(grads, expected, model.trainable_variables, strict=True):
        assert keras.backend.standardize_dtype(g.dtype) == "float32"
        assert_close(g, e, atol=1e-2 * scale, what=v.path)
    flat = np.concatenate([e.reshape(5, -1) for e in expected], axis=1)
    assert_close(norms, np.linalg.norm(flat, axis=1), rtol=1e-2)


# -- numeric arguments ------------------------------------------------------------------------------

def test_numeric_arguments_accept_numpy_scalars(float64):
    case = zoo.mlp()
    params = sum(int(np.prod(v.shape)) for v in case.model.trainable_variables)
    pex = pergrad.PerExample(case.model, case.loss, memory_budget_bytes=np.int64(2 * params * 8))
    expected = _oracle(case)
    for g, e in zip(pex.gradients(case.x, case.y), expected, strict=True):
        assert_close(g, e)
    # Chunks of 2, then 1: two shapes, two traces (PyTorch traces nothing).
    assert pex.trace_counts["gradients"] == (0 if pergrad.backend.is_torch() else 2)
    by_numpy, norms = pex.clipped_sum(case.x, case.y, np.float32(0.5))
    by_float, _ = pex.clipped_sum(case.x, case.y, 0.5)
    factors = np.minimum(1.0, 0.5 / keras.ops.convert_to_numpy(norms))
    for a, b, e in zip(by_numpy, by_float, expected, strict=True):
        assert_close(a, b, rtol=1e-12)
        assert_close(a, np.tensordot(factors, e, axes=1))
    pex.check(case.x, case.y, rtol=np.float64(1e-6), num_examples=np.int32(2))


@pytest.mark.parametrize("call, match", [
    (lambda m: pergrad.PerExample(m, "mse", memory_budget_bytes=True),
     "memory_budget_bytes must be a number, got the bool"),
    (lambda m: pergrad.PerExample(m, "mse", memory_budget_bytes=float("inf")),
     "memory_budget_bytes must be a finite number"),
    (lambda m: pergrad.PerExample(m, "mse", memory_budget_bytes=2.5),
     "memory_budget_bytes must be a whole number"),
    (lambda m: pergrad.PerExample(m, "mse", memory_budget_bytes="1e9"),
     "memory_budget_bytes must be a Python or NumPy number"),
    (lambda m: pergrad.PerExample(m, "mse").clipped_sum(_X, _Y, np.bool_(True)),
     "l2_norm_clip must be a number, got the bool"),
    (lambda m: pergrad.PerExample(m, "mse").clipped_sum(_X, _Y, float("nan")),
     "l2_norm_clip must be a finite number"),
    (lambda m: pergrad.PerExample(m, "mse").clipped_sum(_X, _Y, np.float32(np.inf)),
     "l2_norm_clip must be a finite number"),
    (lambda m: pergrad.PerExample(m, "mse").clipped_sum(_X, _Y, np.float32(-1.0)),
     "l2_norm_clip must be a finite number > 0"),
    (lambda m: pergrad.PerExample(m, "mse").check(_X, _Y, rtol=np.float64(np.nan)),
     "rtol must be a finite number"),
    (lambda m: pergrad.PerExample(m, "mse").example_mixing(_X, _Y, num_examples=0),
     "num_examples must be positive"),
    (lambda m: pergrad.PerExample(m, "mse").example_mixing(_X, _Y, num_examples=True),
     "num_examples must be a number, got the bool"),
])
def test_numeric_arguments_refuse_bools_and_non_finite_values(call, match):
    model = keras.Sequential([keras.Input((3,)), L.Dense(2)])
    with pytest.raises(ValueError, match=match):
        call(model)


_X, _Y = np.ones((4, 3)), np.ones((4, 2))
