"""JAX has no native per-example convolution kernel worth taking: XLA's grouped and depthwise
filter gradients lose to GEMMs and einsums over patches on the CPU (``Routes.grouped_conv`` is
``None`` and ``Routes.depthwise_products`` is ``"einsum"``), so these are never called."""

from __future__ import annotations

from typing import Any


def grouped_filter_gradients_available(dtype: Any) -> bool:
    return False


def grouped_filter_gradients(source: Any, d: Any, kernel_size: tuple, strides: tuple,
                             padding: str) -> Any:
    raise NotImplementedError("JAX has no grouped filter-gradient route (Routes.grouped_conv)")


def depthwise_filter_gradients(source: Any, d: Any, kernel_size: tuple, strides: tuple,
                               dilation: tuple, padding: str, multiplier: int) -> Any:
    raise NotImplementedError("JAX takes the einsum over patches (Routes.depthwise_products)")


def depthwise_products_by_forward_conv(padded: Any, d: Any, sizes: list, kernel_size: tuple,
                                       strides: tuple, dilation: tuple,
                                       multiplier: int) -> Any:
    raise NotImplementedError("JAX takes the einsum over patches (Routes.depthwise_products)")
