"""Checks that per-example gradients mean what they say, with tolerances that follow the dtype.

**Example mixing.** Per-example gradients exist only if example ``i``'s loss depends on example
``i`` alone. With ``l_k^B`` example ``k``'s loss computed inside the batch and ``l_k^1`` the same
example's loss computed as a batch of one (both with ``training=False``, so dropout cannot
differ), the mixing of a batch is

    m = max_k |l_k^B - l_k^1| / max(|l_k^B|, |l_k^1|, s),     s = mean_j |l_j^B|

over the first ``min(num_examples, B)`` examples. The floor ``s`` keeps a loss near zero (a
well-fit example) from turning rounding noise into a large *relative* difference: a difference
counts only when it is large against that example's loss *and* against the batch's typical loss.
An example whose loss is non-finite both ways is skipped (a NaN input row); one finite in one
computation and not in the other is infinitely mixed (another example's NaN leaked into it).

**Refused before any number is compared**, by name: a normalization whose statistics span the
batch axis (``refuse_statistics_over_the_batch``), a variable whose per-example gradient has
another number of rows than the batch has examples (:func:`check_rows`: its layer saw a tensor
whose first axis is not the batch), and a model with no trainable weights
(:func:`require_trainable_weights`).

**Tolerances** are relative and follow the least precise compute dtype of the model (see
:func:`mixing_tolerance`, :func:`gradient_tolerance`); float32 on a GPU counts as float16 while
TensorFloat-32 is enabled (TensorFlow's default), which rounds matmul inputs to 10 bits.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from pergrad import backend
from pergrad._compat import sublayers
from pergrad.backend.ops import full_float32, maximum, wide_float
from pergrad.rules.normalization import MixesExamplesError, refuse_statistics_over_the_batch

# Unit roundoff u = 2^-p of each floating dtype (p significand bits, the implicit one included).
_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
             "bfloat16": 2.0 ** -8}

# Losses of one example in and out of a batch differ only by rounding in a model that does not
# mix: a few units of roundoff u per layer, amplified by the loss's conditioning, and more where a
# kernel's accumulation order depends on the batch size (GPU GEMMs). On the test zoo (CPU, batch
# 5 and 128) the largest difference was 8e-16 (7 u) in float64, 4e-7 (7 u) in float32 and exactly
# 0 in float16 and bfloat16 (rows computed alike). The tolerances are 1e-10 (1e6 u), 1e-4
# (1.7e3 u), 1e-2 (20 u) and 5e-2 (13 u: one ulp of a bfloat16 prediction, 2u, already moves a
# squared error by 4u relative): far above rounding, far below what mixing does (a mean over the
# batch moves losses by O(1)).
_MIXING_RTOL = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}

# sum_i g_i against the batch gradient, relative to its largest entry: the engine sums B terms in
# another order, and under mixed precision multiplies half-precision activations and output
# gradients in float32, while the reference tape runs the half-precision backward kernels. On the
# zoo the largest error was 8e-16 (float64), 5e-7 (float32), 3.6e-3 (float16) and 4.4e-2
# (bfloat16, a convolution's filter gradient). A weight used outside its layer errs by O(1).
_GRADIENT_RTOL = {"float64": 1e-8, "float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}


def _floating(dtype: Any) -> str:
    name = keras.backend.standardize_dtype(getattr(dtype, "name", dtype))
    if name not in _ROUNDOFF:
        raise ValueError(f"Expected a floating dtype (float16, bfloat16, float32, float64), got "
                         f"{name}.")
    return name


def _tensor_float_32() -> bool:
    """Whether float32 matmuls run as TensorFloat-32: TensorFlow's default on a GPU, and JAX's
    default matmul precision on a GPU."""
    return backend.native().tensor_float_32()


def _effective(dtype: Any) -> str:
    """The dtype whose rounding the computation has: float32 matmuls and convolutions on a GPU
    run as TensorFloat-32 (the default on Ampere and later), whose 10-bit significand is
    float16's, so float32 then gets float16's tolerances."""
    dtype = _floating(dtype)
    if dtype == "float32" and _tensor_float_32():
        return "float16"
    return dtype


def mixing_tolerance(dtype: Any) -> float:
    """The largest :meth:`PerExample.example_mixing` value that is rounding, not mixing, for a
    model computing in ``dtype`` (``"float32"``, ``tf.float16``, ...): 1e-10 in float64, 1e-4 in
    float32, 1e-2 in float16, 5e-2 in bfloat16 (8 significand bits: 13 units of roundoff).
    float32 on a GPU with TensorFloat-32 enabled (the default) gets float16's."""
    return _MIXING_RTOL[_effective(dtype)]


def gradient_tolerance(dtype: Any) -> float:
    """The relative error (against the largest batch-gradient entry) that
    :meth:`PerExample.check` allows between ``sum_i g_i`` and the batch gradient for a model
    computing in ``dtype``: 1e-8 in float64, 1e-4 in float32, 2e-2 in float16, 1e-1 in
    bfloat16; float32 on a GPU with TensorFloat-32 enabled gets float16's. A weight used
    outside its own layer errs by O(1)."""
    return _GRADIENT_RTOL[_effective(dtype)]


def _layer_rounding(layer) -> str:
    """The dtype whose rounding ``layer``'s output has. On JAX, Keras's dtype promotion maps
    64-bit results to 32-bit (``keras.backend.result_type("float64", "float32")`` is
    ``"float32"``, to match JAX's default), so normalization layers compute their statistics in
    float32 even in a float64 model: they round as float32. On PyTorch the same promotion
    reaches ``keras.ops.matmul`` itself (``result_type("float64", "float64")`` is
    ``"float32"`` there, and the torch backend multiplies in that dtype), so every layer of a
    float64 model rounds as float32."""
    dtype = keras.backend.standardize_dtype(layer.compute_dtype)
    return backend.native().layer_rounding(layer, dtype)


def compute_dtype(model) -> str:
    """The least precise floating compute dtype among ``model`` and all its layers
    (``"float16"`` under ``mixed_float16``, even if some layers compute in float32)."""
    dtypes = {_layer_rounding(layer) for layer in sublayers(model, include_self=True)}
    floating = [d for d in dtypes if d in _ROUNDOFF]
    if not floating:
        return keras.config.floatx()
    return max(floating, key=lambda d: _ROUNDOFF[d])


def _take(structure, index):
    """Rows ``index`` (shape ``(1,)``) of every tensor of a nested structure."""
    return keras.tree.map_structure(
        lambda t: None if t is None else ops.take(t, index, axis=0), structure)


def _relative(in_batch, alone, floor):
    """``|a - b| / max(|a|, |b|, floor)``; 0 where both are non-finite, inf where one is."""
    finite_a, finite_b = ops.isfinite(in_batch), ops.isfinite(alone)
    a = ops.where(finite_a, in_batch, ops.zeros_like(in_batch))
    b = ops.where(finite_b, alone, ops.zeros_like(alone))
    scale = maximum(maximum(ops.abs(a), ops.abs(b)), floor)
    tiny = ops.cast(np.finfo(np.float32).tiny, a.dtype)
    relative = ops.abs(a - b) / maximum(scale, tiny)
    one_sided = ops.not_equal(finite_a, finite_b)
    return ops.where(one_sided, ops.cast(np.inf, a.dtype), relative)


def mixing_differences(model, loss_fn, x, y, num_examples: int,
                       at_perturbed_weights: bool = True):
    """``(n,)`` float64 (float32 on JAX without x64): the relative difference (module docstring)
    of example ``k``'s loss in and out of the batch for ``k < n = num_examples``; with fewer
    examples than that, the last one is repeated. Traceable (a ``tf.function``, a ``tf.cond``
    branch): ``num_examples`` model calls on one example each, unrolled, no loop, except on
    JAX, where one ``lax.map`` over the examples compiles the call once
    (:func:`pergrad.backend.protocol.Backend.concatenate_over_range`).

    Each difference is the larger of two: at the model's weights, and at randomly perturbed
    trainable weights (:func:`perturbed_weights`). A path that mixes examples behind a factor
    initialised at zero (a gate, ReZero/LayerScale scalars, LoRA's ``B``) contributes nothing
    at initialisation and would pass a check of the current weights alone, then mix once
    training moves the factor; at perturbed weights it shows. There only finite differences
    above float32's rounding (1e-4) count: a perturbation that overflows proves nothing. ``at_perturbed_weights=False``
    measures the current weights alone."""
    # A normalization over the batch axis mixes by construction, and its call on one example
    # would end in a shape error before any loss could be compared: refuse it by name first.
    refuse_statistics_over_the_batch(model)
    # One example alone and in a batch may run other kernels (cuDNN picks its algorithm per
    # shape); in TensorFloat-32 they then differed by 1.2e-4 to 4e-4 (PyTorch on an H200),
    # over the tolerance: the comparison runs in full float32.
    with full_float32():
        return _mixing_differences(model, loss_fn, x, y, num_examples, at_perturbed_weights)


def _mixing_differences(model, loss_fn, x, y, num_examples: int, at_perturbed_weights: bool):
    variables = [*model.trainable_variables, *model.non_trainable_variables]
    values = [ops.convert_to_tensor(variable.value) for variable in variables]
    current = _differences(_call_at(model, list(zip(variables, values, strict=True))), loss_fn,
                           x, y, num_examples)
    if not at_perturbed_weights:
        return current
    trainable, frozen = perturbed_weights(model)
    mapping = [*zip(model.trainable_variables, trainable, strict=True),
               *zip(model.non_trainable_variables, frozen, strict=True)]
    perturbed = _differences(_call_at(model, mapping), loss_fn, x, y, num_examples)
    # Only a finite difference above float32's rounding counts there: XLA may compute the
    # perturbed pass of a float64 model with float32 rounding (seen on JAX's CPU: 1.5e-7), and
    # a path that really mixes differs by far more once its factor is open.
    real = ops.logical_and(ops.isfinite(perturbed),
                           perturbed > ops.cast(_PERTURBED_FLOOR, perturbed.dtype))
    perturbed = ops.where(real, perturbed, ops.zeros_like(perturbed))
    return maximum(current, perturbed)


def _call_at(model, mapping: list):
    """The model's own ``__call__`` (input casting, autocast) with ``training=False`` and the
    variables' values in ``mapping``, each call in a scope of its own: what a call writes (a
    random layer's seed, a counter) or adds (activity-regularization losses) stays there, so
    the check changes no state and nothing traced inside JAX's ``lax.map``
    (:func:`pergrad.backend.protocol.Backend.concatenate_over_range`) leaks out of it."""

    def call(inputs):
        with keras.StatelessScope(state_mapping=mapping):
            return model(inputs, training=False)

    return call


#: The smallest relative difference at perturbed weights that counts as mixing (float32's
#: mixing tolerance, :func:`mixing_tolerance`).
_PERTURBED_FLOOR = 1e-4


def perturbed_weights(model, seed: int = 20261203) -> tuple[list, list]:
    """``(trainable values, non-trainable values)`` for ``model.stateless_call``: every
    floating trainable weight ``w`` moved by ``0.1 (rms(w) + 1) z``, ``z`` standard normal
    drawn from a fixed seed (so factors at zero open); the rest as they are.

    One draw per dtype, cut into the weights: under XLA every draw of a new shape compiles to
    its own random-number kernel, which made a large part of a compiled check's compile time."""
    values = [ops.convert_to_tensor(variable.value) for variable in model.trainable_variables]
    dtypes = [keras.backend.standardize_dtype(value.dtype) for value in values]
    noise: list = [None] * len(values)
    floating = [k for k, dtype in enumerate(dtypes) if keras.backend.is_float_dtype(dtype)]
    for g, dtype in enumerate(dict.fromkeys(dtypes[k] for k in floating)):
        members = [k for k in floating if dtypes[k] == dtype]
        sizes = [int(np.prod(values[k].shape)) for k in members]
        flat = keras.random.normal((sum(sizes),), dtype=dtype, seed=seed + g)
        start = 0
        for k, size in zip(members, sizes, strict=True):
            noise[k] = ops.reshape(flat[start:start + size], tuple(values[k].shape))
            start += size
    trainable = []
    for variable, value, z, dtype in zip(model.trainable_variables, values, noise, dtypes,
                                         strict=True):
        if z is not None:
            rms = ops.sqrt(ops.mean(ops.square(value))) if len(value.shape) else ops.abs(value)
            value = value + ops.cast(0.1, dtype) * (rms + ops.cast(1.0, dtype)) * z
        trainable.append(ops.cast(value, variable.dtype))
    frozen = [ops.convert_to_tensor(v.value) for v in model.non_trainable_variables]
    return trainable, frozen


def _differences(call, loss_fn, x, y, num_examples: int):
    """:func:`mixing_differences` for one way of calling the model."""
    wide = wide_float()
    in_batch = ops.cast(loss_fn(y, call(x)), wide)
    size = ops.shape(in_batch)[0]
    finite = ops.isfinite(in_batch)
    magnitude = ops.where(finite, ops.abs(in_batch), ops.zeros_like(in_batch))
    floor = ops.sum(magnitude) / maximum(ops.sum(ops.cast(finite, wide)), 1.0)
    static = in_batch.shape[0]
    count = num_examples if static is None else max(1, min(num_examples, int(static)))

    def difference(k):
        index = ops.reshape(ops.minimum(k, size - 1), [1])
        alone = ops.cast(loss_fn(_take(y, index), call(_take(x, index))), wide)
        return _relative(ops.take(in_batch, index, axis=0), alone, floor)

    return backend.native().concatenate_over_range(difference, count)


def require_trainable_weights(model) -> None:
    """Refuse a model with no trainable weights (every layer frozen): it has no gradients, per
    example or otherwise, and the engine would otherwise fail far from the cause."""
    if not model.trainable_variables:
        raise ValueError(
            f"Model {model.name!r} has no trainable weights (e.g. all its layers are frozen: "
            "model.trainable = False), so it has no per-example gradients. Unfreeze the layers "
            "to train (layer.trainable = True) before building PerExample or PerExampleModel.")


def _static_rows(form) -> int | None:
    """The static number of examples (leading axis) a form's per-example factor has: its output
    gradient ``d`` (factored, rows), its materialized value, or ``None`` when unknown (a
    dynamic batch, a custom form without those members)."""
    form = getattr(form, "inner", form)  # a Scaled form
    for name in ("d", "value"):
        shape = getattr(getattr(form, name, None), "shape", None)
        if shape is not None and len(shape) > 0:
            return None if shape[0] is None else int(shape[0])
    return None


def check_rows(result) -> None:
    """Refuse a result with a variable whose per-example gradients do not have one row per
    example: its layer was called on a tensor whose first axis is not the batch (attention over
    a transposed batch, a reshape that folds examples together), so its gradient mixes examples.
    Static shapes only (no cost): a dynamic batch passes here, and mixing is then caught by
    :func:`mixing_differences` when it runs."""
    batch = result.losses.shape[0] if len(result.losses.shape) else None
    if batch is None:
        return
    for variable, form in zip(result.variables, result.forms, strict=True):
        rows = None if form is None else _static_rows(form)
        if rows is not None and rows != int(batch):
            raise MixesExamplesError(
                f"The per-example gradient of {variable.path!r} has {rows} rows for a batch of "
                f"{int(batch)} examples: its layer was called on a tensor whose first axis is not "
                "the batch (a transpose or reshape moved the batch axis, e.g. attention over the "
                "batch), so it mixes examples and per-example gradients do not exist. Keep the "
                "batch as the first axis of every layer's input.")


def mixing_error(example: int, difference: float) -> MixesExamplesError:
    """The error for a batch whose example ``example``'s loss differs by ``difference``
    (relative) when that example is computed alone."""
    return MixesExamplesError(
        f"Example {example}'s loss differs by {difference:.3g} (relative) when computed alone: a "
        "layer or the loss mixes examples of a batch (e.g. a mean over axis 0, "
        "BatchNormalization in training mode); per-example gradients and DP guarantees would be "
        "wrong. Make every layer and the loss compute each example from that example alone: "
        "replace BatchNormalization with pergrad.keras.replace_batch_normalization(model) "
        "(training from scratch) or freeze it (fine-tuning).")
