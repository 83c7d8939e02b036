"""Every private Keras or TensorFlow name pergrad uses, in one place (tests/test_compat.py checks
each against the installed versions).

Keras 3 and TensorFlow give no public way to do these; each function says what it wraps, so a
Keras release that moves a name breaks one tested function here instead of the engine.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import keras

from pergrad.backend.lazy import tensorflow as tf

try:  # Keras has no public name for the scope Layer.__call__ opens under mixed precision.
    from keras.src.backend import AutocastScope
except ImportError:  # pragma: no cover - a Keras that moved it: replay without casting
    AutocastScope = None


def sublayers(layer: Any, include_self: bool = False, recursive: bool = True) -> list:
    """The layers inside ``layer`` (``Layer._flatten_layers``), depth first."""
    return list(layer._flatten_layers(include_self=include_self, recursive=recursive))


def own_trainable_variables(layer: Any) -> list:
    """The trainable variables ``layer`` created itself, not those of its sublayers
    (``Layer._trainable_variables``)."""
    return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def owns_seed_generator(layer: Any) -> bool:
    """Whether ``layer`` itself owns a ``keras.random.SeedGenerator`` (``_seed_generators``),
    i.e. draws random numbers in ``call`` (dropout)."""
    return bool(getattr(layer, "_seed_generators", None))


def call_takes_training(model: Any) -> bool:
    """Whether the model's ``call`` accepts ``training=`` (``_call_has_training_arg``)."""
    return bool(getattr(model, "_call_has_training_arg", True))


def compiled_loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> tf.Tensor:
    """The loss Keras's own train step reports: the compiled loss plus the model's losses
    (weight regularization), scaled per replica (``Model._compute_loss``, which calls
    ``compute_loss`` with ``training=`` when an override takes it)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=True)


def keras_mask(tensor: Any) -> Any:
    """The Keras mask a layer or loss attached to ``tensor`` (``Embedding(mask_zero=True)``'s
    padding, ``SparseCategoricalCrossentropy(ignore_class=...)``'s ignored labels), or ``None``
    (``keras.src.backend.common.masking.get_keras_mask``; the ``_keras_mask`` attribute before
    Keras 3.6)."""
    try:
        from keras.src.backend.common.masking import get_keras_mask
    except ImportError:  # Keras < 3.6
        return getattr(tensor, "_keras_mask", None)
    return get_keras_mask(tensor)


def set_keras_mask(tensor: Any, mask: Any) -> None:
    """Attach ``mask`` to ``tensor`` as its Keras mask, where Keras's losses and metrics read it
    (``keras.src.backend.common.masking.set_keras_mask``; the ``_keras_mask`` attribute before
    Keras 3.6)."""
    try:
        from keras.src.backend.common.masking import set_keras_mask as keras_set
    except ImportError:  # Keras < 3.6
        tensor._keras_mask = mask
        return
    keras_set(tensor, mask)


def micro_steps(optimizer: Any) -> Any:
    """The number of ``apply`` calls an optimizer has made (``BaseOptimizer._iterations``):
    under ``gradient_accumulation_steps=k`` its public ``iterations`` counts the updates (every
    ``k``-th call) instead."""
    return optimizer._iterations


def every_layer_built(model: Any) -> bool:
    """Whether ``model`` and every layer it holds, nested ones included, are built
    (``Layer._flatten_layers``, the walk Keras's ``_symbolic_build`` takes): a train step traced
    now creates no layer variable."""
    return all(layer.built for layer in model._flatten_layers())


def symbolic_build(model: Any, data_batch: Any) -> None:
    """Create every variable ``fit`` would create before its first step (``Trainer._symbolic_
    build``): the model's, the compiled metrics' and loss's (on symbolic tensors shaped like
    ``data_batch``) and the optimizer's slots. A train step traced before them would create
    them inside its first call, which ``tf.function`` then runs behind a ``cond`` of lifted
    initializers."""
    model._symbolic_build(data_batch=data_batch)


def compiled_metrics(model: Any) -> Any:
    """The container of the metrics passed to ``compile`` (``Trainer._compile_metrics``), or
    ``None`` when none were."""
    return model._compile_metrics


def update_compiled_metrics(container: Any, y_true: Any, y_pred: Any, sample_weight: Any,
                            unweighted_weight: Any) -> None:
    """``CompileMetrics.update_state(y_true, y_pred, sample_weight)``, except that the
    unweighted ``metrics=`` are given ``unweighted_weight`` (Keras gives them none): a 0/1 row
    mask there leaves rows out of them without changing any shape. Reads the container's
    ``_flatten_y``, ``_flat_metrics`` and ``_flat_weighted_metrics``."""
    if not container.built:
        container.build(y_true, y_pred)
    y_true, y_pred = container._flatten_y(y_true), container._flatten_y(y_pred)

    def per_output(weight: Any) -> list:
        if weight is None:
            return [None] * len(y_true)
        weights = container._flatten_y(weight)
        return weights if len(weights) == len(y_true) else [weights[0]] * len(y_true)

    for flat, weights in ((container._flat_metrics, per_output(unweighted_weight)),
                          (container._flat_weighted_metrics, per_output(sample_weight))):
        for metric, y_t, y_p, w in zip(flat, y_true, y_pred, weights, strict=False):
            if metric:
                metric.update_state(y_t, y_p, w)


def loss_tracker(model: Any) -> Any:
    """The ``Mean`` metric behind the ``loss`` entry of Keras's logs (``Model._loss_tracker``)."""
    return model._loss_tracker


def is_keras_variable(x: Any) -> bool:
    """Whether ``x`` is a Keras variable of any backend. Before Keras 3.6 or so, a layer's
    variables are the backend's ``Variable`` class, of which ``keras.Variable`` (the exported
    name) is a subclass, so ``isinstance(layer.kernel, keras.Variable)`` is False there (Keras
    3.5); their common base, ``KerasVariable``, is private."""
    if isinstance(x, keras.Variable):
        return True
    from keras.src.backend.common import variables  # KerasVariable, renamed Variable later

    return isinstance(x, getattr(variables, "KerasVariable", None) or variables.Variable)


def backing_tf_variable(variable: Any) -> tf.Variable | None:
    """The ``tf.Variable`` a Keras 3 variable wraps (``Variable._value`` when ``value`` is a
    read), or ``None`` when it wraps none."""
    value = variable.value
    if isinstance(value, tf.Variable):
        return value
    inner = getattr(variable, "_value", None)
    return inner if isinstance(inner, tf.Variable) else None


def current_graph() -> Any:
    """The graph being built now (the eager context's own when not tracing): tells a trace
    inside a loop body or ``tf.cond`` branch from the outer one (``tf.compat.v1``)."""
    return tf.compat.v1.get_default_graph()


def tracing_for_xla() -> bool:
    """Whether the graph being built now will be compiled by XLA: traced inside
    ``tf.function(jit_compile=True)`` (Keras's ``jit_compile=True``), directly or in a branch,
    loop body or nested function of it. An op with no XLA kernel must not be used there
    (``control_flow_util.GraphOrParentsInXlaContext``: the XLA context the trace enters)."""
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def onednn_enabled() -> bool:
    """Whether TensorFlow runs its oneDNN CPU kernels in this process (``IsMklEnabled``): on
    x86-64 Linux by default only where the CPU has neural-network features (AVX512_VNNI,
    AVX512_BF16, AVX_VNNI, AMX) in some releases, always in others, never under
    ``TF_ENABLE_ONEDNN_OPTS=0``; only TensorFlow's own answer is reliable."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def set_untracked(obj: Any, name: str, value: Any) -> None:
    """Set an attribute without Keras's tracking (``Layer.__setattr__`` would track a layer or
    variable value and refuse some names once built)."""
    object.__setattr__(obj, name, value)


def delete_untracked(obj: Any, name: str) -> None:
    """Delete an attribute set by :func:`set_untracked`."""
    object.__delattr__(obj, name)


def summary_metadata(plugin: str) -> Any:
    """TensorBoard summary metadata naming ``plugin`` (``"scalars"``, ``"histograms"``): lets
    the core ``tf.summary.write`` op write what the tensorboard package's helpers would."""
    return tf.compat.v1.SummaryMetadata(
        plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name=plugin))


def autocast_scope(layer: Any) -> Any:
    """The variable autocasting ``Layer.__call__`` applies around ``call``, for a replay through
    ``stateless_call``: inside it a float32 variable reads as the layer's compute dtype
    (``float16`` under ``mixed_float16``), as in the forward pass; variables created with
    ``autocast=False`` (normalization statistics) stay as they are. Keras has no public name
    for the scope (``keras.src.backend.AutocastScope``)."""
    compute = keras.backend.standardize_dtype(layer.compute_dtype)
    mixed = compute != keras.backend.standardize_dtype(layer.variable_dtype)
    if AutocastScope is None or not getattr(layer, "autocast", True) or not mixed \
            or not keras.backend.is_float_dtype(compute):
        return contextlib.nullcontext()
    return AutocastScope(compute)


def held_value(variable: Any) -> Any:
    """The value a Keras variable holds, or ``None`` while Keras's JAX ``fit`` has moved it
    into its compiled loop (``Variable._value``; ``variable.value`` would fail then)."""
    return getattr(variable, "_value", None)


_CHANNELS_LAST = {"lock": threading.Lock(), "depth": 0, "original": None}


@contextlib.contextmanager
def torch_convolutions_in_vmap():
    """A scope in which Keras's torch convolutions run under ``torch.func.vmap``.

    Keras's torch ``conv`` copies its input and kernel to channels-last memory
    (``keras.src.backend.torch.nn._maybe_convert_to_channels_last``), a copy that vmap refuses
    inside a forward-mode product. The scope skips that copy: the same numbers, only the
    memory layout differs. Where Keras no longer has the name it does nothing (vmap may then
    refuse, and the caller falls back to a loop). Nested and concurrent scopes restore the
    original once the last one exits; while one is open, every Keras torch convolution in the
    process skips the copy (the same numbers, in the default memory layout)."""
    try:
        from keras.src.backend.torch import nn as torch_nn
    except ImportError:  # pragma: no cover - not the torch backend, or Keras moved it
        torch_nn = None
    if torch_nn is None or not hasattr(torch_nn, "_maybe_convert_to_channels_last"):
        yield
        return
    state = _CHANNELS_LAST
    with state["lock"]:
        if state["depth"] == 0:
            state["original"] = torch_nn._maybe_convert_to_channels_last
            torch_nn._maybe_convert_to_channels_last = _same_tensor
        state["depth"] += 1
    try:
        yield
    finally:
        with state["lock"]:
            state["depth"] -= 1
            if state["depth"] == 0:
                torch_nn._maybe_convert_to_channels_last = state["original"]


def _same_tensor(tensor: Any) -> Any:
    return tensor
