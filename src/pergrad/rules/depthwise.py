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

import keras
from keras import ops

from pergrad.backend import is_tensorflow
from pergrad.backend.ops import batch_size, rank, vjp
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.conv import (
    channels_last_input_and_grad,
    extract_patches,
    pad_input,
)
from pergrad.rules.forms import Factored, Materialized, positions


def _patches(layer, x):
    """``(B, T, C, K)``: the patches of channels-last ``x``, one group per channel."""
    patches = extract_patches(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                              layer.padding)  # (B, *out, K, C)
    t = positions(patches.shape[1:-2])
    k, c = patches.shape[-2], patches.shape[-1]
    return ops.transpose(ops.reshape(patches, [batch_size(x), t, k, c]), [0, 1, 3, 2])


def _depthwise_form(layer, kernel, x, a, d) -> Factored:
    """The ``Factored`` form of depthwise ``kernel`` ``(*k, C, M)`` from patches ``a``
    ``(B, T, C, K)`` and the channels-last gradient ``d`` at the depthwise output ``(B, *out, C*M)``."""
    c, m = kernel.shape[-2], kernel.shape[-1]
    dd = ops.reshape(d, [batch_size(d), a.shape[1] if a.shape[1] is not None else -1, c, m])

    def summed(coefficients):
        weights = ops.cast(coefficients, d.dtype)[(slice(None),) + (None,) * (rank(d) - 1)]
        return _filter_gradient(layer, kernel, x, d * weights)

    # XLA's depthwise filter gradient is 15x slower than the grouped einsum on CPU: JAX uses the einsum.
    return Factored(kernel, a, dd, (*layer.kernel_size, c, m),
                    summed=summed if is_tensorflow() else None)


def _filter_gradient(layer, kernel, x, d):
    """``sum_i P_i^T D_i`` by the backend's native depthwise filter-gradient kernel."""
    padded, _ = pad_input(x, layer.kernel_size, layer.strides, layer.dilation_rate, layer.padding)
    return vjp(lambda w: ops.depthwise_conv(padded, w, strides=layer.strides, padding="valid",
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
    return [_depthwise_form(layer, layer.kernel, x, _patches(layer, x), d), *_bias(layer, d)]


def separable_rule(layer, call: LayerCall, grad) -> list:
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    dtype = depthwise.dtype
    x, d = channels_last_input_and_grad(layer, call, grad, dtype)  # (B, *out, F)
    a = _patches(layer, x)  # (B, T, C, K)
    batch, t = batch_size(x), a.shape[1] if a.shape[1] is not None else -1
    c, m = depthwise.shape[-2], depthwise.shape[-1]
    w_d = ops.reshape(ops.cast(depthwise, dtype), [-1, c, m])  # (K, C, M)
    w_p = ops.reshape(ops.cast(pointwise, dtype), [c * m, layer.filters])  # (C*M, F)
    z = ops.reshape(ops.einsum("btck,kcm->btcm", a, w_d), [batch, t, 1, c * m])
    flat_d = ops.reshape(d, [batch, t, layer.filters])
    d_mid = ops.reshape(ops.matmul(flat_d, ops.transpose(w_p)), [*ops.shape(d)[:-1], c * m])
    ones = (1,) * len(layer.kernel_size)
    return [
        _depthwise_form(layer, depthwise, x, a, d_mid),
        Factored(pointwise, z, flat_d[:, :, None, :], (*ones, c * m, 1, layer.filters)),
        *_bias(layer, d),
    ]


register(keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D, splits_activation=True,
         applies=plain_weights)(depthwise_rule)
register(keras.layers.SeparableConv1D, keras.layers.SeparableConv2D, splits_activation=True,
         applies=plain_weights)(separable_rule)
