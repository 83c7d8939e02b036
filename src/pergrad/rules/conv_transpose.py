"""Conv1DTranspose / Conv2DTranspose / Conv3DTranspose: any strides, dilation (with stride 1, as
Keras allows), ``valid``/``same`` padding, ``output_padding``, ``channels_last`` and
``channels_first``.

A transposed convolution ``y = conv_transpose(x, W)`` (kernel ``W[K, o, c]``: offset ``K``,
filter ``o``, input channel ``c``) is the adjoint of the convolution ``z = conv(y, W)`` that maps
the layer's *output* space back to its input space: ``y[t*s + K*d - pad, o] += W[K, o, c]
x[t, c]``. With ``P_i[t, K, o]`` the patch of the pre-activation output gradient ``D_i`` that input
position ``t`` of example ``i`` sees (taken with the layer's strides and dilation, and the padding
TensorFlow derives for a convolution of ``y``'s size, which Keras's output-shape formula,
``output_padding`` included, makes consistent with ``x``'s size),

    dL_i/dW[K, o, c] = sum_t P_i[t, K, o] x_i[t, c]        dL_i/db = sum_t D_i[t]

a ``Factored`` form with ``A = P`` (patches of the output gradient) and ``D = x`` (the layer
input): the roles of input and output gradient swap with respect to :mod:`pergrad.rules.conv`.
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.backend import native
from pergrad.backend.ops import batch_size, rank, vjp, zero_rows
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.conv import channels_last_input_and_grad, extract_patches
from pergrad.rules.forms import Factored, Materialized, positions


def conv_transpose_rule(layer, call: LayerCall, grad) -> list:
    dtype = layer.kernel.dtype
    x, d = channels_last_input_and_grad(layer, call, grad, dtype)
    forms = [_kernel_form(layer, x, d)]
    if layer.use_bias:
        forms.append(Materialized(layer.bias,
                                  ops.sum(ops.reshape(d, [batch_size(x), -1, layer.filters]), 1)))
    return forms


def _kernel_form(layer, x, d) -> Factored:
    """The kernel's form from the channels-last input ``x`` and output gradient ``d``; its
    ``remake`` rebuilds the patches of ``d`` from the (masked) inputs, so a conditional branch
    that reads the form captures ``x`` and ``d`` only (:meth:`Factored.rebuilt`)."""
    dtype = layer.kernel.dtype
    c_in, filters = x.shape[-1], layer.filters
    # (B, *x_spatial, K, filters): the output-gradient patch each input position sees.
    patches = extract_patches(d, layer.kernel_size, layer.strides, layer.dilation_rate,
                              layer.padding)
    batch = batch_size(x)
    k = patches.shape[-2]
    t = positions(x.shape[1:-1])
    a = ops.reshape(patches, [batch, t, 1, k * filters])
    xx = ops.reshape(x, [batch, t, 1, c_in])
    natural = (*layer.kernel_size, filters, 1, c_in)

    def summed(coefficients):
        weights = ops.cast(coefficients, dtype)[(slice(None),) + (None,) * (rank(d) - 1)]
        return _filter_gradient(layer, x, d * weights)

    def remake(keep):
        return _kernel_form(layer, zero_rows(x, keep), zero_rows(d, keep))

    # As for Conv: on JAX the GEMM over patches, not XLA's filter gradient.
    return Factored(layer.kernel, a, xx, natural, summed=summed if native().ROUTES.transpose_filter_gradient_sums else None,
                    remake=remake)


def _filter_gradient(layer, x, d):
    """``sum_i P_i^T x_i``: the ordinary (batch) kernel gradient of ``<conv_transpose(x, W), d>``,
    by the backend's native filter-gradient kernel (channels last, whatever the layer's format)."""
    return vjp(lambda w: ops.conv_transpose(x, w, strides=layer.strides, padding=layer.padding,
                                            output_padding=layer.output_padding,
                                            data_format="channels_last",
                                            dilation_rate=layer.dilation_rate),
               ops.zeros(layer.kernel.shape, x.dtype), d)


register(keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
         keras.layers.Conv3DTranspose, splits_activation=True,
         applies=plain_weights)(conv_transpose_rule)
