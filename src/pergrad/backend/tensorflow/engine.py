"""The TensorFlow engine: ``auto`` (one ``GradientTape`` pass to the recorded pre-activations,
then rules) and the whole-model baselines ``loop``, ``jacobian`` and ``vmap``, all returning a
:class:`PerExampleResult`."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from pergrad._compat import autocast_scope, call_takes_training
from pergrad.backend.tensorflow.generic import draws_random, generic_forms, recorded_vjps
from pergrad.engine.assemble import (
    add_rows,
    assembled_result,
    forms_by_variable,
    in_groups,
    materialized_result,
)
from pergrad.engine.intercept import record_calls
from pergrad.engine.losses import weighted_losses
from pergrad.engine.plan import Plan
from pergrad.engine.result import PerExampleResult


def _static_batch(x) -> int | None:
    return tf.nest.flatten(x)[0].shape[0]


def run_auto(model, plan: Plan, loss_fn, x, y, sample_weight, training: bool,
             warned: set) -> PerExampleResult:
    """Record, one backward pass of the summed loss to every tap, then rules."""
    replayed = {id(layer) for layer in plan.generic if training and draws_random(layer)}
    with tf.GradientTape(persistent=bool(plan.residual or replayed)) as tape:
        with record_calls(plan) as calls:
            predictions = model(x, training=training)
        losses = weighted_losses(loss_fn(y, predictions), sample_weight)
        total = tf.reduce_sum(losses)
    records = [c for layer in plan.tapped_layers for c in calls.get(id(layer), [])]
    taps = [[t for t in tf.nest.flatten(r.tapped) if isinstance(t, tf.Tensor)] for r in records]
    grads = tape.gradient(total, [t for group in taps for t in group],
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    taps_of = {id(record): group for record, group in zip(records, taps, strict=True)}
    batch = _static_batch(x)

    def generic(call, call_grads):
        if id(call.layer) in replayed:  # dropout: differentiate the pass that drew the mask
            return recorded_vjps(tape, call.layer, taps_of[id(call)], call_grads)
        return generic_forms(call.layer, call, call_grads, batch, warned)

    grouped = in_groups(grads, [len(group) for group in taps])
    by_variable = forms_by_variable(plan, zip(records, grouped, strict=True), generic)
    if plan.residual:
        add_rows(by_variable, plan.residual,
                 tape.jacobian(losses, plan.residual,
                               unconnected_gradients=tf.UnconnectedGradients.ZERO))
    return assembled_result(model, by_variable, losses, predictions)


def run_jacobian(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """``tape.jacobian`` of the per-example losses: ``O(B)`` backward passes through pfor."""
    variables = list(model.trainable_variables)
    with tf.GradientTape() as tape:
        predictions = model(x, training=training)
        losses = weighted_losses(loss_fn(y, predictions), sample_weight)
    grads = tape.jacobian(losses, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return materialized_result(model, grads, losses, predictions)


def _one_example_fn(model, loss_fn, training: bool, values, frozen):
    def fn(elems):
        elems = tf.nest.map_structure(lambda t: t[None], elems)
        xi, yi, wi = elems if len(elems) == 3 else (elems[0], None, elems[1])
        with tf.GradientTape() as tape, autocast_scope(model):
            tape.watch(values)
            kwargs = {"training": training} if call_takes_training(model) else {}
            predictions, _ = model.stateless_call(values, frozen, xi, **kwargs)
            loss = weighted_losses(loss_fn(yi, predictions), wi)[0]
        grads = tape.gradient(loss, values, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return loss, grads
    return fn


def _example_elems(x, y, sample_weight) -> tuple:
    """``(x, y, w)`` to map over (``(x, w)`` when there is no ``y``), with unit weights if none."""
    if sample_weight is None:
        sample_weight = tf.ones([tf.shape(tf.nest.flatten(x)[0])[0]], tf.float32)
    return (x, sample_weight) if y is None else (x, y, sample_weight)


def run_vmap(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """``tf.vectorized_map`` of one example's gradient through ``model.stateless_call``.

    The vectorized region is always compiled with XLA: without it, pfor over a Keras 3
    attention block segfaults on TF 2.21 (CPU) from batch 8 upward, taking the process down.
    """
    values = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]
    fn = _one_example_fn(model, loss_fn, training, values, frozen)
    vectorized = tf.function(lambda elems: tf.vectorized_map(fn, elems), jit_compile=True,
                             autograph=False)
    losses, grads = vectorized(_example_elems(x, y, sample_weight))
    predictions = model(x, training=training)
    return materialized_result(model, grads, losses, predictions)


def run_loop(model, loss_fn, x, y, sample_weight, training: bool) -> PerExampleResult:
    """One tape per example in a ``tf.while_loop``: the reference every other strategy matches."""
    values = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]
    fn = _one_example_fn(model, loss_fn, training, values, frozen)
    loss_dtype = tf.float64 if tf.float64 in {tf.as_dtype(v.dtype) for v in values} else tf.float32
    signature = (tf.TensorSpec([], loss_dtype), [tf.TensorSpec(v.shape, v.dtype) for v in values])
    losses, grads = tf.map_fn(fn, _example_elems(x, y, sample_weight), fn_output_signature=signature,
                              parallel_iterations=1)
    predictions = model(x, training=training)
    return materialized_result(model, grads, losses, predictions)


RUNNERS: dict[str, Any] = {"jacobian": run_jacobian, "vmap": run_vmap, "loop": run_loop}


def batch_gradient(model, loss_fn, x, y, sample_weight, training: bool) -> list:
    """``d/dtheta sum_i l_i`` by an ordinary tape: what :meth:`PerExample.check` compares
    ``sum_i g_i`` with."""
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(weighted_losses(loss_fn(y, model(x, training=training)),
                                              sample_weight))
    batch = tape.gradient(total, model.trainable_variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in batch]  # IndexedSlices too


def compile_function(model, body, on_trace, jit_compile: bool = False) -> Any:
    """``body(*args)`` as one ``tf.function`` (``reduce_retracing=True``; XLA with
    ``jit_compile``), ``on_trace()`` called at every trace. The model's variables are read as
    variables, so training updates are seen without retracing. No AutoGraph: Keras 3 layers
    need none, traces are faster, and errors raised while tracing (``MixesExamplesError``,
    ``ControlFlowError``) reach the caller with their types."""
    del model

    def traced(*args):
        on_trace()
        return body(*args)

    return tf.function(traced, jit_compile=jit_compile, reduce_retracing=True, autograph=False)
