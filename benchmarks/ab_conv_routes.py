"""A convolution's per-example products by the route the rule takes and by one grouped filter
gradient, layer by layer, in one process (TensorFlow, or PyTorch with ``KERAS_BACKEND=torch``).

For each layer geometry, three compiled functions of the same input ``x``, output gradient
``d`` and coefficients ``c`` are timed alternately:

* ``rule``: the convolution rule's kernel form as ``clipped_sum`` uses it, its norms with the
  per-example matrices built (``routed(NORMS_THEN_ROWS).squared_norms()``) and its weighted sum;
* ``grouped``: the same from one grouped filter gradient with the batch as groups
  (``pergrad.rules.conv._grouped_products``), forced on;
* ``batch filter gradient``: the backend's filter gradient of the whole batch, for scale.

With ``--depthwise`` (TensorFlow) the layers are depthwise ones (MobileNetV3Small's and
EfficientNetV2B0's at 64x64 inputs, the benchmark MobileNet's) and the calls ``rule`` (the
route :func:`pergrad.rules.depthwise.forward_conv_products_win` chooses), ``folded`` (one
filter gradient with the batch folded into the channels), ``forward conv`` (one forward
depthwise convolution with the output gradient as its filter) and the batch filter gradient,
each giving the norms and the weighted sum as ``clipped_sum`` does.

With ``--route-off`` the rule's route is the one it took before the grouped route existed
(``pergrad.backend.routes.forced(grouped_conv=None)``), which is what the tables in
docs/benchmarks.md compare. On PyTorch the functions run eagerly (the rule's patches are built
only if its route reads them, ``pergrad.rules.forms.Deferred``). Nothing here asserts on
timings.

    python benchmarks/ab_conv_routes.py --route-off            # the table in docs/benchmarks.md
    python benchmarks/ab_conv_routes.py --layers cnn1,cnn2
    KERAS_BACKEND=torch python benchmarks/ab_conv_routes.py --route-off --layers cnn1,k3_c64
    python benchmarks/ab_conv_routes.py --depthwise             # the depthwise routes
"""

from __future__ import annotations

import argparse
import contextlib

import keras
import numpy as np

from pergrad.backend import routes
from pergrad.backend.lazy import tensorflow as tf
from pergrad.bench.timing import alternating_medians
from pergrad.rules import conv, depthwise
from pergrad.rules.query import NORMS_THEN_ROWS

#: name: (batch, input spatial size, input channels, filters, kernel, strides, padding)
LAYERS = {
    "k3_c1": (256, (28, 28), 1, 32, 3, 1, "same"),
    "k5_c1": (256, (28, 28), 1, 32, 5, 1, "same"),
    "stem_k3_c3": (128, (32, 32), 3, 32, 3, 1, "same"),
    "stem_k3_c3_s2": (128, (32, 32), 3, 32, 3, 2, "same"),
    "k4_c2_s2": (256, (28, 28), 2, 16, 4, 2, "same"),
    "k3_c4": (256, (28, 28), 4, 16, 3, 1, "same"),
    "k6_c1": (256, (28, 28), 1, 16, 6, 1, "same"),
    "k3_c4_s2": (256, (28, 28), 4, 16, 3, 2, "same"),
    "cnn1": (256, (28, 28), 1, 16, 8, 2, "same"),
    "k3_c8": (256, (28, 28), 8, 32, 3, 1, "same"),
    "stem_k5_c3": (128, (32, 32), 3, 32, 5, 1, "same"),
    "k8_c2_s2": (256, (28, 28), 2, 16, 8, 2, "same"),
    "cnn2": (256, (13, 13), 16, 32, 4, 2, "valid"),
    "k3_c16": (128, (32, 32), 16, 32, 3, 1, "same"),
    "k5_c16": (256, (28, 28), 16, 16, 5, 1, "same"),
    "k3_c16_14": (128, (14, 14), 16, 32, 3, 1, "same"),
    "k3_c32": (128, (32, 32), 32, 32, 3, 1, "same"),
    "k3_c64": (128, (16, 16), 64, 64, 3, 1, "same"),
    "k3_c128": (128, (8, 8), 128, 128, 3, 1, "same"),
    "resnet_s2_c32": (128, (32, 32), 32, 64, 3, 2, "same"),
    "resnet_s2_c64": (128, (16, 16), 64, 128, 3, 2, "same"),
    "resnet_1x1_s2_c32": (128, (32, 32), 32, 64, 1, 2, "same"),
    "resnet_1x1_s2_c64": (128, (16, 16), 64, 128, 1, 2, "same"),
    "k1_c96": (128, (16, 16), 96, 96, 1, 1, "same"),
}

#: name: (batch, input spatial size, channels, kernel, strides, padding, depth multiplier)
DEPTHWISE_LAYERS = {
    "mnv3_k3_s2_c16": (32, (33, 33), 16, 3, 2, "valid", 1),
    "mnv3_k3_s1_c88": (32, (8, 8), 88, 3, 1, "same", 1),
    "mnv3_k5_s2_c96": (32, (11, 11), 96, 5, 2, "valid", 1),
    "mnv3_k5_s1_c240": (32, (4, 4), 240, 5, 1, "same", 1),
    "mnv3_k5_s2_c288": (32, (7, 7), 288, 5, 2, "valid", 1),
    "mnv3_k5_s1_c576": (32, (2, 2), 576, 5, 1, "same", 1),
    "effv2_k3_s2_c192": (32, (8, 8), 192, 3, 2, "same", 1),
    "effv2_k3_s1_c672": (32, (4, 4), 672, 3, 1, "same", 1),
    "effv2_k3_s1_c1152": (32, (2, 2), 1152, 3, 1, "same", 1),
    "mobilenet_k3_s1_c32": (256, (16, 16), 32, 3, 1, "same", 1),
    "mobilenet_k3_s2_c128": (256, (8, 8), 128, 3, 2, "same", 1),
    "k3_s1_c64_m2": (32, (8, 8), 64, 3, 1, "same", 2),
    "k3_s1_c16_56": (32, (56, 56), 16, 3, 1, "same", 1),
}


def _depthwise_calls(name: str) -> dict:
    size, spatial, channels, kernel, strides, padding, multiplier = DEPTHWISE_LAYERS[name]
    layer = keras.layers.DepthwiseConv2D(kernel, strides=strides, padding=padding,
                                         depth_multiplier=multiplier, use_bias=False)
    layer.build((None, *spatial, channels))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(size, *spatial, channels)).astype("float32"))
    d = tf.constant(rng.normal(size=tuple(layer.compute_output_shape(x.shape))).astype("float32"))
    c = tf.constant(rng.uniform(size=(size,)).astype("float32"))
    kernel_variable = layer.kernel

    @tf.function
    def rule(x, d, c):
        form = depthwise._depthwise_form(layer, kernel_variable, x, d)
        form = form.routed(NORMS_THEN_ROWS)
        return form.squared_norms(), form.weighted_sum(c)

    def from_products(route):
        @tf.function
        def call(x, d, c):
            g = route(layer, kernel_variable, x, d)  # (B, C, M, K)
            return tf.reduce_sum(tf.square(g), [1, 2, 3]), tf.einsum("bcmk,b->kcm", g, c)
        return call

    folded = from_products(depthwise._per_example_filter_gradients)
    forward = from_products(depthwise._per_example_by_forward_conv)

    @tf.function
    def batch_filter_gradient(x, d):
        return depthwise._filter_gradient(layer, kernel_variable, x, d)

    expected = folded(x, d, c)[0].numpy()
    for label, call in (("rule", rule), ("forward conv", forward)):
        error = np.max(np.abs(call(x, d, c)[0].numpy() - expected) / expected)
        if error > 1e-4:
            raise AssertionError(f"{name}: the {label} norms differ by {error:.1e} (relative)")
    return {"rule": lambda: rule(x, d, c), "folded": lambda: folded(x, d, c),
            "forward conv": lambda: forward(x, d, c),
            "batch filter gradient": lambda: batch_filter_gradient(x, d)}


def _depthwise_main(layers: list[str], rounds: int) -> None:
    print("| layer | batch | rule takes | rule (ms) | folded (ms) | forward conv (ms) "
          "| batch filter gradient (ms) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in layers:
        size, spatial, channels, kernel, strides, padding, multiplier = DEPTHWISE_LAYERS[name]
        layer = keras.layers.DepthwiseConv2D(kernel, strides=strides, padding=padding,
                                             depth_multiplier=multiplier)
        takes = ("forward conv" if depthwise.forward_conv_products_win(
            layer, tf.zeros((1, *spatial, channels))) else "folded")
        medians = alternating_medians(_depthwise_calls(name), rounds)
        print(f"| {name} ({'x'.join(map(str, spatial))}x{channels}, k {kernel}, s {strides}, "
              f"{padding}, m {multiplier}) | {size} | {takes} | "
              + " | ".join(f"{1e3 * medians[label]:.1f}" for label in
                           ("rule", "folded", "forward conv", "batch filter gradient"))
              + " |", flush=True)


def _grouped_refused(refused: bool):
    """The grouped route refused (no native grouped filter gradient) while ``refused``."""
    return routes.forced(grouped_conv=None) if refused else contextlib.nullcontext()


def _torch_calls(name: str, route_off: bool) -> dict:
    """The three calls on PyTorch, eagerly, gradients off as in the engine's rules."""
    import torch

    size, spatial, channels, filters, kernel, strides, padding = LAYERS[name]
    layer = keras.layers.Conv2D(filters, kernel, strides=strides, padding=padding)
    layer.build((None, *spatial, channels))
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(size, *spatial, channels)), dtype=torch.float32)
    d = torch.tensor(rng.normal(size=tuple(layer.compute_output_shape(x.shape))),
                     dtype=torch.float32)
    c = torch.tensor(rng.uniform(size=(size,)), dtype=torch.float32)

    @torch.no_grad()
    def rule():
        with _grouped_refused(route_off):
            form = conv._kernel_form(layer, x, d)
            form = form.routed(NORMS_THEN_ROWS)
        return form.squared_norms(), form.weighted_sum(c)

    @torch.no_grad()
    def grouped():
        g = conv._grouped_products(layer, x, d)  # (B, 1, O, K C)
        return torch.sum(torch.square(g), [1, 2, 3]), torch.einsum("bgoi,b->igo", g, c)

    def batch_filter_gradient():
        return conv._filter_gradient(layer, x, d)

    expected = rule()[0].numpy()
    error = np.max(np.abs(grouped()[0].numpy() - expected) / expected)
    if error > 1e-4:
        raise AssertionError(f"{name}: the grouped norms differ by {error:.1e} (relative)")
    return {"rule": rule, "grouped": grouped, "batch filter gradient": batch_filter_gradient}


def _calls(name: str, route_off: bool) -> dict:
    if keras.backend.backend() == "torch":
        return _torch_calls(name, route_off)
    size, spatial, channels, filters, kernel, strides, padding = LAYERS[name]
    layer = keras.layers.Conv2D(filters, kernel, strides=strides, padding=padding)
    layer.build((None, *spatial, channels))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(size, *spatial, channels)).astype("float32"))
    d = tf.constant(rng.normal(size=tuple(layer.compute_output_shape(x.shape))).astype("float32"))
    c = tf.constant(rng.uniform(size=(size,)).astype("float32"))

    @tf.function
    def rule(x, d, c):
        with _grouped_refused(route_off):
            form = conv._kernel_form(layer, x, d)
            form = form.routed(NORMS_THEN_ROWS)
        return form.squared_norms(), form.weighted_sum(c)

    @tf.function
    def grouped(x, d, c):
        g = conv._grouped_products(layer, x, d)  # (B, 1, O, K C)
        return tf.reduce_sum(tf.square(g), [1, 2, 3]), tf.einsum("bgoi,b->igo", g, c)

    @tf.function
    def batch_filter_gradient(x, d):
        return conv._filter_gradient(layer, x, d)

    expected = rule(x, d, c)[0].numpy()
    error = np.max(np.abs(grouped(x, d, c)[0].numpy() - expected) / expected)
    if error > 1e-4:
        raise AssertionError(f"{name}: the grouped norms differ by {error:.1e} (relative)")
    return {"rule": lambda: rule(x, d, c)[0].numpy(),
            "grouped": lambda: grouped(x, d, c)[0].numpy(),
            "batch filter gradient": lambda: batch_filter_gradient(x, d).numpy()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=None,
                        help=f"comma-separated, from {sorted(LAYERS)} (with --depthwise: "
                             f"{sorted(DEPTHWISE_LAYERS)}); default: all")
    parser.add_argument("--depthwise", action="store_true",
                        help="depthwise layers' per-example routes (TensorFlow)")
    parser.add_argument("--route-off", action="store_true",
                        help="the rule's route as before the grouped route existed")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    if args.depthwise:
        if keras.backend.backend() != "tensorflow":
            raise SystemExit("--depthwise compares TensorFlow's routes: run with "
                             "KERAS_BACKEND=tensorflow.")
        _depthwise_main((args.layers or ",".join(DEPTHWISE_LAYERS)).split(","), args.rounds)
        return
    if keras.backend.backend() not in ("tensorflow", "torch"):
        raise SystemExit("TensorFlow and PyTorch routes: run with KERAS_BACKEND=tensorflow "
                         "or torch.")
    print("| layer | batch | patch width | rule (ms) | grouped (ms) | batch filter gradient (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in (args.layers or ",".join(LAYERS)).split(","):
        size, spatial, channels, _, kernel, strides, _ = LAYERS[name]
        medians = alternating_medians(_calls(name, args.route_off), args.rounds)
        print(f"| {name} ({'x'.join(map(str, spatial))}x{channels}, k {kernel}, s {strides}) "
              f"| {size} | {kernel * kernel * channels} | {1e3 * medians['rule']:.1f} "
              f"| {1e3 * medians['grouped']:.1f} | {1e3 * medians['batch filter gradient']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
