"""The generic rule: per-example VJPs of one layer alone.

For a layer ``f(x; W)`` with recorded inputs ``x_i`` and output gradients ``D_i``,

    g_i = d/dW <f(x_i; W), D_i>,

one VJP per example, vectorized with ``tf.vectorized_map`` over ``layer.stateless_call``. This is
exact for any layer that treats examples independently. A layer with an op that has no vectorized
form gets a per-example loop instead, with a warning naming the layer.

Under mixed precision ``Layer.__call__`` casts the float32 variables to the layer's float16 (or
bfloat16) compute dtype, and ``stateless_call`` (which calls ``call`` directly) does not: the replay
runs inside the same autocast scope (:func:`autocast_scope`), so it computes exactly what the
forward pass computed, and the gradients come back in the variables' own dtype.

Replaying the layer would draw new random numbers, so a layer that draws them (dropout inside an
LSTM, say) in training mode instead gets its VJPs from the recorded forward pass itself:
``tape.jacobian`` of ``s_i = <f(x_i; W), stop_gradient(D_i)>`` (:func:`recorded_vjps`).
"""

from __future__ import annotations

import contextlib
import logging

import tensorflow as tf

from pergrad._compat import autocast_scope, owns_seed_generator, sublayers
from pergrad.engine.generic_rule import warn_of_the_loop
from pergrad.rules import LayerCall
from pergrad.rules.forms import Materialized


def _is_batched(leaf, batch_size: int | None) -> bool:
    if not isinstance(leaf, (tf.Tensor, tf.Variable)) or leaf.shape.rank in (None, 0):
        return False
    dim = leaf.shape[0]
    return dim is None or batch_size is None or dim == batch_size


@contextlib.contextmanager
def _quiet_pfor():
    """pfor logs every failed conversion at ERROR level, with the op's whole definition, before
    raising; the caller falls back to a loop and warns once in one line instead."""
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(max(level, logging.CRITICAL))
    try:
        yield
    finally:
        logger.setLevel(level)


def draws_random(layer) -> bool:
    """Whether ``layer`` or one of its sublayers owns a Keras ``SeedGenerator`` (dropout)."""
    return any(owns_seed_generator(sub) for sub in sublayers(layer, include_self=True))


def recorded_vjps(tape: tf.GradientTape, layer, outputs: list, grads: list) -> list[Materialized]:
    """Per-example VJPs of ``layer`` through the forward pass the (persistent) ``tape`` recorded:
    ``d/dW s_i`` with ``s_i = sum_k out_i[k] D_i[k]``, vectorized by ``tape.jacobian``. Exact
    for whatever dropout mask that pass drew."""
    variables = layer.trainable_variables
    with tape:  # resume recording: s must be on the tape that saw the forward pass
        terms = []
        for out, grad in zip(outputs, grads, strict=True):
            product = out * tf.stop_gradient(tf.cast(grad, out.dtype))
            terms.append(tf.reduce_sum(tf.reshape(product, [tf.shape(out)[0], -1]), axis=1))
        per_example = tf.add_n(terms)
    jacobians = tape.jacobian(per_example, variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [Materialized(v, tf.cast(j, v.dtype)) for v, j in zip(variables, jacobians, strict=True)]


def generic_forms(layer, call: LayerCall, grads: list, batch_size: int | None,
                  warned: set) -> list[Materialized]:
    """Materialized per-example gradients of ``layer``'s trainable variables for one call."""
    variables = layer.trainable_variables
    values = [v.value for v in variables]
    frozen = [v.value for v in layer.non_trainable_variables]
    leaves = tf.nest.flatten((call.args, call.kwargs))
    batched = [i for i, leaf in enumerate(leaves) if _is_batched(leaf, batch_size)]

    def one_example(elems):
        example_leaves, example_grads = elems
        full = list(leaves)
        for k, i in enumerate(batched):
            full[i] = example_leaves[k][None]
        args, kwargs = tf.nest.pack_sequence_as((call.args, call.kwargs), full)
        with tf.GradientTape() as tape, autocast_scope(layer):
            tape.watch(values)
            out, _ = layer.stateless_call(values, frozen, *args, **kwargs)
            outs = [o for o in tf.nest.flatten(out) if isinstance(o, tf.Tensor)]
            total = tf.add_n([tf.reduce_sum(o * tf.cast(g[None], o.dtype))
                              for o, g in zip(outs, example_grads, strict=True)])
        return tape.gradient(total, values, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    elems = ([leaves[i] for i in batched], grads)
    try:
        with _quiet_pfor():
            per_example = tf.vectorized_map(one_example, elems, fallback_to_while_loop=False)
    except Exception as error:  # noqa: BLE001 - pfor raises several types for missing converters
        warn_of_the_loop(layer, error, warned)
        per_example = tf.map_fn(one_example, elems,
                                fn_output_signature=[tf.TensorSpec(v.shape, v.dtype)
                                                     for v in values])
    return [Materialized(v, g) for v, g in zip(variables, per_example, strict=True)]
