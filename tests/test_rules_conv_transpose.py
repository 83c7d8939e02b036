"""Conv1DTranspose / Conv2DTranspose / Conv3DTranspose rules against the float64 loop oracle.

On every backend ``channels_last`` without dilation; ``channels_first`` and ``dilation_rate > 1``
on JAX and PyTorch only: TensorFlow on CPU has no ``channels_first`` kernel for the transposed
convolutions (``Conv2DBackpropInput`` / ``Conv3DBackpropInputV2``) and its kernels reject
dilation, so plain Keras cannot run them there.
"""

from __future__ import annotations

import dataclasses
import itertools

import keras
import numpy as np
import pytest
from oracle import assert_close
from rule_check import assert_rule_matches_oracle

from pergrad.backend.lazy import tensorflow as tf  # on first use: TensorFlow may be absent
from pergrad.rules import LayerCall
from pergrad.rules.conv_transpose import conv_transpose_rule

L = keras.layers
B = 4

# dims -> (layer class, input spatial size, kernel size)
LAYERS = {
    1: (L.Conv1DTranspose, (5,), 3),
    2: (L.Conv2DTranspose, (4, 3), (2, 3)),
    3: (L.Conv3DTranspose, (3, 2, 3), (2, 2, 3)),
}

# (strides, padding, output_padding, dilation_rate): output_padding must be < strides and Keras
# forbids dilation with strides. Dilation is checked apart: through a model on JAX and PyTorch
# (test_conv_transpose_rule_channels_first_and_dilated), against a zero-dilated kernel on
# TensorFlow (test_dilated_rule_...), whose CPU transposed-convolution kernels reject it.
GEOMETRIES = [
    (1, "valid", None, 1),
    (1, "same", None, 1),
    (2, "valid", None, 1),
    (2, "same", None, 1),
    (2, "valid", 1, 1),
    (2, "same", 1, 1),
]


def _case(dims: int, strides, padding: str, output_padding, dilation, use_bias: bool = True,
          channels: int = 2, filters: int = 3, data_format: str = "channels_last"):
    cls, size, kernel = LAYERS[dims]
    shape = (*size, channels) if data_format == "channels_last" else (channels, *size)
    inputs = keras.Input(shape)
    layer = cls(filters, kernel, strides=strides, padding=padding, output_padding=output_padding,
                dilation_rate=dilation, use_bias=use_bias, activation="relu",
                data_format=data_format)
    h = layer(inputs)
    outputs = L.Dense(3)(L.Flatten()(h))
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(dims)
    if use_bias:  # a nonzero bias, so its gradient is not hidden behind relu's dead zone
        layer.bias.assign(rng.normal(size=layer.bias.shape) * 0.1)
    x = rng.normal(size=(B, *shape))
    y = rng.integers(0, 3, size=B)
    return model, layer, conv_transpose_rule, x, y


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize(("strides", "padding", "output_padding", "dilation"), GEOMETRIES)
def test_conv_transpose_rule_matches_loop_oracle(dims, strides, padding, output_padding,
                                                 dilation, float64):
    assert_rule_matches_oracle(*_case(dims, strides, padding, output_padding, dilation))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_transpose_rule_without_bias(dims, float64):
    assert_rule_matches_oracle(*_case(dims, 2, "same", 1, 1, use_bias=False))


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize(("data_format", "strides", "padding", "output_padding", "dilation"), [
    ("channels_first", 2, "same", 1, 1),
    ("channels_first", 1, "same", None, 2),
    ("channels_last", 1, "valid", None, 2),
])
@pytest.mark.only_on("jax", "torch", reason=(
    "TensorFlow's CPU transposed-convolution kernels have no channels_first form and reject "
    "dilation_rate > 1, so plain Keras (the oracle) cannot run these layers there"))
def test_conv_transpose_rule_channels_first_and_dilated(dims, data_format, strides, padding,
                                                        output_padding, dilation, float64):
    assert_rule_matches_oracle(*_case(dims, strides, padding, output_padding, dilation,
                                      data_format=data_format))


def test_conv_transpose_stride_larger_than_kernel(float64):
    """``valid`` padding with ``strides`` above the kernel span: Keras pads the output with
    ``strides - span`` positions no kernel offset reaches (their gradient is zero)."""
    inputs = keras.Input((4, 2))
    layer = L.Conv1DTranspose(3, 2, strides=3, activation="relu")
    outputs = L.Dense(3)(L.Flatten()(layer(inputs)))
    model = keras.Model(inputs, outputs)
    layer.bias.assign(np.full(3, 0.1))
    rng = np.random.default_rng(3)
    assert_rule_matches_oracle(model, layer, conv_transpose_rule, rng.normal(size=(B, 4, 2)),
                               rng.integers(0, 3, size=B))


def _dilated_kernel(kernel: tf.Tensor, dilation: int) -> tf.Tensor:
    """``kernel`` with ``dilation - 1`` zeros between its taps on every spatial axis."""
    spatial = kernel.shape[:-2]
    offsets = list(itertools.product(*[range(k) for k in spatial]))
    shape = [(k - 1) * dilation + 1 for k in spatial] + list(kernel.shape[-2:])
    values = tf.stack([kernel[o] for o in offsets])
    return tf.scatter_nd([[o * dilation for o in off] for off in offsets], values, shape)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("padding", ["valid", "same"])
@pytest.mark.tensorflow_only(reason=(
    "its oracle is per-example tf.GradientTape passes through a zero-dilated kernel built "
    "with tf.scatter_nd, fed tf.constant inputs"))
def test_dilated_rule_matches_dilated_kernel_oracle(dims, padding, float64):
    """A dilated transposed convolution is the undilated one with a zero-dilated kernel. TF's
    CPU kernels refuse ``dilation_rate > 1`` for the layer itself, so the rule is called directly
    with a random output gradient and compared with per-example tapes of that equivalent."""
    cls, size, kernel_size = LAYERS[dims]
    layer = cls(3, kernel_size, padding=padding, dilation_rate=2)
    layer.build((None, *size, 2))
    rng = np.random.default_rng(dims)
    x = tf.constant(rng.normal(size=(B, *size, 2)))
    out_shape = layer.compute_output_shape((B, *size, 2))
    d = tf.constant(rng.normal(size=out_shape))

    expected_kernel, expected_bias = [], []
    for i in range(B):
        with tf.GradientTape() as tape:
            kernel, bias = tf.identity(layer.kernel), tf.identity(layer.bias)
            tape.watch([kernel, bias])
            y = keras.ops.conv_transpose(x[i:i + 1], _dilated_kernel(kernel, 2),
                                         padding=padding) + bias
            assert tuple(y.shape) == (1, *out_shape[1:])
            total = tf.reduce_sum(y * d[i:i + 1])
        gk, gb = tape.gradient(total, [kernel, bias])
        expected_kernel.append(gk.numpy())
        expected_bias.append(gb.numpy())
    expected_kernel, expected_bias = np.stack(expected_kernel), np.stack(expected_bias)

    kernel_form, bias_form = conv_transpose_rule(layer, LayerCall(layer, (x,), {}, None), d)
    plain = dataclasses.replace(kernel_form, summed=None)  # the native sum needs the CPU kernel
    assert_close(plain.materialize(), expected_kernel, what="kernel")
    assert_close(bias_form.materialize(), expected_bias, what="bias")
    flat = np.concatenate([expected_kernel.reshape(B, -1), expected_bias], axis=1)
    assert_close(plain.squared_norms() + bias_form.squared_norms(),
                 np.sum(flat ** 2, axis=1), what="norms")
    c = rng.uniform(size=B)
    assert_close(plain.weighted_sum(tf.constant(c)), np.tensordot(c, expected_kernel, axes=1),
                 what="weighted sum")
