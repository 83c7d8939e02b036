"""PyTorch's native convolution kernels for per-example products: ``torch.nn.grad.conv2d_weight``
with the batch folded into the channels (one group per example)."""

from __future__ import annotations

from typing import Any

import torch


def grouped_filter_gradients_available(dtype: Any) -> bool:
    """Always: ``conv2d_weight`` takes groups for every floating dtype."""
    return True


def grouped_filter_gradients(source: Any, d: Any, kernel_size: tuple, strides: tuple,
                             padding: str) -> Any:
    """``(B, 1, O, K C)`` of a 2-D convolution: ``conv2d_weight(..., groups=B)`` (channels first:
    example ``i``'s channel ``c`` is channel ``i C + c``, its filters ``i O`` to
    ``i O + O - 1``), the gradient ``(B O, C, *k)`` reordered to the patches' ``(K, c)``.
    ``source`` is already padded (``padding`` is ``"valid"``)."""
    batch, c_in, c_out = source.shape[0], source.shape[-1], d.shape[-1]
    folded_x = source.permute(0, 3, 1, 2).reshape(1, batch * c_in, *source.shape[1:3])
    folded_d = d.permute(0, 3, 1, 2).reshape(1, batch * c_out, *d.shape[1:3])
    g = torch.nn.grad.conv2d_weight(folded_x, (batch * c_out, c_in, *kernel_size), folded_d,
                                    stride=tuple(strides), groups=batch)
    return g.reshape(batch, c_out, c_in, -1).permute(0, 1, 3, 2).reshape(batch, 1, c_out, -1)


def depthwise_filter_gradients(source: Any, d: Any, kernel_size: tuple, strides: tuple,
                               dilation: tuple, padding: str, multiplier: int) -> Any:
    """``(B, C, M, K)``: ``conv2d_weight`` over the batch folded into the channels, ``B C``
    groups (channels first: example ``i``'s channel ``c`` is channel ``i C + c``, its outputs
    ``(i C + c) M + m``), so the gradient ``(B C M, 1, *k)`` is already in example, channel,
    multiplier, offset order. ``source`` is already padded (``padding`` is ``"valid"``)."""
    kernel_size, strides, dilation = tuple(kernel_size), tuple(strides), tuple(dilation)
    if len(kernel_size) == 1:  # as one row of a 2D image
        source, d = source[:, None], d[:, None]
        kernel_size, strides, dilation = (1, *kernel_size), (1, *strides), (1, *dilation)
    batch, c = source.shape[0], source.shape[-1]
    folded_x = source.permute(0, 3, 1, 2).reshape(1, batch * c, *source.shape[1:3])
    folded_d = d.permute(0, 3, 1, 2).reshape(1, batch * c * multiplier, *d.shape[1:3])
    g = torch.nn.grad.conv2d_weight(folded_x, (batch * c * multiplier, 1, *kernel_size),
                                    folded_d, stride=strides, dilation=dilation,
                                    groups=batch * c)
    return g.reshape(batch, c, multiplier, -1)


def depthwise_products_by_forward_conv(padded: Any, d: Any, sizes: list, kernel_size: tuple,
                                       strides: tuple, dilation: tuple,
                                       multiplier: int) -> Any:
    raise NotImplementedError("PyTorch takes depthwise_filter_gradients (Routes.depthwise_"
                              "forward_conv is false)")
