"""TensorFlow's primitives (:class:`pergrad.backend.protocol.Backend`)."""

from pergrad.backend import routes
from pergrad.backend.neutral import (
    concatenate_over_range,
    generator_state,
    replaying_generators,
)
from pergrad.backend.tensorflow.conv import (
    depthwise_filter_gradients,
    depthwise_products_by_forward_conv,
    grouped_filter_gradients,
    grouped_filter_gradients_available,
)
from pergrad.backend.tensorflow.host import branch, host_call, wait_for_host_callbacks
from pergrad.backend.tensorflow.ops import (
    assert_positive,
    full_float32,
    image_patches,
    map_in_chunks,
    matmul_ta,
    outer_products,
    recurrence,
    row_squared_norms,
    segment_sum,
    snapshot,
    static_value,
    trace_token,
    unique_row_squared_norms,
    vjp,
    wide_float,
)
from pergrad.backend.tensorflow.random import (
    check_noise_keys,
    enable_noise_keys,
    gaussian_noise,
    new_key_state,
    next_key,
    take_key,
)
from pergrad.backend.tensorflow.replicas import replicas
from pergrad.backend.tensorflow.runtime import (
    has_strategy,
    is_tracing,
    layer_rounding,
    process_count,
    tensor_float_32,
    wide_scalar,
)

NAME = "tensorflow"
#: Keras's own recurrent loop on this backend: where a mask drops a step, the output holds the
#: previous state ``h_{t-1}`` (JAX) rather than the previous output (TensorFlow, PyTorch).
RNN_MASK_HOLDS_STATE = False
#: Keras's loop returns a ``go_backwards`` layer's sequences in the input's order (JAX).
RNN_BACKWARDS_IN_INPUT_ORDER = False
ROUTES = routes.TENSORFLOW

__all__ = ["NAME", "RNN_BACKWARDS_IN_INPUT_ORDER", "RNN_MASK_HOLDS_STATE", "ROUTES", "branch",
           "host_call", "wait_for_host_callbacks", "assert_positive", "concatenate_over_range", "check_noise_keys", "enable_noise_keys",
           "depthwise_filter_gradients", "depthwise_products_by_forward_conv", "full_float32",
           "gaussian_noise", "generator_state", "grouped_filter_gradients",
           "grouped_filter_gradients_available", "replaying_generators",
           "has_strategy", "is_tracing", "layer_rounding", "process_count", "tensor_float_32",
           "wide_scalar",
           "image_patches", "map_in_chunks", "matmul_ta", "new_key_state", "next_key",
           "outer_products", "recurrence", "replicas", "row_squared_norms", "segment_sum", "snapshot", "static_value",
           "take_key", "trace_token", "unique_row_squared_norms", "vjp",
           "wide_float"]
