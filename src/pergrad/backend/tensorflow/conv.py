"""TensorFlow's native convolution kernels for per-example products, the batch folded into the
channels (one group per example), and whether they run here (oneDNN's kernels do; Eigen's and
XLA's do not)."""

from __future__ import annotations

import functools
from typing import Any

import keras
import tensorflow as tf

from pergrad._compat import tracing_for_xla


def fold_batch_into_channels(t: Any) -> Any:
    """``(B, H, W, F) -> (1, H, W, B F)``: example ``i``'s channel ``f`` becomes channel
    ``i F + f`` of one image, for native kernels that keep channel groups apart."""
    shape = tf.shape(t)
    return tf.reshape(tf.transpose(t, [1, 2, 0, 3]), [1, shape[1], shape[2], -1])


@functools.cache
def _grouped_filter_gradients_run(dtype: str) -> bool:
    with tf.init_scope():  # eagerly, even while a graph is being traced
        try:
            tf.compat.v1.nn.conv2d_backprop_filter(
                tf.zeros([1, 3, 3, 4], dtype), [2, 2, 2, 6], tf.zeros([1, 2, 2, 6], dtype),
                [1, 1, 1, 1], "VALID")
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
            return False
    return True


def grouped_filter_gradients_available(dtype: Any) -> bool:
    """Whether TensorFlow runs a grouped ``Conv2DBackpropFilter`` (input channels a multiple of
    the filter's) for ``dtype`` in the graph being built: its oneDNN kernel does (float32 and
    bfloat16 on x86), its Eigen kernel (float64, float16, or ``TF_ENABLE_ONEDNN_OPTS=0``) refuses,
    and XLA (``jit_compile=True``) compiles it into a loop that takes seconds. Asked once per
    dtype by running the op on a tiny input."""
    return not tracing_for_xla() and _grouped_filter_gradients_run(
        keras.backend.standardize_dtype(dtype))


def grouped_filter_gradients(source: Any, d: Any, kernel_size: tuple, strides: tuple,
                             padding: str) -> Any:
    """``(B, 1, O, K C)``: every example's kernel gradient of a 1-D or 2-D convolution from one
    grouped filter gradient. ``source`` is the channels-last input as the kernel pads it by
    ``padding``, ``d`` the output gradient.

    Example ``i``'s channel ``c`` becomes channel ``i C + c`` of one image of ``B C`` channels
    and its output ``o`` channel ``i O + o``; a convolution of that image with ``B`` groups
    (``C`` inputs, ``O`` outputs each) is the batch's convolutions side by side, and its filter
    gradient ``(*k, C, B O)`` holds ``dL_i/dW[K, c, o]`` at ``[K, c, i O + o]``. 1-D
    convolutions run as images of height 1."""
    kernel_size, strides = tuple(kernel_size), tuple(strides)
    if len(kernel_size) == 1:
        source, d = source[:, None], d[:, None]
        kernel_size, strides = (1, *kernel_size), (1, *strides)
    batch, c_in, c_out = tf.shape(source)[0], source.shape[-1], d.shape[-1]
    g = tf.compat.v1.nn.conv2d_backprop_filter(
        fold_batch_into_channels(source), tf.stack([*kernel_size, c_in, batch * c_out]),
        fold_batch_into_channels(d), [1, *strides, 1], padding.upper())
    g = tf.reshape(g, [-1, batch, c_out])  # (K C, B, O), K in kernel order
    return tf.transpose(g, [1, 2, 0])[:, None]


def depthwise_filter_gradients(source: Any, d: Any, kernel_size: tuple, strides: tuple,
                               dilation: tuple, padding: str, multiplier: int) -> Any:
    """``(B, C, M, K)``: every example's depthwise kernel gradient from one native depthwise
    filter gradient, with the batch folded into the channels (no dilation: the CPU kernel has
    none).

    Depthwise channels never mix, so example ``i``'s channel ``c`` becomes channel ``i C + c`` of
    one image of ``B C`` channels (and its outputs ``(i C + c) M + m``); the filter gradient of
    that image, ``(*k, B C, M)``, holds ``dL_i/dW[K, c, m]`` at ``[K, i C + c, m]``. The batch
    may be dynamic (the filter size is a tensor)."""
    kernel_size, strides = tuple(kernel_size), tuple(strides)
    if len(kernel_size) == 1:  # as one row of a 2D image; the kernel wants equal strides
        source, d = source[:, None], d[:, None]
        kernel_size, strides = (1, *kernel_size), (strides[0], *strides)
    batch, c = tf.shape(source)[0], source.shape[-1]
    g = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
        fold_batch_into_channels(source), tf.stack([*kernel_size, batch * c, multiplier]),
        fold_batch_into_channels(d), [1, *strides, 1], padding.upper())
    g = tf.reshape(g, [-1, batch, c, multiplier])  # (K, B, C, M)
    return tf.transpose(g, [1, 2, 3, 0])


def depthwise_products_by_forward_conv(padded: Any, d: Any, sizes: list, kernel_size: tuple,
                                       strides: tuple, dilation: tuple,
                                       multiplier: int) -> Any:
    """``(B, C, M, K)``: every example's depthwise kernel gradient as one forward depthwise
    convolution of the ``"valid"``-padded input, the batch folded into the channels, with the
    output gradient as its filter (``sizes``: the output size per axis).

    With ``X`` the padded input, strides ``s``, dilation ``r`` and outputs ``o``,
    ``dL_i/dW[k, c, m] = sum_o X_i[s o + r k, c] D_i[o, c M + m]``: a cross-correlation of
    ``X_i`` (channel ``c``) with the filter ``D_i`` (channel ``c M + m``), dilated by ``s``,
    evaluated at the ``K`` offsets ``r k`` (a convolution strided by ``r``; one of ``s`` and
    ``r`` is 1). Example ``i``'s channel ``c``, repeated ``M`` times, becomes channels
    ``(i C + c) M + m`` of one image, and ``D``'s channels line up with them, so one depthwise
    convolution with multiplier 1 gives ``(1, *k, B C M)``."""
    kernel_size, strides, dilation = tuple(kernel_size), tuple(strides), tuple(dilation)
    batch = tf.shape(padded)[0]
    if len(kernel_size) == 1:  # as one row of a 2D image; the kernel wants equal strides
        padded, d, sizes = padded[:, None], d[:, None], [1, *sizes]
        kernel_size, strides, dilation = ((1, *kernel_size), (strides[0], *strides),
                                          (dilation[0], *dilation))
    # only the rows and columns the last output's window reaches (strides may leave some)
    reach = [(n - 1) * s + r * (k - 1) + 1
             for n, s, r, k in zip(sizes, strides, dilation, kernel_size, strict=True)]
    if any(not isinstance(r, int) or r != n for r, n in zip(reach, padded.shape[1:3],
                                                            strict=True)):
        padded = padded[:, :reach[0], :reach[1]]
    c = padded.shape[-1]
    image = fold_batch_into_channels(padded)  # (1, H, W, B C)
    if multiplier > 1:
        image = tf.repeat(image, multiplier, axis=-1)  # (1, H, W, B C M)
    shape = tf.shape(d)
    kernels = tf.reshape(tf.transpose(d, [1, 2, 0, 3]), [shape[1], shape[2], -1, 1])
    # the layer's dilation r reads offsets r k: the convolution's own strides (the caller
    # takes this route for a dilated layer only where its strides are 1)
    g = tf.nn.depthwise_conv2d(image, kernels, [1, *dilation, 1], "VALID", dilations=strides)
    g = tf.reshape(g, [-1, batch, c, multiplier])  # (K, B, C, M)
    return tf.transpose(g, [1, 2, 3, 0])
