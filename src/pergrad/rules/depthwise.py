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

from pergrad.backend import native
from pergrad.backend.ops import batch_size, dtype_of, rank, vjp, zero_rows
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.conv import (
    channels_last_input_and_grad,
    extract_patches,
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

    Where the backend's routes take native kernels (``Routes.depthwise_products``, TensorFlow and
    PyTorch), the per-example products come from one depthwise filter gradient over the batch
    folded into the channels (:func:`_per_example_filter_gradients`) or, on TensorFlow off
    oneDNN's fast path, one forward convolution (:func:`_per_example_by_forward_conv`, as
    :func:`forward_conv_products_win` chooses); on TensorFlow the sums come from the batch
    filter gradient, so a compiled graph never builds the patches, and on PyTorch (eager) the
    patches are built only if a route reads them. On JAX the grouped einsum over the patches is
    the fastest route."""
    routes = native().ROUTES
    c, m = kernel.shape[-2], kernel.shape[-1]
    t = positions(d.shape[1:-1])
    dd = ops.reshape(d, [batch_size(d), t, c, m])
    natural = (*layer.kernel_size, c, m)
    a = (Deferred(lambda: _patches(layer, x), (batch_size(x), t, c, math.prod(
        layer.kernel_size)), dtype_of(x)) if routes.eager else _patches(layer, x))  # (B, T, C, K)
    if routes.depthwise_products != "native":  # XLA's filter gradients lose to the einsum
        return Factored(kernel, a, dd, natural)

    summed = None
    if routes.depthwise_filter_gradient_sums:
        def summed(coefficients):
            weights = ops.cast(coefficients, d.dtype)[(slice(None),) + (None,) * (rank(d) - 1)]
            return _filter_gradient(layer, kernel, x, d * weights)

    forward_conv = routes.depthwise_forward_conv and forward_conv_products_win(layer, x)

    def per_example():
        if forward_conv:
            return _per_example_by_forward_conv(layer, kernel, x, d)
        return _per_example_filter_gradients(layer, kernel, x, d)

    def remake(keep):
        return _depthwise_form(layer, kernel, zero_rows(x, keep), zero_rows(d, keep))

    if set(layer.dilation_rate) != {1} and not routes.depthwise_dilation:
        # the folded filter gradient has no dilation on TensorFlow's CPU kernel; the forward
        # convolution strides by the dilation (so the layer's own strides must be 1: both at
        # once is another computation), and its kernel wants equal strides
        possible = set(layer.strides) == {1} and len(set(layer.dilation_rate)) == 1
        per_example = (partial(_per_example_by_forward_conv, layer, kernel, x, d)
                       if possible and forward_conv else None)
    return Factored(kernel, a, dd, natural, summed=summed, per_example=per_example,
                    remake=remake)


def _per_example_filter_gradients(layer, kernel, x, d):
    """``(B, C, M, K)``: every example's kernel gradient from one native depthwise filter
    gradient with the batch folded into the channels
    (:func:`pergrad.backend.protocol.Backend.depthwise_filter_gradients`): on TensorFlow's CPU
    kernel about two batch filter gradients, on PyTorch ``conv2d_weight`` with ``B C`` groups,
    both far less than the patch einsum (docs/benchmarks.md, "Route measurements")."""
    source, padding = native_padding(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                                     layer.padding)
    return native().depthwise_filter_gradients(
        source, d, tuple(layer.kernel_size), tuple(layer.strides), tuple(layer.dilation_rate),
        padding, kernel.shape[-1])


#: The largest kernel side for which oneDNN's depthwise filter gradient (TensorFlow on x86) stays
#: fast with the batch folded into the channels (docs: :func:`forward_conv_products_win`).
ONEDNN_FOLDED_MAX_KERNEL = 3


def forward_conv_products_win(layer, x) -> bool:
    """Whether the per-example depthwise products come from :func:`_per_example_by_forward_conv`
    (one forward depthwise convolution) rather than :func:`_per_example_filter_gradients` (one
    filter gradient with the batch folded into the channels), where the backend has both
    (``Routes.depthwise_forward_conv``: TensorFlow).

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
    of the padded input, the batch folded into the channels, with the output gradient as its
    filter (:func:`pergrad.backend.protocol.Backend.depthwise_products_by_forward_conv`). Used
    where oneDNN's filter gradient is slow (:func:`forward_conv_products_win`)."""
    padded, sizes = pad_input(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                              layer.padding)
    return native().depthwise_products_by_forward_conv(
        padded, d, sizes, tuple(layer.kernel_size), tuple(layer.strides),
        tuple(layer.dilation_rate), kernel.shape[-1])


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
