"""``pergrad.keras.replace_batch_normalization``: a DP-ready copy of a model with BatchNormalization.

The copy has GroupNormalization (LayerNormalization for odd channel counts) in place of every
BatchNormalization, the BatchNormalizations' gamma and beta, every other weight exactly, and
leaves the original alone; it trains under DP-SGD where the original is refused, and its
per-example gradients match the float64 loop oracle.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from oracle import assert_close, keras_loss, loop_gradients

import pergrad
from pergrad import aggregate
from pergrad._compat import sublayers
from pergrad.engine.checks import mixing_error
from pergrad.keras import PerExampleModel, replace_batch_normalization
from pergrad.keras.batch_norm import group_count

L = keras.layers
# JAX compiles every op of a keras.applications model on first use: building and calling one
# took 20-22 s on a 2-core CPU (TensorFlow and PyTorch: 2-11 s), a slow check there.
SLOW_ON_JAX = ([pytest.mark.slow(reason="a keras.applications model takes ~20 s on JAX")]
               if keras.backend.backend() == "jax" else [])


def _numpy(tensor) -> np.ndarray:
    return keras.ops.convert_to_numpy(tensor)


def _all_layers(model) -> list:
    return sublayers(model, include_self=False)


def _of(model, cls) -> list:
    return [layer for layer in _all_layers(model) if isinstance(layer, cls)]


def _randomize(model, rng) -> None:
    """Random values in every floating weight (moving statistics too; variances positive), so
    that copying them is visible."""
    for variable in model.weights:
        if not keras.backend.standardize_dtype(variable.dtype).startswith("float"):
            continue
        value = 0.5 * rng.normal(size=variable.shape)
        if "variance" in variable.path:
            value = 1.0 + np.abs(value)
        variable.assign(value.astype(variable.dtype))


def _snapshot(model) -> list:
    return [np.array(w) for w in model.get_weights()]


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def _pairs(original, copy):
    """``(layer, its copy)``, matched by name within each (nested) model."""
    copies = {layer.name: layer for layer in copy.layers}
    for layer in original.layers:
        if isinstance(layer, L.InputLayer):
            continue
        twin = copies[layer.name]
        if isinstance(layer, keras.Model):
            yield from _pairs(layer, twin)
        else:
            yield layer, twin


def _assert_replaced(original, copy) -> None:
    """No BatchNormalization left; every other layer's weights equal; gamma and beta copied."""
    assert not _of(copy, L.BatchNormalization)
    assert _of(copy, (L.GroupNormalization, L.LayerNormalization))
    for layer, twin in _pairs(original, copy):
        assert twin is not layer
        if isinstance(layer, L.BatchNormalization):
            assert isinstance(twin, (L.GroupNormalization, L.LayerNormalization))
            assert twin.axis in (layer.axis, [layer.axis])
            assert twin.epsilon == layer.epsilon
            for name in ("gamma", "beta"):
                source = getattr(layer, name)
                target = getattr(twin, name)
                assert (source is None) == (target is None), f"{layer.name}.{name}"
                if source is not None:
                    np.testing.assert_array_equal(_numpy(target), _numpy(source))
        else:
            assert type(twin) is type(layer)
            _assert_same(twin.get_weights(), layer.get_weights())


def _conv_net(channels=(8, 6, 5), batch_norm=True, input_shape=(8, 8, 3)):
    """A small functional CNN: conv -> normalization -> relu per block, then a dense head;
    BatchNormalization in every block (one without scale, one without center) unless not
    ``batch_norm`` (then LayerNormalization, which needs no replacement)."""
    inputs = keras.Input(input_shape)
    h = inputs
    for k, c in enumerate(channels):
        h = L.Conv2D(c, 3, padding="same", name=f"conv{k}")(h)
        if batch_norm:
            h = L.BatchNormalization(scale=k != 1, center=k != 2, epsilon=1e-3 + k * 1e-4,
                                     name=f"bn{k}")(h)
        else:
            h = L.LayerNormalization(name=f"ln{k}")(h)
        h = L.Activation("relu")(h)
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, L.Dense(4, name="head")(h), name="conv_net")


# -- the rule for the group count -------------------------------------------------------------------

@pytest.mark.parametrize("channels, groups, expected", [
    (16, None, 16), (32, None, 32), (64, None, 32), (72, None, 8), (24, None, 8), (96, None, 32),
    (6, None, 2), (5, None, None), (3, None, None),
    (12, 4, 4), (64, 64, 64), (12, 5, 4), (16, 3, 2), (9, 3, 3), (9, 2, None),
])
def test_group_count(channels, groups, expected):
    assert group_count(channels, groups) == expected


# -- keras.applications models ----------------------------------------------------------------------

@pytest.mark.parametrize("name", [pytest.param(name, marks=SLOW_ON_JAX)
                                  for name in ("MobileNetV3Small", "EfficientNetV2B0")])
def test_applications_models_lose_every_batch_normalization(name, rng):
    original = getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3),
                                                 classes=5)
    _randomize(original, rng)
    before = _snapshot(original)
    copy = replace_batch_normalization(original, verbose=False)
    _assert_replaced(original, copy)
    _assert_same(_snapshot(original), before)  # the input model is untouched
    assert _of(original, L.BatchNormalization)
    x = rng.normal(size=(2, 32, 32, 3)).astype("float32")
    out = _numpy(copy(x))
    assert out.shape == (2, 5) and np.all(np.isfinite(out))


@pytest.mark.parametrize("name", ["MobileNetV3Large", "ResNet50V2", "DenseNet121"])
@pytest.mark.tensorflow_only(reason=(
    "not yet run on JAX/PyTorch: backend-neutral Keras (the small models here check the copy on "
    "every backend); kept to TensorFlow for time, as there is no slow marker: would need one, JAX "
    "compiling each keras.applications model for ~50 s on 2 cores"))
def test_larger_applications_models(name, rng):
    """TensorFlow only (this project has no slow marker): 2-5 s each at 32x32 on 2 CPU cores."""
    original = getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3),
                                                  classes=3)
    count = len(_of(original, L.BatchNormalization))
    copy = replace_batch_normalization(original, verbose=False)
    assert not _of(copy, L.BatchNormalization)
    assert len(_of(copy, (L.GroupNormalization, L.LayerNormalization))) == count
    assert tuple(copy(rng.normal(size=(1, 32, 32, 3)).astype("float32")).shape) == (1, 3)


# -- what is kept, what is printed ------------------------------------------------------------------

def test_groups_and_the_printed_list(rng, capsys):
    original = _conv_net()
    _randomize(original, rng)
    copy = replace_batch_normalization(original, groups=4)
    _assert_replaced(original, copy)
    assert copy.get_layer("bn0").groups == 4  # 8 channels: 4 divides
    assert copy.get_layer("bn1").groups == 2  # 6 channels: 4 does not, 2 does
    assert isinstance(copy.get_layer("bn2"), L.LayerNormalization)  # 5 channels
    assert copy.get_layer("bn1").scale is False and copy.get_layer("bn2").center is False
    printed = capsys.readouterr().out
    assert "3 BatchNormalization layer(s) replaced" in printed
    assert "bn0: BatchNormalization -> GroupNormalization, 8 channels, 4 groups" in printed
    assert "bn1: BatchNormalization -> GroupNormalization, 6 channels, 2 groups" in printed
    assert "bn2: BatchNormalization -> LayerNormalization, 5 channels" in printed
    replace_batch_normalization(original, verbose=False)
    assert capsys.readouterr().out == ""


def _swap_rows_and_columns(t):
    return keras.ops.transpose(t, (0, 2, 1, 3))


def test_a_model_without_batch_normalization_is_copied_exactly(rng):
    """Same outputs, separate weights: Lambda with a named function, dropout, LayerNormalization."""
    inputs = keras.Input((8, 8, 3))
    h = L.Conv2D(4, 3)(inputs)
    h = L.Lambda(_swap_rows_and_columns)(h)
    h = L.Lambda(lambda t: t * 2.0)(h)
    h = L.LayerNormalization()(h)
    h = L.Dropout(0.5)(L.Flatten()(h))
    original = keras.Model(inputs, L.Dense(3)(h))
    x = rng.normal(size=(4, 8, 8, 3)).astype("float32")
    copy = replace_batch_normalization(original, verbose=False)
    np.testing.assert_array_equal(_numpy(copy(x)), _numpy(original(x)))
    assert {id(v) for v in copy.weights}.isdisjoint(id(v) for v in original.weights)
    copy.layers[1].kernel.assign(np.zeros(copy.layers[1].kernel.shape))
    assert np.any(_numpy(original.layers[1].kernel) != 0)


def test_sequential_and_nested_models(rng):
    """A Functional model nested in a Sequential one nested in a Functional one, each with a
    BatchNormalization; names repeat across levels (weights are matched level by level)."""
    inner = keras.Sequential([keras.Input((6,)), L.Dense(8, name="dense"),
                              L.BatchNormalization(name="bn")], name="inner")
    block_in = keras.Input((8,))
    block = keras.Model(block_in, L.BatchNormalization(name="bn")(L.Dense(8, name="dense")(
        block_in)), name="block")
    middle = keras.Sequential([keras.Input((6,)), inner, block], name="middle")
    outer_in = keras.Input((6,))
    h = L.BatchNormalization(name="bn_top")(middle(outer_in))
    original = keras.Model(outer_in, L.Dense(2, name="head")(h), name="outer")
    _randomize(original, rng)
    before = _snapshot(original)
    copy = replace_batch_normalization(original, verbose=False)
    assert len(_of(copy, L.GroupNormalization)) == 3 and not _of(copy, L.BatchNormalization)
    _assert_same(_snapshot(original), before)
    for path in (("middle", "inner"), ("middle", "block")):
        a, b = original, copy
        for name in path:
            a, b = a.get_layer(name), b.get_layer(name)
        _assert_replaced(a, b)
    _assert_replaced(original, copy)


# -- refusals ----------------------------------------------------------------------------------------

class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.bn = L.BatchNormalization()
        self.dense = L.Dense(2)

    def call(self, x):
        return self.dense(self.bn(x))


class _Block(L.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = L.Dense(4)
        self.norm = L.BatchNormalization(name="hidden_bn")

    def call(self, x):
        return self.norm(self.dense(x))


def test_what_cannot_be_replaced_is_refused_by_name():
    subclassed = _Subclassed()
    subclassed(np.zeros((2, 3), "float32"))
    with pytest.raises(ValueError, match="'subclassed' is a subclassed"):
        replace_batch_normalization(subclassed, verbose=False)

    inputs = keras.Input((3,))
    custom = keras.Model(inputs, _Block(name="block")(inputs))
    with pytest.raises(ValueError, match="'hidden_bn' is inside layer 'block'"):
        replace_batch_normalization(custom, verbose=False)

    one = keras.Sequential([keras.Input((3,)), L.Dense(1), L.BatchNormalization(name="one")])
    with pytest.raises(ValueError, match="'one' normalizes 1 channel"):
        replace_batch_normalization(one, verbose=False)

    unbuilt = keras.Sequential([L.Dense(2), L.BatchNormalization()], name="unbuilt")
    with pytest.raises(ValueError, match="'unbuilt' is not built"):
        replace_batch_normalization(unbuilt, verbose=False)
    with pytest.raises(ValueError, match="groups"):
        replace_batch_normalization(one, groups=0)


# -- DP training and per-example gradients ----------------------------------------------------------

def _dp_model(model):
    dp = PerExampleModel(model, aggregate.dp_mean(1.0, 1.1, seed=0))
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return dp


def test_the_copy_trains_under_dp_where_batch_normalization_is_refused(rng):
    x = rng.normal(size=(8, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")
    original = _conv_net()
    with pytest.raises(pergrad.MixesExamplesError,
                       match=r"pergrad\.keras\.replace_batch_normalization\(model\)"):
        _dp_model(original).fit(x, y, batch_size=8, verbose=0)
    copy = replace_batch_normalization(original, verbose=False)
    before = _snapshot(copy)
    history = _dp_model(copy).fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    after = _snapshot(copy)
    assert all(np.all(np.isfinite(w)) for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))


def test_the_mixing_error_names_the_replacement():
    assert "replace_batch_normalization(model)" in str(mixing_error(0, 1.0))


def test_per_example_gradients_of_the_copy_match_the_loop_oracle(float64, rng):
    original = _conv_net(channels=(4, 6), input_shape=(5, 5, 2))
    _randomize(original, rng)
    copy = replace_batch_normalization(original, verbose=False)
    x = rng.normal(size=(5, 5, 5, 2))
    y = rng.normal(size=(5, 4))
    expected, _ = loop_gradients(copy, keras_loss("mse"), x, y)
    grads = pergrad.PerExample(copy, "mse").gradients(x, y)
    scale = max(np.max(np.abs(e)) for e in expected)
    for g, e, v in zip(grads, expected, copy.trainable_variables, strict=True):
        assert_close(g, e, atol=1e-6 * scale, what=v.path)
    assert {type(layer).__name__ for layer, _ in pergrad.PerExample(copy, "mse").plan.ruled} \
        >= {"GroupNormalization", "Conv2D", "Dense"}
