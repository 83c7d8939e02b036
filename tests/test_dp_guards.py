"""Routes that used to break DP silently now fail loudly or stay private (issue 9, parts 3-6).

Each test is a reproducer of one silent failure: mixed-precision step skipping decided by one
example, batch statistics written to non-trainable variables, a monitor on a DP model, metrics
counting padding rows, bad aggregator arguments and empty batches.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
from pergrad import aggregate
from pergrad.backend.lazy import tensorflow as tf  # on first use: TensorFlow may be absent
from pergrad.keras import PerExampleModel


def _mlp():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


@pytest.fixture
def policy():
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy("float32")


# -- example mixing is refused before the first update ---------------------------------------------

def _mixing_model():
    return keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8),
        keras.layers.Lambda(lambda h: h - keras.ops.mean(h, axis=0, keepdims=True)),
        keras.layers.Dense(3)])


def _centered_loss(y, p):
    """A loss that mixes examples: each example's error minus the batch's mean error."""
    per_example = keras.ops.mean(keras.ops.square(y - p), axis=-1)
    return per_example - keras.ops.mean(per_example)


@pytest.mark.parametrize("aggregator", [aggregate.clip_mean(1.0), aggregate.dp_mean(1.0, 1.0),
                                        aggregate.normalized_mean()])
def test_a_mixing_layer_is_refused_before_any_update(rng, aggregator):
    inner = _mixing_model()
    before = inner.get_weights()
    model = PerExampleModel(inner, aggregator)
    model.compile(optimizer="sgd", loss="mse")
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    with pytest.raises(pergrad.MixesExamplesError, match="mixes examples.*Relative difference"):
        model.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(pergrad.MixesExamplesError):
        model.train_on_batch(x, y)
    for a, b in zip(inner.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0  # a refused step changes no state at all
    if model.noise_state is not None:
        assert keras.ops.convert_to_numpy(model.noise_state)[1] == 0


@pytest.mark.tensorflow_only(reason=(
    "the TensorFlow train step's 'without XLA' warning: with jit_compile=True it keeps the mixing "
    "check out of XLA (pergrad/backend/tensorflow/trainer.py)"))
def test_xla_cannot_skip_the_mixing_check(rng):
    model = PerExampleModel(_mixing_model(), aggregate.dp_mean(1.0, 1.0))
    with pytest.warns(UserWarning, match="without XLA"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    with pytest.raises(pergrad.MixesExamplesError):
        model.fit(x, y, batch_size=8, verbose=0)


def test_recompiling_with_a_mixing_loss_is_checked_again(rng):
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    model = PerExampleModel(_mlp(), aggregate.clip_mean(1.0))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, verbose=0)
    model.compile(optimizer="sgd", loss=_centered_loss)
    with pytest.raises(pergrad.MixesExamplesError):
        model.fit(x, y, batch_size=8, verbose=0)


def test_a_batch_dependent_loss_is_refused(rng):
    model = PerExampleModel(_mlp(), aggregate.dp_mean(1.0, 1.0))
    model.compile(optimizer="sgd", loss=_centered_loss)
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    with pytest.raises(pergrad.MixesExamplesError):
        model.fit(x, y, batch_size=8, verbose=0)


@pytest.mark.tensorflow_only(reason=(
    "reads mixing_checked, the TensorFlow train step's tf.Variable (JAX and PyTorch keep "
    "mixing_status instead)"))
def test_the_mixing_check_runs_once_and_can_be_turned_off(rng):
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    model = PerExampleModel(_mixing_model(), aggregate.clip_mean(1.0), check_example_mixing=False)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, verbose=0)  # the user has opted out
    plain = PerExampleModel(_mlp(), aggregate.clip_mean(1.0))
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert bool(plain.mixing_checked.numpy())
    unchecked = PerExampleModel(_mixing_model(), aggregate.mean())  # no bound to protect
    unchecked.compile(optimizer="sgd", loss="mse")
    unchecked.fit(x, y, batch_size=8, verbose=0)


# -- mixed precision: one example cannot decide whether a DP step happens ---------------------------

def _float16_dp_model(weights, clip):
    inner = _mlp()
    inner.set_weights(weights)
    model = PerExampleModel(inner, aggregate.dp_mean(clip, 0.0, expected_batch_size=16))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0 ** 8), loss="mse")
    return model


@pytest.mark.slow(reason="two float16 DP fits with the loss scale: ~35 s on TensorFlow")
def test_an_overflowing_example_is_dropped_and_the_dp_step_still_happens(rng, policy):
    """Under a DP aggregator, the example whose loss-scaled gradient overflows float16 is dropped
    like a NaN example: the update is the one without it (sigma = 0 makes it exact), the step is
    not skipped and the loss scale is not lowered by that one example."""
    policy("mixed_float16")
    weights = _mlp().get_weights()
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    y[5] = 5000.0  # gradient ~ 2 * 5000 / 3 * 256 > 65504: inf in float16, loss finite in float32
    model = _float16_dp_model(weights, clip=1.0)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert history.history["dropped_examples"] == [1.0]
    assert float(model.optimizer.dynamic_scale) == 2.0 ** 8
    assert int(model.optimizer.step_counter) == 0  # held: the scale never grows under DP

    without = _float16_dp_model(weights, clip=1.0)
    keep = np.arange(16) != 5
    without.fit(x[keep], y[keep], batch_size=15, epochs=1, verbose=0, shuffle=False)
    changed = False
    for a, b, w in zip(model.model.get_weights(), without.model.get_weights(), weights,
                       strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3)
        changed = changed or not np.array_equal(a, w)
    assert changed, "the DP step was skipped"


# -- state written from the batch -----------------------------------------------------------------

class RunningMean(keras.layers.Layer):
    """A layer that keeps a running mean of its inputs in a non-trainable variable."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 2), name="kernel")
        self.running = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                       trainable=False, name="running")

    def call(self, x, training=False):
        if training:
            self.running.assign(0.9 * self.running + 0.1 * keras.ops.mean(x, axis=0))
        return keras.ops.matmul(x, self.kernel)


def _running_mean_model(aggregator, **kwargs):
    inner = keras.Sequential([keras.Input((4,)), RunningMean()])
    model = PerExampleModel(inner, aggregator, **kwargs)
    model.compile(optimizer="sgd", loss="mse")
    return model, inner.layers[0].running


def test_dp_refuses_a_variable_written_from_the_batch(rng):
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    model, _ = _running_mean_model(aggregate.dp_mean(1.0, 1.0))
    with pytest.raises(ValueError, match=r"running.*released without noise.*allow_state_updates"):
        model.fit(x, y, batch_size=8, verbose=0)


@pytest.mark.parametrize("aggregator, kwargs", [
    (aggregate.mean(), {}),
    (aggregate.dp_mean(1.0, 1.0), {"allow_state_updates": True}),
])
def test_state_updates_still_apply_where_allowed(rng, aggregator, kwargs):
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    model, running = _running_mean_model(aggregator, **kwargs)
    model.fit(x, y, batch_size=8, verbose=0)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(running), 0.1 * x.mean(axis=0),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.only_on("tensorflow", "torch", reason=(
    "Keras on JAX refuses an unseeded keras.random.normal (Keras's global SeedGenerator) inside "
    "a traced function: there a layer must own its SeedGenerator"))
def test_random_draws_in_a_custom_layer_still_advance(rng):
    """Writes outside the model's own variables (Keras's global seed generator) are applied."""

    class Jitter(keras.layers.Layer):
        def call(self, x, training=False):
            return x + 0.01 * keras.random.normal(keras.ops.shape(x)) if training else x

    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3), Jitter()])
    model = PerExampleModel(inner, aggregate.dp_mean(1.0, 1.0))
    model.compile(optimizer="sgd", loss="mse")
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    from keras.src.random.seed_generator import global_seed_generator  # no public name

    state = global_seed_generator().state
    before = keras.ops.convert_to_numpy(state).copy()  # a copy: on PyTorch it may share memory
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert not np.array_equal(before, keras.ops.convert_to_numpy(state))


def test_dropout_keeps_drawing_new_masks_under_dp(rng):
    # Seeded: on PyTorch an unseeded Dropout draws from torch's own generator and never
    # advances its SeedGenerator (plain Keras too); a seeded one advances it on every backend.
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              keras.layers.Dropout(0.5, seed=7), keras.layers.Dense(3)])
    model = PerExampleModel(inner, aggregate.dp_mean(1.0, 1.0))
    model.compile(optimizer="sgd", loss="mse")
    state = inner.layers[1].seed_generator.state
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    before = keras.ops.convert_to_numpy(state).copy()  # a copy: on PyTorch it may share memory
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert not np.array_equal(before, keras.ops.convert_to_numpy(state))


# -- the monitor on a DP model ----------------------------------------------------------------------

def test_a_monitor_on_a_dp_model_warns_that_it_is_not_private():
    with pytest.warns(UserWarning, match="not differentially private"):
        PerExampleModel(_mlp(), aggregate.dp_mean(1.0, 1.0),
                        monitor=pergrad.keras.GradientMonitor())


# -- metrics do not count padding rows --------------------------------------------------------------

def test_zero_weight_rows_do_not_count_in_unweighted_metrics(rng):
    """Poisson padding rows (weight 0) used to count in ``metrics=["accuracy"]``."""
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
    x = rng.normal(size=(32, 6)).astype("float32")
    predicted = np.argmax(inner.predict(x, verbose=0), axis=1)
    weight = (np.arange(32) % 2).astype("float32")  # every other row is padding
    y = np.where(weight > 0, predicted, (predicted + 1) % 4)  # padding rows always wrong
    y[1::4] = (predicted[1::4] + 1) % 4  # half the real rows wrong too
    model = PerExampleModel(inner, aggregate.dp_mean(1.0, 1.0, expected_batch_size=16))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    history = model.fit(x, y, sample_weight=weight, batch_size=32, epochs=1, verbose=0)
    real = weight > 0
    assert history.history["accuracy"][0] == pytest.approx(np.mean(predicted[real] == y[real]))
    assert history.history["accuracy"][0] == pytest.approx(0.5)


# -- bad aggregator arguments and empty batches -----------------------------------------------------

def test_numpy_scalars_are_accepted_and_non_integers_refused():
    assert aggregate.clip_mean(np.float32(1.0)).config["l2_norm_clip"] == 1.0
    agg = aggregate.dp_mean(np.float64(1.0), np.float32(1.1), seed=np.int64(3),
                            expected_batch_size=np.int64(64))
    assert agg.config["expected_batch_size"] == 64 and agg.config["seed"] == 3
    assert aggregate.trimmed_mean(np.float32(0.25)).config["fraction"] == 0.25
    with pytest.raises(ValueError, match="expected_batch_size must be a whole number"):
        aggregate.dp_mean(1.0, 1.0, expected_batch_size=2.5)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        aggregate.clip_mean(True)


def _empty_partial(gathers: bool) -> aggregate.Partial:
    """A Partial of no rows, of the backend's tensors (TensorFlow's inside a tf.function)."""
    values = [keras.ops.zeros((0, 3))] if gathers else [keras.ops.zeros((3,))]
    include = keras.ops.zeros((0,)) if gathers else None
    zero = keras.ops.convert_to_tensor(0.0, "float32")
    return aggregate.Partial(values, zero, include, zero)


@pytest.mark.parametrize("make", [aggregate.mean, lambda: aggregate.clip_mean(1.0),
                                  lambda: aggregate.dp_mean(1.0, 1.0), aggregate.median,
                                  lambda: aggregate.trimmed_mean(0.1)])
@pytest.mark.tensorflow_only(reason=(
    "an empty batch through finalize() on a Partial of tf tensors with a tf.int64 key, eagerly "
    "and in a tf.function with a dynamic row count (tf.errors.InvalidArgumentError)"))
def test_an_empty_batch_is_an_error_not_a_number(make):
    agg = make()
    key = tf.constant([1, 2], tf.int64)
    with pytest.raises(ValueError, match="empty batch"):
        agg.finalize(_empty_partial(agg.gathers), key)

    @tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
    def dynamic(rows):
        partial = _empty_partial(agg.gathers)._replace(rows=rows)
        return agg.finalize(partial, key)

    with pytest.raises(tf.errors.InvalidArgumentError, match="empty batch"):
        dynamic(tf.constant(0.0))


def test_dp_mean_with_expected_batch_size_is_defined_on_an_empty_batch():
    """Sum over no examples (0) plus noise, divided by the expected size: a valid DP release."""
    agg = aggregate.dp_mean(2.0, 1.5, expected_batch_size=10)
    key = aggregate.NoiseStream(seed=4).next_key()  # [4, 0], as the backend holds keys
    update = keras.ops.convert_to_numpy(agg.finalize(
        _empty_partial(False)._replace(values=[keras.ops.zeros((20000,))]), key)[0])
    assert np.std(update) == pytest.approx(2.0 * 1.5 / 10, rel=0.03)


def test_aggregators_called_on_an_empty_engine_result():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    result = pergrad.PerExample(model, "mse").compute(keras.ops.zeros((0, 5)),
                                                      keras.ops.zeros((0, 3)))
    for agg in (aggregate.mean(), aggregate.dp_mean(1.0, 1.0), aggregate.median()):
        with pytest.raises(ValueError, match="empty batch"):
            agg(result)
    update = aggregate.dp_mean(1.0, 1.0, expected_batch_size=4)(result)
    update = [keras.ops.convert_to_numpy(u) for u in update]
    assert all(np.isfinite(u).all() and np.std(u) > 0 for u in update)


# -- the privacy callback is tied to the model's noise stream ---------------------------------------

def test_privacy_callback_charges_steps_taken_before_it_and_checks_sigma(rng, tmp_path):
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 3)).astype("float32")
    model = PerExampleModel(_mlp(), aggregate.dp_mean(1.0, 1.1))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 4 noisy steps, no callback
    model.train_on_batch(x[:8], y[:8])  # a fifth
    path = tmp_path / "dp.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    callback = pergrad.keras.PrivacyCallback(32, 8, 1.1, 1e-5)
    restored.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    assert callback.steps == 5 + 4
    assert callback.epsilon == pytest.approx(pergrad.privacy.epsilon_for_steps(0.25, 1.1, 9, 1e-5))
    with pytest.raises(ValueError, match="noise_multiplier=1.1"):
        restored.fit(x, y, batch_size=8, verbose=0,
                     callbacks=[pergrad.keras.PrivacyCallback(32, 8, 2.0, 1e-5)])


# -- models and arguments that used to end in errors far from their cause (issue 31) ---------------

def _frozen_mlp():
    model = _mlp()
    model.trainable = False  # all layers frozen: nothing to take gradients of
    return model


def test_a_model_without_trainable_weights_is_a_clear_error(rng):
    """Used to end in ``TypeError: reduce() of empty iterable`` deep in the norms."""
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    with pytest.raises(ValueError, match="no trainable weights.*trainable = True"):
        pergrad.PerExample(_frozen_mlp(), "mse").norms(x, y)
    model = PerExampleModel(_frozen_mlp(), aggregate.dp_mean(1.0, 1.1, seed=0))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="no trainable weights"):
        model.fit(x, y, batch_size=8, verbose=0)


@pytest.mark.parametrize("clip, sigma, name", [
    (1e308, 1.1, "l2_norm_clip"),           # beyond float32: used to fail converting to a tensor
    (1e30, 1e10, "l2_norm_clip \\* noise_multiplier"),  # the noise's stddev overflows float32
    (float("inf"), 1.0, "l2_norm_clip"),
    (float("nan"), 1.0, "l2_norm_clip"),
    (0.0, 1.0, "l2_norm_clip"),
    (1.0, float("inf"), "noise_multiplier"),
    (1.0, -0.5, "noise_multiplier"),
])
def test_dp_mean_refuses_a_clip_or_noise_out_of_range(clip, sigma, name):
    with pytest.raises(ValueError, match=name):
        aggregate.dp_mean(clip, sigma)


def test_the_largest_float32_noise_is_still_accepted():
    limit = float(np.finfo(np.float32).max)
    assert aggregate.dp_mean(limit, 1.0).config["l2_norm_clip"] == limit
    assert aggregate.dp_mean(1.0, limit).config["noise_multiplier"] == limit
    with pytest.raises(ValueError, match="l2_norm_clip"):
        aggregate.clip_mean(1e308)


def _swap_batch_and_time(t):
    return keras.ops.transpose(t, (1, 0, 2))


def _attention_over_the_batch():
    inputs = keras.Input((5, 4))
    h = keras.layers.Lambda(_swap_batch_and_time)(inputs)
    h = keras.layers.MultiHeadAttention(2, 3, name="attention")(h, h)
    return keras.Model(inputs, keras.layers.Lambda(_swap_batch_and_time)(h))


def _normalization_over_the_batch(axis):
    return keras.Sequential([keras.Input((5, 4), batch_size=8), keras.layers.Dense(4),
                             keras.layers.LayerNormalization(axis=axis, name="norm")])


def _refused_both_ways(make, x, y, match, fit=True):
    with pytest.raises(pergrad.MixesExamplesError, match=match):
        pergrad.PerExample(make(), "mse").norms(x, y)
    if not fit:
        return
    model = PerExampleModel(make(), aggregate.dp_mean(1.0, 1.1, seed=0))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(pergrad.MixesExamplesError):
        model.fit(x, y, batch_size=8, verbose=0)


def test_attention_over_the_batch_axis_is_refused(rng):
    """The attention's projections see the time axis as their batch: ``norms`` used to return 5
    norms for 8 examples, ``fit`` to end in ``Dimensions must be equal, but are 8 and 5``."""
    x, y = rng.normal(size=(8, 5, 4)).astype("float32"), rng.normal(size=(8, 5, 4)).astype("float32")
    _refused_both_ways(_attention_over_the_batch, x, y, "attention.*5 rows for a batch of 8")


@pytest.mark.parametrize("axis", [0, [0, 2], -3])
def test_layer_normalization_over_the_batch_axis_is_refused(rng, axis):
    """Used to end in ``Cannot reshape a tensor with 8 elements`` (norms) or in Keras's own
    shape error on the one-example call of the mixing check (fit)."""
    x, y = rng.normal(size=(8, 5, 4)).astype("float32"), rng.normal(size=(8, 5, 4)).astype("float32")
    # On PyTorch, Keras runs a LayerNormalization over one axis as torch's layer_norm, which
    # normalizes trailing axes only: the model cannot run at all over axis 0 there (Keras fails
    # while building PerExampleModel, before pergrad sees it), so only norms is checked.
    fit = not (keras.backend.backend() == "torch" and axis in (0, -3))
    _refused_both_ways(lambda: _normalization_over_the_batch(axis), x, y, "'norm'.*batch axis",
                       fit=fit)


class GatedBatchMean(keras.layers.Layer):
    """``h + g * mean_batch(h)`` with the gate ``g`` initialised at zero: it mixes examples
    only once training moves ``g`` (a ReZero/LayerScale gate, LoRA's ``B``)."""

    def build(self, input_shape):
        self.gate = self.add_weight(shape=(), initializer="zeros", name="gate")

    def call(self, h):
        return h + self.gate * keras.ops.mean(h, axis=0, keepdims=True)


def _gated_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(GatedBatchMean()(h)))


def test_mixing_behind_a_gate_at_zero_is_refused_before_the_gate_opens():
    """The reproducer of the issue: at initialisation the gate hides the batch mean, so a check
    of the current weights alone passed and ``dp_mean`` trained on while the gate opened. The
    check also evaluates perturbed weights, where the gate is open."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.integers(0, 2, 16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _gated_model()
    assert float(keras.ops.convert_to_numpy(model.layers[2].gate.value)) == 0.0
    with pytest.raises(pergrad.MixesExamplesError):
        pergrad.PerExample(model, loss).check(x, y)
    private = pergrad.keras.PerExampleModel(
        model, aggregator=pergrad.aggregate.dp_mean(1.0, 1.0, seed=0))
    private.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    before = [np.array(w) for w in model.get_weights()]
    with pytest.raises(pergrad.MixesExamplesError):
        private.fit(x, y, batch_size=8, epochs=3, verbose=0)
    for now, then in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(now, then)  # refused before any step


def test_the_perturbed_check_passes_a_model_that_does_not_mix():
    """A zero-initialised factor on a per-example path (no mixing) still passes."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="relu")(inputs)
    gated = keras.layers.Dense(6, kernel_initializer="zeros", use_bias=False)(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Add()([h, gated])))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.integers(0, 2, 16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pergrad.PerExample(model, loss).check(x, y)
    private = pergrad.keras.PerExampleModel(
        model, aggregator=pergrad.aggregate.dp_mean(1.0, 1.0, seed=0))
    private.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    private.fit(x, y, batch_size=8, epochs=1, verbose=0)
