"""``PerExampleModel``'s train step, written once for every backend.

One step on a batch ``(x_i, y_i, w_i)`` of ``B`` rows:

1. split the example indices off ``x``; on the first batch, the example-mixing check;
2. one forward and one backward pass of ``S * sum_i w_i l_i`` through the engine (``S`` the
   optimizer's loss scale, 1 without), every variable write of the forward pass recorded, then
   applied or refused (:func:`apply_state_updates`);
3. the aggregator's ``local`` part on the unscaled per-example gradients, its
   ``cross_replica`` combination under ``tf.distribute``, and ``finalize`` with the next key of
   the model's noise stream (or, for logical batches, :mod:`pergrad.keras.logical_batches`);
4. plus the gradient of the weight-regularization losses (they belong to no example);
5. Keras's loss and metrics with non-finite rows weighted out; the monitor's statistics;
   ``optimizer.apply``.

What differs per backend comes from ``on``, one of :mod:`pergrad.backend.tensorflow.trainer`,
:mod:`~pergrad.backend.jax.trainer` and :mod:`~pergrad.backend.torch.trainer`, each a thin trainer part:

* ``check_example_mixing(model, engine, x, y, sample_weight) -> checks``: the first-batch check
  (an assertion run before any state changes on TensorFlow, a gate on JAX, an error on PyTorch);
* ``after(checks)``: a context in which state changes wait for ``checks``;
* ``RECORD_VALUES``: whether the forward pass reads every variable through the recording scope
  (JAX's state, PyTorch's eager values) or from the variables themselves (TensorFlow's
  replicas);
* ``replicas()``: the ``tf.distribute`` replicas the optimizer sums over (1 elsewhere);
* ``local_and_stats(model, result, batch, extras)``: the aggregator's local part, and the
  monitor's statistics where the backend computes them alongside it (else ``None``);
* ``monitor(model, result, indices, sample_weight, extras)``: the monitor's statistics;
* ``kept_rows(structure, counted)``: the rows a compiled metric counts;
* ``apply(optimizer, grads, variables, trainable)``: the optimizer's update.
"""

from __future__ import annotations

import contextlib
import inspect
from types import ModuleType
from typing import Any

import keras
from keras import ops

from pergrad import aggregate
from pergrad._compat import (
    compiled_loss,
    compiled_metrics,
    loss_tracker,
    update_compiled_metrics,
)
from pergrad.aggregate import noise
from pergrad.backend import native
from pergrad.backend.ops import add_n, vjp, zero_rows
from pergrad.engine.masks import map_keeping_masks
from pergrad.keras import logical_batches

INDEX_KEY = "example_index"
"""Key of an ``x`` dict entry holding each example's dataset index (int, ``(B,)``).

It is removed from ``x`` before the model is called and handed to the monitor as ``indices``.
"""

#: ``PerExampleModel.mixing_status`` on JAX and PyTorch: the first-batch example-mixing check
#: has not run, passed, or refused the step.
UNCHECKED, CHECKED, REFUSED = 0, 1, 2

REFUSED_MESSAGE = (
    "The first training batch failed the example-mixing check: an example's loss differs "
    "between being computed inside the batch and alone, so a layer or the loss mixes examples "
    "(a mean over the batch axis, BatchNormalization in training mode, a batch-dependent loss). "
    "Clipping and DP noise would not bound one example's influence, and no step was applied. "
    "Remove the mixing, or pass check_example_mixing=False to PerExampleModel if you have "
    "accounted for it.")


def train_step(model, data, on: ModuleType) -> dict:
    """One step of ``model`` (a ``PerExampleModel``) on ``data``, changing its variables in
    place (on JAX inside the stateless scope of :mod:`pergrad.backend.jax.trainer`); the logs."""
    x, y, sample_weight, indices = unpack(model, data)
    engine = model.per_example()
    checks = on.check_example_mixing(model, engine, x, y, sample_weight)
    scale = current_loss_scale(model.optimizer)
    mapping = [(v, v.value) for v in model.variables] if on.RECORD_VALUES else None
    with on.after(checks), RecordingScope(mapping) as recording:
        # A loss scaled by S is the loss with every example's weight multiplied by S.
        result = engine.compute(x, y, scaled_weights(sample_weight, scale, x))
    with on.after(checks):  # a refused first step changes no state at all
        apply_state_updates(model, recording)
    check_no_call_losses(recording)
    variables = result.variables
    if scale is not None:
        result = result.scaled(1.0 / scale)  # unscaled gradients, float32 norms

    # Under a DP aggregator an overflowing example is dropped like a NaN one (no skipped step
    # that one example could decide); otherwise it reaches the loss-scale optimizer, which skips
    # the step and lowers the scale, as in Keras.
    loss_scaled = scale is not None and not model.aggregator.noisy
    batch = aggregate.Batch.of(result, sample_weight, loss_scaled=loss_scaled)
    # This step's learning rate (for TracIn), read before the update moves a schedule on.
    extras = {"labels": y, "learning_rate": ops.convert_to_tensor(model.optimizer.learning_rate),
              "from_logits": model.from_logits}
    local, stats = on.local_and_stats(model, result, batch, indices, sample_weight, extras)
    total = aggregate.cross_replica(local, model.aggregator.gathers)
    with on.after(checks):
        if model.logical_sums is not None:  # noise once per logical batch
            grads = logical_batches.release_update(model, total, model.accumulation_steps)
        else:
            key = noise.next_key(model.noise_state) if model.aggregator.noisy else None
            grads = model.aggregator.finalize(total, key)
    check_shapes(model.aggregator, grads, variables)
    regularization = regularization_gradients(variables)
    if regularization is not None:
        grads = [g + ops.cast(r, g.dtype) for g, r in zip(grads, regularization, strict=True)]
    replicas = on.replicas()
    if replicas > 1:  # the optimizer sums over replicas what is already global
        grads = [g / ops.cast(replicas, g.dtype) for g in grads]
    # Report before the update: Keras's loss includes the regularization of the old weights.
    logs = report(model, x, y, result, sample_weight, local.dropped, replicas, on.kept_rows)
    if model.monitor is not None and stats is None:
        stats = on.monitor(model, result, indices, sample_weight, extras)
    if scale is not None:  # the optimizer divides by the loss scale
        grads = [g * ops.cast(scale, g.dtype) for g in grads]
    with on.after(checks):
        on.apply(model.optimizer, grads, variables, list(model.trainable_variables))
    if model.aggregator.noisy and replicas == 1 \
            and isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        # DP steps are never skipped, so the scale would only grow, on a schedule, until every
        # example overflows: hold it at its initial value (data-independent).
        model.optimizer.step_counter.assign(0)
    if stats is not None:
        logs = {**logs, **dict(stats)}
    return logs


# -- the batch ------------------------------------------------------------------------------------
def split_indices(x) -> tuple[Any, Any]:
    """``(x, indices)``: the :data:`INDEX_KEY` entry of a dict ``x`` split off (``None`` when
    absent); a dict left with one entry becomes that entry."""
    if isinstance(x, dict) and INDEX_KEY in x:
        x = dict(x)
        indices = x.pop(INDEX_KEY)
        if len(x) == 1:
            (x,) = x.values()
        return x, indices
    return x, None


def unpack(model, data) -> tuple:
    """``(x, y, sample_weight, indices)`` of one training batch, every backend: the example
    indices split off ``x``, dict targets in the compiled loss's order, one sample weight per
    example or a ``ValueError``."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, indices = split_indices(x)
    if isinstance(sample_weight, (dict, list, tuple)):
        raise ValueError("PerExampleModel supports one sample weight per example, shape "
                         "(batch,); got a structure of sample weights.")
    if model.target_order is not None and isinstance(y, dict):
        y = [y[name] for name in model.target_order]
    return x, y, sample_weight, indices


def current_loss_scale(optimizer) -> Any:
    """``S`` such that ``optimizer.apply`` divides gradients by ``S`` (or ``None``)."""
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) \
        or getattr(optimizer, "loss_scale_factor", None) is not None
    if not scaled:
        return None
    return ops.cast(optimizer.scale_loss(ops.convert_to_tensor(1.0, "float32")), "float32")


def scaled_weights(sample_weight, scale, x) -> Any:
    """``S w_i`` (``S`` for every example without weights): the weights under which the
    engine's per-example losses are the loss-scaled ones, ``S w_i l_i``."""
    if scale is None:
        return sample_weight
    if sample_weight is None:
        return ops.full([ops.shape(keras.tree.flatten(x)[0])[0]], scale, dtype="float32")
    return ops.cast(sample_weight, "float32") * ops.cast(scale, "float32")


# -- the forward pass's side effects --------------------------------------------------------------
class RecordingScope(keras.StatelessScope):
    """A ``keras.StatelessScope`` that also remembers *which* variables were written, so that
    every write (the model's, a custom loss's, Keras's global seed generator's) is applied or
    refused after the forward pass, never silently dropped."""

    def __init__(self, state_mapping=None) -> None:
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.written: dict[int, Any] = {}

    def add_update(self, update) -> None:
        super().add_update(update)
        self.written[id(update[0])] = update[0]


def _is_seed_state(variable) -> bool:
    """A ``keras.random.SeedGenerator``'s state (dropout's): it advances every training call,
    independently of the data, and is not a statistic of the batch."""
    return variable.name == "seed_generator_state"


def apply_state_updates(model, scope: RecordingScope) -> None:
    """Apply the variable writes recorded during the forward pass, or refuse them.

    Seed-generator states (dropout) advance as usual. Any other non-trainable variable written
    from the batch is, under a noisy aggregator, released without noise: refused unless the
    model's ``allow_state_updates``.
    """
    written = list(scope.written.values())
    leaking = [v for v in written if not _is_seed_state(v)]
    if leaking and model.aggregator.noisy and not model.allow_state_updates:
        names = ", ".join(getattr(v, "path", v.name) for v in leaking)
        raise ValueError(
            f"The model writes the non-trainable variable(s) {names} from the batch during "
            f"training. Under the DP aggregator {model.aggregator.name!r} they would be "
            "released without noise, breaking the privacy guarantee. Freeze them (e.g. "
            "call the layer with training=False, or make the statistic trainable=False and "
            "fixed), or pass allow_state_updates=True to PerExampleModel if you account for "
            "their release yourself.")
    for v in written:
        v.assign(scope.get_current_value(v))


def check_no_call_losses(scope: RecordingScope) -> None:
    """Refuse losses added during the forward pass (collected by the scope)."""
    if scope.losses:
        raise ValueError(
            "The model adds losses in call() (add_loss or an activity_regularizer). They are "
            "computed from the whole batch, so PerExampleModel cannot split them into "
            "per-example gradients; remove them or fold them into the per-example loss.")


# -- the update -----------------------------------------------------------------------------------
def check_shapes(aggregator, grads: list, variables: list) -> None:
    """Refuse an aggregator's output that does not match the trainable variables."""
    if len(grads) != len(variables):
        raise ValueError(f"The aggregator {aggregator.name!r} returned {len(grads)} "
                         f"gradients for {len(variables)} trainable variables.")
    for g, v in zip(grads, variables, strict=True):
        if tuple(g.shape) != tuple(v.shape):
            raise ValueError(f"The aggregator {aggregator.name!r} returned shape "
                             f"{tuple(g.shape)} for variable {v.path!r} of shape "
                             f"{tuple(v.shape)}.")


def regularization_gradients(variables: list) -> list | None:
    """``d/dw sum_k penalty_k(w_k)`` for every variable (zeros where there is no penalty), or
    ``None`` when no variable has a regularizer; one VJP of the summed penalties."""
    regularized = [k for k, v in enumerate(variables)
                   if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return None

    def total(chosen):
        return sum(ops.cast(variables[k].regularizer(value), "float32")
                   for k, value in zip(regularized, chosen, strict=True))

    values = tuple(ops.stop_gradient(ops.convert_to_tensor(variables[k].value))
                   for k in regularized)
    grads = vjp(total, values, ops.ones((), "float32"))
    out = [ops.zeros(v.shape, v.dtype) for v in variables]
    for k, g in zip(regularized, grads, strict=True):
        out[k] = g
    return out


# -- what the step reports ------------------------------------------------------------------------
def accepted(function, keywords: dict) -> dict:
    """The entries of ``keywords`` that ``function`` accepts (all with ``**kwargs``), so a custom
    monitor with the documented ``compute(result, indices=, sample_weight=)`` keeps working."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return keywords
    return {k: v for k, v in keywords.items() if k in parameters}


def call_monitor(model, result, indices, sample_weight, extras: dict) -> dict:
    """The monitor's statistics of this step, from the raw per-example gradients."""
    monitor = model.monitor
    stats = monitor.compute(result, indices=indices, sample_weight=sample_weight,
                            **accepted(monitor.compute, extras))
    return dict(stats)


def report(model, x, y, result, sample_weight, dropped, replicas: int = 1,
           kept_rows=None) -> dict:
    """Keras's loss and metrics of this step; a dropped example does not turn them into NaN.

    The loss is ``sum_i w_i l_i / B + sum(model.losses)``, Keras's ``sum_over_batch_size``
    reduction, over the examples whose weighted loss ``w_i l_i`` is finite. Where the engine's
    per-example losses give it exactly (one output, no mask, no ``compute_loss`` override:
    :func:`loss_from_per_example_losses`) it is read from them; otherwise, and for
    the compiled metrics, Keras's compiled loss and metrics run again on predictions whose
    non-finite rows are zeroed and weighted 0.

    Rows of weight 0 (Poisson padding, dropped examples) count in no metric: ``kept_rows(
    structure, counted)`` removes them (TensorFlow, PyTorch); where it is ``None`` (JAX keeps
    static shapes) the unweighted ``metrics=`` get the counted rows as their weight instead
    (a model that overrides ``compute_metrics`` gets Keras's call there). Keras scales each
    replica's loss by ``1 / replicas``; its tracker is given the loss times ``replicas``."""
    batch = result.batch_size
    model.dropped_examples.update_state(dropped)
    loss = loss_from_per_example_losses(model, result, replicas)
    metrics = has_compiled_metrics(model)
    if loss is not None and not metrics:
        loss_tracker(model).update_state(loss, sample_weight=batch)
        return model.compute_metrics(x, y, result.predictions, sample_weight=sample_weight)
    keep = ops.logical_and(ops.isfinite(result.losses),
                           _rows_finite(result.predictions, batch))
    keep = ops.logical_and(keep, _rows_finite(y, batch))
    y_pred = _zero_rows(result.predictions, keep)
    y = _zero_rows(y, keep)
    weight = ops.cast(keep, "float32")
    if sample_weight is not None:
        sw = ops.convert_to_tensor(sample_weight)
        weight = ops.reshape(ops.cast(weight, sw.dtype), [-1] + [1] * (len(sw.shape) - 1))
        weight = _zero_rows(sw, keep) * weight
    counted = ops.any(ops.reshape(ops.not_equal(weight, 0), [batch, -1]), axis=1)
    weight = loss_weights(weight, y_pred)
    if loss is None:
        loss = compiled_loss(model, x, y, y_pred, weight)
    loss_tracker(model).update_state(loss * ops.cast(replicas, loss.dtype), sample_weight=batch)
    if kept_rows is not None:
        y, y_pred, weight = (map_keeping_masks(lambda t: kept_rows(t, counted), s,
                                               on_mask=lambda m: kept_rows(m, counted))
                             for s in (y, y_pred, weight))
    elif type(model).compute_metrics is keras.Model.compute_metrics \
            and compiled_metrics(model) is not None:
        # Static shapes (JAX): the rows stay, and the unweighted metrics= get the counted rows
        # as their weight, which leaves the others out of every Keras metric.
        rows = loss_weights(ops.cast(counted, "float32"), y_pred)
        update_compiled_metrics(compiled_metrics(model), y, y_pred, weight, rows)
        return model.get_metrics_result()
    return model.compute_metrics(x, y, y_pred, sample_weight=weight)


def loss_from_per_example_losses(model, result, replicas: int = 1) -> Any:
    """Keras's loss of the step, ``sum_i w_i l_i / B + sum(model.losses)`` (as
    ``Model._compute_loss`` computes it on one replica), from the engine's per-example losses
    ``w_i l_i``, a non-finite one counted as 0; ``None`` where their batch mean is not Keras's loss or not all
    Keras reports: a loss that applied a mask (Keras divides by the valid entries of the whole
    batch, the engine by each example's own), a model that overrides ``compute_loss``, one
    with several outputs (Keras also logs each output's loss), or a step on several replicas
    or under ``tf.distribute`` (Keras's own loss scaling and tracking there)."""
    if type(model).compute_loss is not keras.Model.compute_loss:
        return None
    if len(keras.tree.flatten(result.predictions)) > 1 or _under_tf_distribute(replicas):
        return None
    if any(_applied_mask(fn) for fn in keras.tree.flatten(model._per_example_loss)):
        return None
    losses = result.losses
    kept = ops.where(ops.isfinite(losses), losses, ops.zeros_like(losses))
    loss = ops.sum(kept) / ops.cast(result.batch_size, losses.dtype)
    regularization = [ops.sum(ops.cast(r, losses.dtype)) for r in model.losses]
    return loss + add_n(regularization) if regularization else loss


def _under_tf_distribute(replicas: int) -> bool:
    """Whether the step runs on several replicas or inside a ``tf.distribute`` strategy, where
    Keras's reduction and loss tracking are its own (kept as they are: the compiled loss)."""
    if replicas != 1:
        return True
    return native().has_strategy()


def _applied_mask(loss_fn) -> bool:
    """Whether a per-example loss (``leaf_loss``'s, perhaps weighted) has applied a mask; an
    unknown function might have."""
    leaf = getattr(loss_fn, "leaf", loss_fn)
    return leaf is not None and getattr(leaf, "masked", True)


def has_compiled_metrics(model) -> bool:
    """Whether ``compute_metrics`` reads the predictions: metrics were compiled, or the model
    overrides it."""
    return (compiled_metrics(model) is not None
            or type(model).compute_metrics is not keras.Model.compute_metrics)


def loss_weights(weight: Any, predictions: Any) -> Any:
    """One weight per example, ``(B,)``, shaped for Keras's compiled loss and metrics: for an
    output of rank above 2 (a sequence ``(B, T, F)``) broadcast over the axes of its unreduced
    loss (the output's shape less its last axis, ``(B, T)``), which Keras cannot weight by a
    ``(B,)`` vector; unchanged where every output has rank 1 or 2."""
    leaves = [p for p in keras.tree.flatten(predictions) if p is not None]
    if all(len(p.shape) <= 2 for p in leaves):
        return weight

    def expand(p):
        if p is None or len(p.shape) <= 2:
            return weight
        column = ops.reshape(weight, [-1] + [1] * (len(p.shape) - 2))
        return column * ops.ones_like(p[..., 0], dtype=weight.dtype)

    return keras.tree.map_structure(expand, predictions)


def _is_float(t) -> bool:
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype))


def _rows_finite(structure, batch) -> Any:
    """``(B,)``: the rows whose every floating entry is finite."""
    keep = ops.ones([batch], "bool")
    for t in keras.tree.flatten(structure):
        if t is None or not _is_float(t):
            continue
        flat = ops.reshape(t, [batch, -1])
        keep = ops.logical_and(keep, ops.all(ops.isfinite(flat), axis=1))
    return keep


def _zero_rows(structure, keep) -> Any:
    """Every floating leaf with the rows not in ``keep`` zeroed, its Keras mask kept."""
    return map_keeping_masks(lambda t: t if not _is_float(t) else zero_rows(t, keep), structure)


# -- defaults of the backend parts ----------------------------------------------------------------
def no_checks(model, engine, x, y, sample_weight) -> list:
    """``check_example_mixing`` where a backend's check changes state itself (nothing to wait
    for)."""
    return []


def after(checks: list) -> contextlib.AbstractContextManager:
    """The context of a backend whose state changes need not wait for the checks (eager, or a
    gate applied to the whole new state)."""
    return contextlib.nullcontext()


def local_only(model, result, batch, indices, sample_weight, extras) -> tuple[Any, None]:
    """The aggregator's local part; the monitor runs on its own."""
    return model.aggregator.local(result, batch), None
