"""The float64 loop oracle: one eager gradient per example (a ``GradientTape`` on TensorFlow,
``jax.grad`` of ``stateless_call`` on JAX, ``torch.autograd.grad`` of an ordinary call on
PyTorch), written independently of pergrad."""

from __future__ import annotations

import inspect

import keras
import numpy as np
from keras import ops


def take(structure, i: int):
    return keras.tree.map_structure(lambda t: None if t is None else np.asarray(t)[i:i + 1],
                                    structure)


def _jax_loop_gradients(model, loss_fn, x, y, sample_weight, training, compiled=True):
    import jax

    batch = len(keras.tree.flatten(x)[0])
    variables = model.trainable_variables
    frozen = [v.value for v in model.non_trainable_variables]
    grads = [np.zeros((batch, *v.shape)) for v in variables]
    losses = np.zeros(batch)

    def loss_of(values, xi, yi, wi):
        kwargs = {"training": training} if "training" in inspect.signature(model.call).parameters else {}
        pred, _ = model.stateless_call(values, frozen, xi, **kwargs)
        loss = ops.sum(loss_fn(yi, pred) if yi is not None else loss_fn(pred))
        return loss if wi is None else loss * wi

    # compiled: one jax.jit for every example (big models: eager JAX dispatches op by op)
    value_and_grad = jax.value_and_grad(loss_of)
    if compiled:
        value_and_grad = jax.jit(value_and_grad)
    for i in range(batch):
        wi = None if sample_weight is None else float(np.asarray(sample_weight)[i])
        loss, g = value_and_grad([v.value for v in variables], take(x, i),
                                 None if y is None else take(y, i), wi)
        for k, gk in enumerate(g):
            grads[k][i] = np.asarray(gk)
        losses[i] = float(loss)
    return grads, losses


def _torch_loop_gradients(model, loss_fn, x, y, sample_weight, training):
    import torch

    batch = len(keras.tree.flatten(x)[0])
    variables = model.trainable_variables
    grads = [np.zeros((batch, *v.shape)) for v in variables]
    losses = np.zeros(batch)
    for i in range(batch):
        with torch.enable_grad():
            pred = model(take(x, i), training=training)
            loss = ops.sum(loss_fn(take(y, i), pred) if y is not None else loss_fn(pred))
            if sample_weight is not None:
                loss = loss * float(np.asarray(sample_weight)[i])
            g = torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True)
        for k, gk in enumerate(g):
            if gk is not None:
                grads[k][i] = gk.detach().cpu().numpy()
        losses[i] = float(loss.detach())
    return grads, losses


def loop_gradients(model, loss_fn, x, y=None, sample_weight=None, training=False,
                   compiled=True):
    """Per-example gradients ``(B, *var.shape)`` and losses ``(B,)`` by a Python loop.

    ``loss_fn(y_true, y_pred)`` must return the loss of the single example as a (1, ...) tensor;
    it is summed to a scalar here. ``compiled``: on JAX, each example's gradient runs under one
    ``jax.jit``, compiled once for every example (one example at a time still; eager JAX
    dispatches op by op, 5-6x slower on the zoo's recurrent and attention models).
    """
    if keras.backend.backend() == "jax":
        return _jax_loop_gradients(model, loss_fn, x, y, sample_weight, training, compiled)
    if keras.backend.backend() == "torch":
        return _torch_loop_gradients(model, loss_fn, x, y, sample_weight, training)
    import tensorflow as tf

    batch = len(keras.tree.flatten(x)[0])
    variables = model.trainable_variables
    grads = [np.zeros((batch, *v.shape)) for v in variables]
    losses = np.zeros(batch)
    for i in range(batch):
        with tf.GradientTape() as tape:
            pred = model(take(x, i), training=training)
            loss = tf.reduce_sum(loss_fn(take(y, i), pred) if y is not None else loss_fn(pred))
            if sample_weight is not None:
                loss = loss * float(np.asarray(sample_weight)[i])
        for k, g in enumerate(tape.gradient(loss, variables)):
            if g is not None:
                grads[k][i] = tf.convert_to_tensor(g).numpy()
        losses[i] = float(loss)
    return grads, losses


# Keras 3.15's torch backend multiplies two float64 tensors in float32 (``ops.matmul`` casts to
# ``result_type("float64", "float64")``, which is "float32" off TensorFlow): a "float64" model is
# float32-precise there, in the oracle and in pergrad alike, which sum in other orders. On torch
# the float64 tolerances (below 1e-5) are raised to 1e-5; an error of the math is O(1).
TORCH_FLOAT64_RTOL = 1e-5


def assert_close(actual, expected, rtol=1e-6, atol=None, what=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if keras.backend.backend() == "torch" and rtol < TORCH_FLOAT64_RTOL:
        atol = None if atol is None else atol * TORCH_FLOAT64_RTOL / rtol
        rtol = TORCH_FLOAT64_RTOL
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(np.max(np.abs(expected)), 1e-12)
    atol = rtol * scale if atol is None else atol
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def keras_loss(loss):
    """One example's loss computed by Keras itself, independently of pergrad's loss adapter.

    A Keras loss object is rebuilt with ``reduction="sum"`` (for one example: the sum over its
    positions of Keras's elementwise loss), a loss name goes through ``keras.losses.get``, a list
    is one loss per output (summed), ``None`` means the model outputs the loss.
    """
    if loss is None:
        return lambda y_true, y_pred: ops.sum(y_pred)
    if isinstance(loss, (list, tuple)):
        parts = [keras_loss(part) for part in loss]
        return lambda y_true, y_pred: sum(
            fn(t, p) for fn, t, p in zip(parts, y_true, y_pred, strict=True))
    if isinstance(loss, str):
        fn = keras.losses.get(loss)
        return lambda y_true, y_pred: ops.sum(fn(y_true, y_pred))
    summed = type(loss).from_config({**loss.get_config(), "reduction": "sum"})
    return lambda y_true, y_pred: summed(y_true, y_pred)


def compiled_like_a_user(fn):
    """``fn`` compiled as a user's own training loop would be: ``tf.function`` or ``jax.jit``
    (on PyTorch, which pergrad runs eagerly, ``fn`` itself)."""
    if keras.backend.backend() == "torch":
        return fn
    if keras.backend.backend() == "jax":
        import jax
        return jax.jit(fn)
    import tensorflow as tf
    return tf.function(fn)


def softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax in NumPy (float64 references)."""
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)
