"""The convolution rule's shifted-slice route (per-example kernel gradients as one batched
product per kernel offset, stride 1, at least ``SHIFTED_MIN_CHANNELS`` input channels or a 1x1
kernel) against the float64 loop oracle, in every geometry it takes."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import zoo
from oracle import assert_close, keras_loss, loop_gradients
from rule_check import assert_rule_matches_oracle

import pergrad
from pergrad.rules.conv import conv_rule
from pergrad.rules.cost import SHIFTED_MIN_CHANNELS, folded_products_win, shifted_products_win
from pergrad.rules.forms import Factored
from pergrad.rules.query import NORMS_THEN_ROWS, NORMS_THEN_SUMS

L = keras.layers
B = 4
WIDE = SHIFTED_MIN_CHANNELS

# (layer class, input spatial size, keyword arguments, input channels)
CASES = {
    "1d_valid": (L.Conv1D, (7,), dict(kernel_size=3), WIDE),
    "1d_causal_dilated": (L.Conv1D, (8,), dict(kernel_size=3, padding="causal",
                                                dilation_rate=2), WIDE),
    "2d_same": (L.Conv2D, (5, 6), dict(kernel_size=(3, 2), padding="same"), WIDE),
    "2d_dilated_valid": (L.Conv2D, (6, 7), dict(kernel_size=2, dilation_rate=(2, 1)), WIDE),
    # Keras runs channels_first 3D convolutions on TensorFlow's CPU (through XLA), not 2D ones.
    "3d_channels_first": (L.Conv3D, (3, 4, 5), dict(kernel_size=(2, 3, 2), padding="same",
                                                    data_format="channels_first"), WIDE),
    "2d_1x1_narrow": (L.Conv2D, (4, 5), dict(kernel_size=1), 3),
    "3d_same": (L.Conv3D, (3, 4, 5), dict(kernel_size=2, padding="same"), WIDE),
}


# Strided convolutions whose kernel is a whole number of strides: on TensorFlow their products
# come from the input folded by the strides (space to depth), at least SHIFTED_MIN_CHANNELS
# folded channels.
FOLDED = {
    "folded_2d_valid": (L.Conv2D, (9, 9), dict(kernel_size=4, strides=2), WIDE // 4),
    "folded_2d_same_uneven": (L.Conv2D, (9, 10), dict(kernel_size=(4, 3), strides=(2, 3),
                                                      padding="same"), WIDE // 4),
    "folded_1d_causal": (L.Conv1D, (11,), dict(kernel_size=4, strides=2, padding="causal"),
                         WIDE // 2),
    "folded_1d_patchify": (L.Conv1D, (12,), dict(kernel_size=3, strides=3), WIDE),
    "folded_3d_same": (L.Conv3D, (5, 6, 3), dict(kernel_size=(4, 4, 1), strides=(2, 2, 1),
                                                 padding="same"), WIDE // 4),
    "folded_3d_channels_first": (L.Conv3D, (4, 4, 3), dict(kernel_size=(2, 2, 3),
                                                          strides=(2, 2, 3),
                                                          data_format="channels_first"),
                                 WIDE // 4),
}


def _case(name: str):
    cls, size, kwargs, channels = {**CASES, **FOLDED}[name]
    channels_first = kwargs.get("data_format") == "channels_first"
    shape = (channels, *size) if channels_first else (*size, channels)
    inputs = keras.Input(shape)
    layer = cls(3, activation="tanh", **kwargs)
    outputs = L.Dense(3)(L.Flatten()(layer(inputs)))
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(len(name))
    layer.bias.assign(rng.normal(size=layer.bias.shape) * 0.1)
    return model, layer, conv_rule, rng.normal(size=(B, *shape)), rng.integers(0, 3, size=B)


def _kernel_form(model, layer, x, y) -> Factored:
    pex = pergrad.PerExample(model, zoo.SCCE)
    result = pex.compute(keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y))
    index = [v.path for v in model.trainable_variables].index(layer.kernel.path)
    return result.forms[index]


@pytest.mark.parametrize("name", sorted(CASES))
def test_shifted_route_matches_loop_oracle(name, float64):
    model, layer, rule, x, y = _case(name)
    assert shifted_products_win(layer.kernel_size, layer.strides, CASES[name][3])
    assert _kernel_form(model, layer, x, y).per_example is not None  # the route is taken
    assert_rule_matches_oracle(model, layer, rule, x, y)

    # A sum without norms (the mean aggregator's): the native filter gradient on TensorFlow,
    # the GEMM over the shifted slices elsewhere.
    pex = pergrad.PerExample(model, zoo.SCCE)
    weights = np.random.default_rng(1).uniform(0.5, 2.0, size=B)
    summed = pex.compiled("weighted_sum", lambda x, y, w: pex.compute(x, y).weighted_sum(w))(
        *pex.prepare(x, y, weights))
    expected, _ = loop_gradients(model, keras_loss(zoo.SCCE), x, y)
    for s, e, v in zip(summed, expected, model.trainable_variables, strict=True):
        assert_close(s, np.tensordot(weights, e, axes=1), what=f"weighted sum {v.path}")


@pytest.mark.parametrize("name", ["1d_valid", "2d_same", "2d_1x1_narrow", "folded_2d_valid",
                                  "folded_2d_same_uneven"])
def test_products_by_offset_in_every_reduction(name, float64):
    """The per-example products, kept as one block per kernel offset on TensorFlow, in every
    reduction that reads them after the norms: the Gram matrix, several weighted sums and
    several dot products at once, and the materialized gradients, against the loop oracle."""
    model, layer, _, x, y = _case(name)
    expected, _ = loop_gradients(model, keras_loss(zoo.SCCE), x, y)
    rng = np.random.default_rng(5)
    coefficients = [rng.normal(size=B), rng.uniform(size=B)]
    vector_sets = [[rng.normal(size=v.shape) for v in model.trainable_variables]
                   for _ in range(2)]
    pex = pergrad.PerExample(model, zoo.SCCE)

    def body(x, y, w, coefficients, vector_sets):
        result = pex.compute(x, y, w)
        norms = result.norms()
        return (norms, result.gram(), result.weighted_sums(coefficients),
                result.dots_many(vector_sets), result.gradients())

    cast = [keras.ops.convert_to_tensor(c, "float64") for c in coefficients]
    vectors = [[keras.ops.convert_to_tensor(v) for v in vs] for vs in vector_sets]
    norms, gram, sums, dots, grads = pex.compiled("blocks", body)(*pex.prepare(x, y), cast,
                                                                  vectors)
    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    assert_close(norms, np.linalg.norm(flat, axis=1), what="norms")
    assert_close(gram, flat @ flat.T, what="gram")
    for c, got in zip(coefficients, sums, strict=True):
        for g, e in zip(got, expected, strict=True):
            assert_close(g, np.tensordot(c, e, axes=1), what="weighted_sums")
    for vs, got in zip(vector_sets, dots, strict=True):
        for g, e, v in zip(got, expected, vs, strict=True):
            assert_close(g, e.reshape(B, -1) @ v.ravel(), what="dots_many")
    for g, e, v in zip(grads, expected, model.trainable_variables, strict=True):
        assert_close(g, e, what=f"gradients {v.path}")


@pytest.mark.parametrize("name", ["1d_valid", "1d_causal_dilated", "2d_same", "2d_dilated_valid",
                                  "3d_channels_first", "3d_same"])
def test_shifted_ghost_norms_match_loop_oracle(name, float64, monkeypatch):
    """Norms alone by the shifted Gram of the input (``ghost_norms``, forced here: the cost
    model takes it on larger layers), and every other reduction of the same unrouted result
    (Gram matrix, weighted sums, dots, gradients, each by its route when asked alone), against
    the loop oracle. Norms that rows follow (``NORMS_THEN_ROWS``) take the per-example products
    instead."""
    from pergrad.rules import conv

    monkeypatch.setattr(conv, "shifted_ghost_wins", lambda *args: True)
    model, layer, rule, x, y = _case(name)
    form = _kernel_form(model, layer, x, y)
    assert form.ghost_norms is not None
    assert_rule_matches_oracle(model, layer, rule, x, y)

    expected, _ = loop_gradients(model, keras_loss(zoo.SCCE), x, y)
    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    index = [v.path for v in model.trainable_variables].index(layer.kernel.path)
    kernel_norms = np.sum(expected[index].reshape(B, -1) ** 2, axis=1)
    assert_close(form.squared_norms(), kernel_norms, what="ghost squared norms")
    assert form.route_for(NORMS_THEN_ROWS).norms == "matrices"
    assert_close(form.routed(NORMS_THEN_ROWS).squared_norms(), kernel_norms,
                 what="products' norms")

    rng = np.random.default_rng(11)
    c = rng.normal(size=B)
    vectors = [rng.normal(size=v.shape) for v in model.trainable_variables]
    pex = pergrad.PerExample(model, zoo.SCCE)

    def body(x, y, w, c, vectors):
        result = pex.compute(x, y, w)
        return (result.norms(), result.gram(), result.weighted_sum(c), result.dots(vectors),
                result.gradients())

    norms, gram, sums, dots, grads = pex.compiled("ghost", body)(
        *pex.prepare(x, y), keras.ops.convert_to_tensor(c, "float64"),
        [keras.ops.convert_to_tensor(v) for v in vectors])
    assert_close(norms, np.linalg.norm(flat, axis=1), what="norms")
    assert_close(gram, flat @ flat.T, what="gram")
    for g, e in zip(sums, expected, strict=True):
        assert_close(g, np.tensordot(c, e, axes=1), what="weighted sum")
    for g, e, v in zip(dots, expected, vectors, strict=True):
        assert_close(g, e.reshape(B, -1) @ v.ravel(), what="dots")
    for g, e in zip(grads, expected, strict=True):
        assert_close(g, e, what="gradients")


def test_a_routed_form_keeps_its_routes_when_rebuilt():
    """``rebuilt()`` (read inside a conditional branch) remakes a convolution's form from the
    layer's recorded tensors; a routed form's remade form keeps the routes declared for it, an
    unrouted one stays unrouted."""
    model, layer, _, x, y = _case("2d_same")
    form = _kernel_form(model, layer, x, y)
    assert form.remake is not None
    routed = form.routed(NORMS_THEN_SUMS)
    assert routed.rebuilt() is not routed and routed.rebuilt().route == routed.route
    assert form.rebuilt().route is None


@pytest.mark.parametrize("name", ["1d_valid", "1d_causal_dilated"])
def test_filter_gradient_sums_after_shifted_ghost_norms(name, float64, monkeypatch):
    """On JAX a 1-D convolution whose batch kernel gradient is XLA's filter gradient
    (``xla_filter_gradient_wins``, forced here) takes the shifted ghost norms before a clipped
    sum too, and sums through the filter gradient; elsewhere the sum reads the products. Both
    against the oracle, with a NaN row dropped (the masked sum inside the conditional), a sum
    without norms and the ``clip_mean`` aggregator."""
    from pergrad.rules import conv

    monkeypatch.setattr(conv, "shifted_ghost_wins", lambda *args: True)
    monkeypatch.setattr(conv, "xla_filter_gradient_wins", lambda *args: True)
    model, layer, rule, x, y = _case(name)
    form = _kernel_form(model, layer, x, y)
    on_jax = keras.backend.backend() == "jax"
    assert form.ghost_before_sums == on_jax
    assert form.routed(NORMS_THEN_SUMS).route.norms == ("rule_ghost" if on_jax else "matrices")
    assert_rule_matches_oracle(model, layer, rule, x, y)

    expected, _ = loop_gradients(model, keras_loss(zoo.SCCE), x, y)
    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    clean = np.linalg.norm(flat, axis=1)
    clip = float(np.median(clean))
    pex = pergrad.PerExample(model, zoo.SCCE)
    summed, norms = pex.clipped_sum(x, y, clip)
    assert_close(norms, clean, what="norms before the clipped sum")
    for s, e in zip(summed, expected, strict=True):
        assert_close(s, np.tensordot(np.minimum(1.0, clip / clean), e, axes=1),
                     what="clipped sum")
    x_bad = x.copy()
    x_bad[1] = np.nan
    summed, _ = pex.clipped_sum(x_bad, y, clip)
    factors = np.where(np.arange(B) == 1, 0.0, np.minimum(1.0, clip / clean))
    for s, e in zip(summed, expected, strict=True):
        assert_close(s, np.tensordot(factors, e, axes=1), what="clipped sum without row 1")
    sums = pex.compiled("mean", lambda x, y, w: pex.compute(x, y, w).weighted_sum(
        keras.ops.ones([B], "float64")))(*pex.prepare(x, y))
    for s, e in zip(sums, expected, strict=True):
        assert_close(s, e.sum(0), what="sum without norms")

    # The linear aggregators' local step asks for norms before sums only, as clipped_sum does.
    from pergrad.engine.result import PerExampleResult

    agg = pergrad.aggregate.clip_mean(clip)
    result = pex.compute(keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y))
    queries = []
    routed = PerExampleResult.routed
    monkeypatch.setattr(PerExampleResult, "routed",
                        lambda self, query: queries.append(query) or routed(self, query))
    mean = agg.finalize(agg.local(result, pergrad.aggregate.Batch.of(result)), None)
    assert queries[0] == NORMS_THEN_SUMS
    for m, e in zip(mean, expected, strict=True):
        assert_close(m, np.tensordot(np.minimum(1.0, clip / clean), e, axes=1) / B,
                     what="clip_mean")


def test_xla_filter_gradient_cost_model():
    from pergrad.rules.cost import xla_filter_gradient_wins

    assert xla_filter_gradient_wins(1, 256 * 124 * 5 * 64 * 128)  # the text CNN's Conv1D
    assert not xla_filter_gradient_wins(1, 256 * 98 * 3 * 16 * 32)  # small: the GEMMs win
    assert not xla_filter_gradient_wins(2, 128 * 32 * 32 * 9 * 32 * 32)  # 2-D: the GEMMs win
    assert not xla_filter_gradient_wins(1, None)


def test_shifted_ghost_cost_model():
    from pergrad.rules.cost import shifted_ghost_cost, shifted_ghost_wins

    # The text CNN's Conv1D: 128 input positions, 124 outputs, 64 -> 128 channels, kernel 5.
    assert shifted_ghost_cost(128, 124, 64, 128, 5) == 128**2 * 64 + 124**2 * (128 + 5)
    assert shifted_ghost_wins(128, 124, 64, 128, 5)
    assert shifted_ghost_wins(100, 64, 128, 128, 9)  # 8x8x128, 3x3 "same"
    assert not shifted_ghost_wins(34 * 34, 32 * 32, 32, 32, 9)  # 32x32x32: T^2 dominates
    assert not shifted_ghost_wins(None, 124, 64, 128, 5)


@pytest.mark.parametrize("name", sorted(FOLDED))
def test_folded_route_matches_loop_oracle(name, float64):
    """Products from the input folded by the strides: the route is taken on TensorFlow (the
    other backends keep the patches), and every quantity matches the oracle."""
    model, layer, rule, x, y = _case(name)
    cls, _, kwargs, channels = FOLDED[name]
    assert folded_products_win(layer.kernel_size, layer.strides, layer.dilation_rate, channels)
    from pergrad.rules.cost import torch_grouped_filter_gradients_win

    taken = _kernel_form(model, layer, x, y).per_example is not None
    # PyTorch takes its grouped filter gradient instead where it wins there
    torch_grouped = keras.backend.backend() == "torch" and torch_grouped_filter_gradients_win(
        layer.kernel_size, layer.dilation_rate, channels)
    assert taken == (keras.backend.backend() == "tensorflow" or torch_grouped)
    assert_rule_matches_oracle(model, layer, rule, x, y)


def test_folded_route_needs_whole_strides_and_enough_channels():
    assert not folded_products_win((3, 3), (2, 2), (1, 1), 64)  # 3 is not a multiple of 2
    assert not folded_products_win((4, 4), (2, 2), (2, 2), 64)  # dilated
    assert not folded_products_win((8, 8), (2, 2), (1, 1), 1)  # 4 folded channels
    assert not folded_products_win((3, 3), (1, 1), (1, 1), 64)  # stride 1: the shifted route
    assert folded_products_win((4, 4), (2, 2), (1, 1), 16)


def test_strided_and_narrow_convolutions_keep_the_patch_route(float64):
    """In float64 (no grouped route on TensorFlow): a strided 3x3 convolution over 16 channels
    (144 wide: PyTorch gathers its patches by strided slices, which beat its grouped filter
    gradient there) and a narrow one (3 channels, 27 wide) build patches everywhere."""
    model, layer, _, x, y = _case("2d_same")
    strided = keras.Model(model.inputs, L.Dense(3)(L.Flatten()(
        L.Conv2D(3, 3, strides=2)(model.inputs[0]))))
    narrow = zoo.conv2d()  # 3 input channels, 3x3 kernel
    assert _kernel_form(strided, strided.layers[1], x, y).per_example is None
    assert _kernel_form(narrow.model, narrow.model.layers[1], narrow.x,
                        narrow.y).per_example is None


def test_shared_layer_and_dropped_rows(float64):
    """One wide Conv1D called twice (its products from both calls add up); a NaN input row is
    dropped from the clipped sum and the other rows match the oracle."""
    inputs = keras.Input((9, WIDE))
    conv = L.Conv1D(WIDE, 3, padding="same", activation="tanh")
    outputs = L.Dense(3)(L.Flatten()(conv(conv(inputs))))
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(B, 9, WIDE)), rng.integers(0, 3, size=B)
    assert_rule_matches_oracle(model, conv, conv_rule, x, y)

    expected, _ = loop_gradients(model, keras_loss(zoo.SCCE), x, y)
    x_bad = x.copy()
    x_bad[2] = np.nan
    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    clean = np.linalg.norm(flat, axis=1)
    clip = float(np.median(clean))
    summed, norms = pergrad.PerExample(model, zoo.SCCE).clipped_sum(x_bad, y, clip)
    assert not np.isfinite(np.asarray(norms)[2])
    factors = np.where(np.arange(B) == 2, 0.0, np.minimum(1.0, clip / clean))
    for s, e in zip(summed, expected, strict=True):
        assert_close(s, np.tensordot(factors, e, axes=1), what="clipped sum without row 2")


@pytest.mark.parametrize("name", ["1d_causal_dilated", "2d_same", "3d_same"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_chunked_products_match_loop_oracle(name, chunk, float64, monkeypatch):
    """On JAX the per-example products are computed over chunks of examples (``lax.map``):
    chunks of one example, and of three for a batch of four (a remainder chunk after the
    map). Elsewhere the same call takes the whole batch."""
    from pergrad.rules import conv

    monkeypatch.setattr(conv, "examples_per_chunk", lambda bytes_per_example: chunk)
    model, layer, rule, x, y = _case(name)
    assert_rule_matches_oracle(model, layer, rule, x, y)


def test_map_in_chunks_keeps_rows_in_order():
    from pergrad.backend.ops import map_in_chunks

    a = np.arange(7 * 2, dtype="float32").reshape(7, 2)
    b = np.arange(7, dtype="float32")[:, None]
    for chunk in (1, 2, 3, 7, 10):
        got = map_in_chunks(lambda p, q: p * q, (keras.ops.convert_to_tensor(a),
                                                 keras.ops.convert_to_tensor(b)), chunk)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), a * b)


# Convolutions that take neither the shifted nor the folded route and whose patches are at least
# GROUPED_MIN_PATCH_WIDTH wide, or would take the shifted route with few channels: on
# TensorFlow, in float32, their per-example products come from one grouped filter gradient with
# the batch as groups. (layer class, input spatial size,
# keyword arguments, input channels)
GROUPED = {
    "grouped_2d_strided_same": (L.Conv2D, (12, 12), dict(kernel_size=8, strides=2,
                                                         padding="same"), 1),
    "grouped_2d_uneven_strides": (L.Conv2D, (9, 10), dict(kernel_size=(3, 4), strides=(2, 1)), 4),
    "grouped_1d_causal_strided": (L.Conv1D, (13,), dict(kernel_size=5, strides=2,
                                                        padding="causal"), 8),
    "grouped_2d_valid_stride_3": (L.Conv2D, (14, 15), dict(kernel_size=6, strides=3), 1),
    # stride 1, 16 channels: the shifted products' geometry, which the grouped route replaces
    "grouped_1d_over_shifted": (L.Conv1D, (9,), dict(kernel_size=3, padding="same"), WIDE),
}


def _grouped_case(name: str, dtype: str):
    cls, size, kwargs, channels = GROUPED[name]
    channels_first = kwargs.get("data_format") == "channels_first"
    shape = (channels, *size) if channels_first else (*size, channels)
    inputs = keras.Input(shape, dtype=dtype)
    layer = cls(3, activation="tanh", dtype=dtype, **kwargs)
    model = keras.Model(inputs, L.Dense(3, dtype=dtype)(L.Flatten(dtype=dtype)(layer(inputs))))
    rng = np.random.default_rng(len(name))
    model.set_weights([rng.normal(size=w.shape) * 0.3 for w in model.get_weights()])
    return model, layer, rng.normal(size=(B, *shape)), rng.integers(0, 3, size=B)


def _onednn_expected() -> bool:
    """Only TensorFlow's oneDNN kernels run a grouped filter gradient; whether they are on
    depends on the release, the CPU and ``TF_ENABLE_ONEDNN_OPTS``, so TensorFlow is asked."""
    from pergrad import _compat

    return keras.backend.backend() == "tensorflow" and _compat.onednn_enabled()


def test_grouped_route_cost_model_and_availability():
    from pergrad.rules.conv import grouped_filter_gradients_available
    from pergrad.rules.cost import grouped_filter_gradients_win

    assert grouped_filter_gradients_win((8, 8), (1, 1), 1)  # the benchmark CNN's first layer
    assert grouped_filter_gradients_win((3, 3), (1, 1), 4)  # 36: the measured boundary
    assert not grouped_filter_gradients_win((3, 3), (1, 1), 3)  # 27: the patches won
    assert not grouped_filter_gradients_win((8, 8), (2, 2), 1)  # dilated: no CPU kernel
    assert not grouped_filter_gradients_win((3, 3, 3), (1, 1, 1), 4)  # 3-D
    assert grouped_filter_gradients_win((3, 3), (1, 1), 16, over_shifted=True)
    assert not grouped_filter_gradients_win((3, 3), (1, 1), 64, over_shifted=True)
    assert not grouped_filter_gradients_win((1, 1), (1, 1), 16, over_shifted=True)  # 1x1
    assert not grouped_filter_gradients_win((1, 1), (1, 1), 64)  # a strided 1x1 shortcut
    assert not grouped_filter_gradients_win((3, 3), (1, 1), 32)  # the ResNet's strided layers
    if keras.backend.backend() == "tensorflow":
        assert not grouped_filter_gradients_available("float64")  # Eigen's kernel refuses
        assert grouped_filter_gradients_available("float32") == _onednn_expected()


def _grouped_route_expected(layer, channels: int) -> bool:
    """Where the grouped route must be taken: TensorFlow with oneDNN (every case here), PyTorch
    by its own cost rule, never on JAX."""
    from pergrad.rules.cost import torch_grouped_filter_gradients_win

    if keras.backend.backend() == "tensorflow":
        return _onednn_expected()
    if keras.backend.backend() == "torch":
        shifted = shifted_products_win(layer.kernel_size, layer.strides, channels)
        return torch_grouped_filter_gradients_win(layer.kernel_size, layer.dilation_rate,
                                                  channels, over_shifted=shifted)
    return False


def _spy_grouped(monkeypatch) -> list:
    """Record each call of the grouped route."""
    from pergrad.rules import conv

    calls = []
    route = conv._grouped_products
    monkeypatch.setattr(conv, "_grouped_products", lambda *a: calls.append(1) or route(*a))
    return calls


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_grouped_route_matches_float64_loop_oracle(name, float64, monkeypatch):
    """The grouped route, in float32 (the dtypes its kernel runs), against the float64 loop
    oracle of a float64 twin with the same weights: gradients, norms, dots and clipped sums to
    float32 precision. It is taken on TensorFlow with oneDNN; on JAX the same check
    covers the patch route; on PyTorch its own route is taken where its cost rule says.
    (``float64`` sets the twin's backend up for float64; the model
    under test is float32 by its layers' dtype.)"""
    calls = _spy_grouped(monkeypatch)
    model, layer, x, y = _grouped_case(name, "float32")
    twin, _, _, _ = _grouped_case(name, "float64")
    twin.set_weights(model.get_weights())
    expected, _ = loop_gradients(twin, keras_loss(zoo.SCCE), x, y)
    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    x32 = x.astype("float32")

    pex = pergrad.PerExample(model, zoo.SCCE)
    for g, e, v in zip(pex.gradients(x32, y), expected, model.trainable_variables, strict=True):
        assert_close(g, e, rtol=2e-5, what=v.path)
    assert_close(pex.norms(x32, y), norms, rtol=2e-5, what="norms")
    rng = np.random.default_rng(7)
    vectors = [rng.normal(size=v.shape).astype("float32") for v in model.trainable_variables]
    assert_close(pex.dot(x32, y, vectors), flat @ np.concatenate([v.ravel() for v in vectors]),
                 rtol=2e-5, what="dot")
    clip = float(np.median(norms))
    summed, _ = pex.clipped_sum(x32, y, clip)
    factors = np.minimum(1.0, clip / norms)
    for s, e in zip(summed, expected, strict=True):
        assert_close(s, np.tensordot(factors, e, axes=1), rtol=2e-5, what="clipped_sum")
    assert bool(calls) == _grouped_route_expected(layer, GROUPED[name][3])


def test_grouped_route_not_under_xla(monkeypatch):
    """Under ``jit_compile=True`` XLA would compile the grouped filter gradient into a slow
    loop: the patch route is taken, with the same results."""
    if keras.backend.backend() == "torch":
        pytest.skip("PyTorch runs eagerly: jit_compile does not reach XLA, and its grouped "
                    "filter gradient is torch's own kernel")
    from pergrad.rules import conv

    calls = []
    grouped = conv._grouped_products
    monkeypatch.setattr(conv, "_grouped_products", lambda *a: calls.append(1) or grouped(*a))
    model, _, x, y = _grouped_case("grouped_2d_strided_same", "float32")
    x32 = x.astype("float32")
    compiled = pergrad.PerExample(model, zoo.SCCE, jit_compile=True).norms(x32, y)
    assert not calls
    assert_close(compiled, pergrad.PerExample(model, zoo.SCCE).norms(x32, y), rtol=1e-5,
                 what="norms under XLA")


def test_grouped_route_with_a_dynamic_batch(monkeypatch):
    """Traced once for any batch size (``None`` batch dimension): the grouped filter gradient's
    filter size is computed from the batch at run time."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("a TensorFlow input signature")
    import tensorflow as tf

    from pergrad.rules import conv

    calls = []
    grouped = conv._grouped_products
    monkeypatch.setattr(conv, "_grouped_products", lambda *a: calls.append(1) or grouped(*a))
    model, _, x, y = _grouped_case("grouped_2d_uneven_strides", "float32")
    pex = pergrad.PerExample(model, zoo.SCCE)
    norms = tf.function(lambda x, y: pex.compute(x, y).norms(), input_signature=[
        tf.TensorSpec([None, *x.shape[1:]], "float32"), tf.TensorSpec([None], "int64")])
    got = {size: norms(x[:size].astype("float32"), y[:size]) for size in (B, 2)}
    assert norms.experimental_get_tracing_count() == 1
    assert bool(calls) == _onednn_expected()  # traced by the dynamic function alone
    for size, value in got.items():
        assert_close(value, pex.norms(x[:size].astype("float32"), y[:size]), rtol=1e-5,
                     what=f"norms, batch {size}")


@pytest.mark.parametrize("name", ["1d_valid", "2d_same"])
def test_grouped_route_over_the_shifted_products_in_float64(name, float64, monkeypatch):
    """In float64 a 2-D shifted products' geometry takes the grouped route on PyTorch (its
    kernel runs every dtype) and keeps the shifted products on TensorFlow (oneDNN refuses
    float64) and JAX; a 1-D one keeps them everywhere (the grouped route lost on PyTorch's
    text CNN); every quantity matches the oracle either way."""
    from pergrad.rules.cost import torch_grouped_filter_gradients_win

    calls = _spy_grouped(monkeypatch)
    model, layer, rule, x, y = _case(name)
    assert_rule_matches_oracle(model, layer, rule, x, y)
    two_d = len(layer.kernel_size) == 2
    assert bool(calls) == (keras.backend.backend() == "torch" and two_d)
    assert torch_grouped_filter_gradients_win(layer.kernel_size, layer.dilation_rate, WIDE,
                                              over_shifted=True) == two_d
    assert not torch_grouped_filter_gradients_win((1, 1), (1, 1), WIDE, over_shifted=True)
    assert not torch_grouped_filter_gradients_win((3, 3), (1, 1), 4)  # 36 wide: patches won
    assert not torch_grouped_filter_gradients_win((3, 3), (1, 1), 64, over_shifted=True)
    assert torch_grouped_filter_gradients_win((8, 8), (1, 1), 2)  # 128 wide: one-hot patches
    assert not torch_grouped_filter_gradients_win((4, 4), (1, 1), 16)  # 256: sliced patches won


@pytest.mark.parametrize("name", ["1d_valid", "2d_same", "3d_same"])
def test_patches_are_built_only_where_a_route_reads_them(name, float64, monkeypatch):
    """PyTorch runs every op as written, so a convolution's patches are deferred
    (``pergrad.rules.forms.Deferred``): the shifted products (1-D, 3-D) and the grouped filter
    gradient (2-D) never build them for norms, clipped sums, gradients or Gram matrices, and
    a narrow convolution's route over the patches builds them once. TensorFlow and JAX build them in the graph, which drops
    what no output reads, and must not defer (a tensor made inside a conditional branch is not
    usable outside it)."""
    from pergrad.rules import conv
    from pergrad.rules.forms import Deferred

    built = []
    extract = conv.extract_patches
    monkeypatch.setattr(conv, "extract_patches", lambda *a: built.append(1) or extract(*a))
    model, layer, _, x, y = _case(name)
    form = _kernel_form(model, layer, x, y)
    torch = keras.backend.backend() == "torch"
    assert isinstance(form.a_source, Deferred) == torch
    assert form.a_shape == tuple(form.a.shape)
    if not torch:
        return
    built.clear()
    form = _kernel_form(model, layer, x, y).routed(NORMS_THEN_ROWS)
    form.squared_norms()
    form.weighted_sum(np.ones(B) / B)
    form.materialize()
    form.gram()
    assert form.per_example is not None and not built
    narrow = zoo.conv2d()  # 3 input channels, 3x3 kernel: 27 wide, the patch route
    form = _kernel_form(narrow.model, narrow.model.layers[1], narrow.x, narrow.y)
    assert form.per_example is None and not built
    form = form.routed(NORMS_THEN_ROWS)
    form.squared_norms()
    form.weighted_sum(np.ones(len(narrow.x)) / len(narrow.x))
    form.materialize()
    assert built == [1]
