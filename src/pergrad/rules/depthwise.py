"""DepthwiseConv1D / DepthwiseConv2D and SeparableConv1D / SeparableConv2D: any strides, dilation,
``valid``/``same`` padding, ``depth_multiplier``, ``channels_last`` and ``channels_first``.

A depthwise kernel ``W`` of shape ``(*k, C, M)`` maps channel ``c`` to outputs ``c*M + m``. With
``P_i[t, K, c]`` the input patch that output position ``t`` of example ``i`` sees and ``D_i[t, c*M + m]``
the gradient at the pre-activation output,

    dL_i/dW[K, c, m] = sum_t P_i[t, K, c] D_i[t, c*M + m]        dL_i/db = sum_t D_i[t]

a ``Factored`` form with one group per input channel (``A = P``, ``I = K``, ``G = C``, ``O = M``),
whose natural layout ``(*k, C, M)`` is the kernel's own.

A separable convolution is a depthwise one giving ``Z_i[t] = sum_K P_i[t, K] W_d[K]`` followed by
a pointwise (1x1) kernel ``W_p`` of shape ``(1.., C*M, F)``:

    dL_i/dW_p[j, f] = sum_t Z_i[t, j] D_i[t, f]                  (``Factored``, ``A = Z``)
    dL_i/dW_d       = the depthwise formula with D_mid = D W_p^T  (the 1x1 convolution's backward)
"""

from __future__ import annotations

import math
from functools import partial

import keras
from keras import ops

from pergrad.backend import is_tensorflow, is_torch
from pergrad.backend.ops import batch_size, dtype_of, rank, vjp, zero_rows
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.conv import (
    channels_last_input_and_grad,
    extract_patches,
    fold_batch_into_channels,
    grouped_filter_gradients_available,
    native_padding,
    pad_input,
)
from pergrad.rules.forms import Deferred, Factored, Materialized, positions


def _patches(layer, x):
    """``(B, T, C, K)``: the patches of channels-last ``x``, one group per channel."""
    patches = extract_patches(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                              layer.padding)  # (B, *out, K, C)
    t = positions(patches.shape[1:-2])
    k, c = patches.shape[-2], patches.shape[-1]
    return ops.transpose(ops.reshape(patches, [batch_size(x), t, k, c]), [0, 1, 3, 2])


def _depthwise_form(layer, kernel, x, d) -> Factored:
    """The ``Factored`` form of depthwise ``kernel`` ``(*k, C, M)`` from the channels-last input
    ``x`` and gradient ``d`` at the depthwise output ``(B, *out, C*M)``.

    On TensorFlow the norms, dots and sums use native kernels (:func:`_per_example_filter_gradients`
    or :func:`_per_example_by_forward_conv`, as :func:`forward_conv_products_win` chooses, and
    the batch filter gradient) that never read the patches, so a compiled graph never builds
    them. On PyTorch the per-example products come from one native grouped filter
    gradient too (:func:`_torch_per_example_filter_gradients`) and the patches are built only
    if a route reads them; on JAX the grouped einsum over the patches is the fastest route."""
    c, m = kernel.shape[-2], kernel.shape[-1]
    t = positions(d.shape[1:-1])
    dd = ops.reshape(d, [batch_size(d), t, c, m])
    if is_torch():
        def remake_torch(keep):
            return _depthwise_form(layer, kernel, zero_rows(x, keep), zero_rows(d, keep))

        a = Deferred(lambda: _patches(layer, x), (batch_size(x), t, c, math.prod(
            layer.kernel_size)), dtype_of(x))
        return Factored(kernel, a, dd, (*layer.kernel_size, c, m), remake=remake_torch,
                        per_example=lambda: _torch_per_example_filter_gradients(
                            layer, kernel, x, d))
    a = _patches(layer, x)  # (B, T, C, K)
    if not is_tensorflow():  # XLA's depthwise filter gradients lose to the einsum on CPU
        return Factored(kernel, a, dd, (*layer.kernel_size, c, m))

    def summed(coefficients):
        weights = ops.cast(coefficients, d.dtype)[(slice(None),) + (None,) * (rank(d) - 1)]
        return _filter_gradient(layer, kernel, x, d * weights)

    def per_example():
        if forward_conv_products_win(layer, x):
            return _per_example_by_forward_conv(layer, kernel, x, d)
        return _per_example_filter_gradients(layer, kernel, x, d)

    def remake(keep):
        return _depthwise_form(layer, kernel, zero_rows(x, keep), zero_rows(d, keep))

    if set(layer.dilation_rate) != {1}:  # the folded filter gradient has no dilation on CPU
        # the forward convolution strides by the dilation (so the layer's own strides must be
        # 1: both at once is another computation), and its kernel wants equal strides
        possible = set(layer.strides) == {1} and len(set(layer.dilation_rate)) == 1
        per_example = (partial(_per_example_by_forward_conv, layer, kernel, x, d)
                       if possible and forward_conv_products_win(layer, x) else None)
    return Factored(kernel, a, dd, (*layer.kernel_size, c, m), summed=summed,
                    per_example=per_example, remake=remake)


def _per_example_filter_gradients(layer, kernel, x, d):
    """``(B, C, M, K)``: every example's kernel gradient from one native depthwise filter
    gradient (TensorFlow), with the batch folded into the channels.

    Depthwise channels never mix, so example ``i``'s channel ``c`` becomes channel ``i C + c`` of
    one image of ``B C`` channels (and its outputs ``(i C + c) M + m``); the filter gradient of
    that image, ``(*k, B C, M)``, holds ``dL_i/dW[K, c, m]`` at ``[K, i C + c, m]``. On
    TensorFlow's CPU kernel this costs about two batch filter gradients, far less than the patch
    einsum (docs/benchmarks.md, "Route measurements"). The batch may be dynamic (the filter
    size is a tensor); the kernel has no dilation on CPU.
    """
    import tensorflow as tf

    padded, padding = native_padding(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                                     layer.padding)
    kernel_size, strides = tuple(layer.kernel_size), tuple(layer.strides)
    if len(kernel_size) == 1:  # as one row of a 2D image; the kernel wants equal strides
        padded, d = padded[:, None], d[:, None]
        kernel_size, strides = (1, *kernel_size), (strides[0], *strides)
    batch, c, m = tf.shape(x)[0], kernel.shape[-2], kernel.shape[-1]

    g = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
        fold_batch_into_channels(padded), tf.stack([*kernel_size, batch * c, m]),
        fold_batch_into_channels(d), [1, *strides, 1], padding.upper())
    g = tf.reshape(g, [-1, batch, c, m])  # (K, B, C, M)
    return tf.transpose(g, [1, 2, 3, 0])


#: The largest kernel side for which oneDNN's depthwise filter gradient (TensorFlow on x86) stays
#: fast with the batch folded into the channels (docs: :func:`forward_conv_products_win`).
ONEDNN_FOLDED_MAX_KERNEL = 3


def forward_conv_products_win(layer, x) -> bool:
    """Whether the per-example depthwise products come from :func:`_per_example_by_forward_conv`
    (one forward depthwise convolution) rather than :func:`_per_example_filter_gradients` (one
    filter gradient with the batch folded into the channels), on TensorFlow.

    oneDNN (TensorFlow's float32 and bfloat16 kernels on x86, detected as
    :func:`pergrad.rules.conv.grouped_filter_gradients_available` does) runs the folded filter
    gradient fast only on its fast path: a kernel at most :data:`ONEDNN_FOLDED_MAX_KERNEL`
    wide on every axis, ``depth_multiplier`` 1 and an input at least as large as the kernel.
    Off it, at batch 32, it took 20 to 100 times the batch filter gradient (MobileNetV3Small's
    5x5 layers, EfficientNetV2B0's 3x3 layers on 2x2 inputs with 1152 channels), while the
    forward convolution took about as long as the batch filter gradient. On its fast path the
    folded filter gradient is as fast or faster (up to 1.9x on a 56x56 input), and Eigen's
    kernels (float64, ``TF_ENABLE_ONEDNN_OPTS=0``) and XLA keep it everywhere: there the
    forward convolution was up to 4x slower (docs/benchmarks.md, "Route measurements"). A
    spatial size unknown when traced counts as no smaller than the kernel. A dilated layer
    (which the folded filter gradient cannot take) compares against the patch einsum instead,
    unmeasured: it takes this route where an undilated layer of its shape would."""
    if not grouped_filter_gradients_available(x.dtype):
        return False
    kernel_size = tuple(layer.kernel_size)
    if layer.depth_multiplier != 1 or max(kernel_size) > ONEDNN_FOLDED_MAX_KERNEL:
        return True
    return any(n is not None and n < k for n, k in zip(x.shape[1:-1], kernel_size, strict=True))


def _per_example_by_forward_conv(layer, kernel, x, d):
    """``(B, C, M, K)``: every example's kernel gradient as one forward depthwise convolution
    (TensorFlow) of the padded input, the batch folded into the channels, with the output
    gradient as its filter.

    With ``X`` the padded input, strides ``s``, dilation ``r`` and outputs ``o``,
    ``dL_i/dW[k, c, m] = sum_o X_i[s o + r k, c] D_i[o, c M + m]``: a cross-correlation of
    ``X_i`` (channel ``c``) with the filter ``D_i`` (channel ``c M + m``), dilated by ``s``,
    evaluated at the ``K`` offsets ``r k`` (a convolution strided by ``r``; one of ``s`` and
    ``r`` is 1). Example ``i``'s channel ``c``, repeated ``M`` times, becomes channels
    ``(i C + c) M + m`` of one image, and ``D``'s channels line up with them, so one depthwise
    convolution with multiplier 1 gives ``(1, *k, B C M)``. Used where oneDNN's filter
    gradient is slow (:func:`forward_conv_products_win`)."""
    import tensorflow as tf

    kernel_size, strides = tuple(layer.kernel_size), tuple(layer.strides)
    dilation = tuple(layer.dilation_rate)
    padded, sizes = pad_input(x, kernel_size, strides, dilation, layer.padding)
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
    c, m = kernel.shape[-2], kernel.shape[-1]
    image = fold_batch_into_channels(padded)  # (1, H, W, B C)
    if m > 1:
        image = tf.repeat(image, m, axis=-1)  # (1, H, W, B C M)
    shape = tf.shape(d)
    kernels = tf.reshape(tf.transpose(d, [1, 2, 0, 3]), [shape[1], shape[2], -1, 1])
    # the layer's dilation r reads offsets r k: the convolution's own strides (the caller
    # takes this route for a dilated layer only where its strides are 1)
    g = tf.nn.depthwise_conv2d(image, kernels, [1, *dilation, 1], "VALID", dilations=strides)
    g = tf.reshape(g, [-1, tf.shape(x)[0], c, m])  # (K, B, C, M)
    return tf.transpose(g, [1, 2, 3, 0])


def _torch_per_example_filter_gradients(layer, kernel, x, d):
    """``(B, C, M, K)`` on PyTorch: :func:`_per_example_filter_gradients` with
    ``torch.nn.grad.conv2d_weight`` over the batch folded into the channels, ``B C`` groups
    (channels first: example ``i``'s channel ``c`` is channel ``i C + c``, its outputs
    ``(i C + c) M + m``), so the gradient ``(B C M, 1, *k)`` is already in example, channel,
    multiplier, offset order. Faster than the einsum over the patches (docs/benchmarks.md,
    "Route measurements")."""
    import torch

    source, _ = native_padding(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                               layer.padding)  # padded here: "valid"
    kernel_size, strides = tuple(layer.kernel_size), tuple(layer.strides)
    dilation = tuple(layer.dilation_rate)
    if len(kernel_size) == 1:  # as one row of a 2D image
        source, d = source[:, None], d[:, None]
        kernel_size, strides, dilation = (1, *kernel_size), (1, *strides), (1, *dilation)
    batch, c, m = source.shape[0], kernel.shape[-2], kernel.shape[-1]
    folded_x = source.permute(0, 3, 1, 2).reshape(1, batch * c, *source.shape[1:3])
    folded_d = d.permute(0, 3, 1, 2).reshape(1, batch * c * m, *d.shape[1:3])
    g = torch.nn.grad.conv2d_weight(folded_x, (batch * c * m, 1, *kernel_size), folded_d,
                                    stride=strides, dilation=dilation, groups=batch * c)
    return g.reshape(batch, c, m, -1)


def _filter_gradient(layer, kernel, x, d):
    """``sum_i P_i^T D_i`` by the backend's native depthwise filter-gradient kernel."""
    source, padding = native_padding(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                                     layer.padding)
    return vjp(lambda w: ops.depthwise_conv(source, w, strides=layer.strides, padding=padding,
                                            dilation_rate=layer.dilation_rate,
                                            data_format="channels_last"),
               ops.zeros(kernel.shape, x.dtype), d)


def _bias(layer, d) -> list:
    if not layer.use_bias:
        return []
    return [Materialized(layer.bias, ops.sum(
        ops.reshape(d, [batch_size(d), -1, d.shape[-1]]), 1))]


def depthwise_rule(layer, call: LayerCall, grad) -> list:
    dtype = layer.kernel.dtype
    x, d = channels_last_input_and_grad(layer, call, grad, dtype)
    return [_depthwise_form(layer, layer.kernel, x, d), *_bias(layer, d)]


def separable_rule(layer, call: LayerCall, grad) -> list:
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    dtype = depthwise.dtype
    x, d = channels_last_input_and_grad(layer, call, grad, dtype)  # (B, *out, F)
    batch = batch_size(x)
    c, m = depthwise.shape[-2], depthwise.shape[-1]
    w_p = ops.reshape(ops.cast(pointwise, dtype), [c * m, layer.filters])  # (C*M, F)
    source, padding = native_padding(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                                     layer.padding)
    z = ops.depthwise_conv(source, ops.cast(depthwise, dtype), strides=layer.strides,
                           padding=padding, dilation_rate=layer.dilation_rate,
                           data_format="channels_last")  # (B, *out, C*M): the depthwise output
    z = ops.reshape(z, [batch, -1, 1, c * m])
    flat_d = ops.reshape(d, [batch, -1, layer.filters])
    d_mid = ops.reshape(ops.matmul(flat_d, ops.transpose(w_p)), [*ops.shape(d)[:-1], c * m])
    ones = (1,) * len(layer.kernel_size)
    return [
        _depthwise_form(layer, depthwise, x, d_mid),
        Factored(pointwise, z, flat_d[:, :, None, :], (*ones, c * m, 1, layer.filters)),
        *_bias(layer, d),
    ]


register(keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D, splits_activation=True,
         applies=plain_weights)(depthwise_rule)
register(keras.layers.SeparableConv1D, keras.layers.SeparableConv2D, splits_activation=True,
         applies=plain_weights)(separable_rule)
