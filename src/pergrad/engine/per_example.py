"""``PerExample``: compiled per-example gradients, norms, dot products and clipped sums."""

from __future__ import annotations

import collections
import math
from typing import Any

import keras
import numpy as np
from keras import ops

from pergrad import backend
from pergrad._compat import is_keras_variable
from pergrad.backend.ops import maximum, minimum
from pergrad.engine.arguments import positive_integer, positive_real
from pergrad.engine.checks import (
    check_rows,
    compute_dtype,
    gradient_tolerance,
    mixing_differences,
    mixing_error,
    mixing_tolerance,
    require_trainable_weights,
)
from pergrad.engine.losses import per_example_loss, weighted_losses
from pergrad.engine.plan import Plan, make_plan
from pergrad.engine.result import PerExampleResult
from pergrad.engine.strategies import STRATEGIES, engine_module, run
from pergrad.rules.query import NORMS_THEN_SUMS


def _to_tensors(structure):
    """Arrays to tensors as Keras's data adapters do: floating arrays become ``floatx``."""
    def convert(leaf):
        if leaf is None or ops.is_tensor(leaf) or is_keras_variable(leaf):
            return leaf
        array = np.asarray(leaf)
        if np.issubdtype(array.dtype, np.floating):
            array = array.astype(keras.config.floatx())
        return ops.convert_to_tensor(array)
    return keras.tree.map_structure(convert, structure)


def _batch_size(x) -> int | None:
    """The static batch size, or ``None`` inside a trace with a dynamic batch dimension."""
    first = keras.tree.flatten(x)[0]
    return None if first.shape[0] is None else int(first.shape[0])


def _slice(structure, start: int, stop: int):
    return keras.tree.map_structure(lambda t: None if t is None else t[start:stop],
                                    structure)


class PerExample:
    """Per-example gradients of a Keras 3 model's loss, in one forward and one backward pass.

    For a batch ``(x_i, y_i, w_i)`` and per-example loss ``l_i = w_i * loss(y_i, model(x_i))``
    this computes ``g_i = d l_i / d theta`` for every trainable variable ``theta``, or quantities of
    them (norms, dot products, clipped sums) without ever forming all ``g_i`` when a layer's rule
    makes that unnecessary.

    Args:
        model: any Keras 3 model (Sequential, Functional, subclassed, nested).
        loss: a Keras loss object or name, a callable ``(y_true, y_pred) -> (B,)``, a list/dict of
            those per output, or ``None`` if the model outputs per-example losses itself.
        strategy: ``"auto"`` (layer rules, generic fallback), ``"vmap"``, ``"jacobian"`` or
            ``"loop"``; all give the same numbers.
        memory_budget_bytes: when ``gradients`` would hold more than this many bytes of
            ``B x P`` floats, it runs in chunks of examples (same results).
        jit_compile: compile the computations with XLA.
        training: the ``training`` flag the model is called with (dropout masks then differ per
            call; BatchNormalization in training mode is refused).

    Regularization losses (``model.losses``) belong to no example and are not included; add
    their gradient once to whatever you aggregate (``pergrad.keras.PerExampleModel`` does).
    """

    def __init__(self, model: keras.Model, loss: Any, strategy: str = "auto",
                 memory_budget_bytes: int | None = None, jit_compile: bool = False, *,
                 training: bool = False) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
        if memory_budget_bytes is not None:
            memory_budget_bytes = positive_integer(memory_budget_bytes, "memory_budget_bytes")
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"model must be a Keras model or layer, got {type(model).__name__}.")
        self.model = model
        self.loss = loss
        self.strategy = strategy
        self.memory_budget_bytes = memory_budget_bytes
        self.jit_compile = jit_compile
        self.training = training
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._loss_fn = per_example_loss(loss)
        self._plan: Plan | None = None
        self._compiled: dict[str, Any] = {}
        self._warned: set[int] = set()
        self._engine = engine_module()

    # -- traceable core -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """Which layers use a rule, which the generic rule, and which variables are residual."""
        if self._plan is None:
            if not self.model.built:
                raise ValueError("The model is not built yet; call it on a batch first.")
            require_trainable_weights(self.model)
            self._plan = make_plan(self.model)
        return self._plan

    @property
    def compute_dtype(self) -> str:
        """The least precise floating compute dtype of the model's layers (``float16`` under
        ``mixed_float16``): the dtype the tolerances of :meth:`check` follow."""
        return compute_dtype(self.model)

    def compute(self, x, y=None, sample_weight=None) -> PerExampleResult:
        """The traceable core: a :class:`PerExampleResult` for one batch.

        Call it inside your own ``tf.function`` (a custom training step) on TensorFlow, or on
        JAX inside your own ``jax.jit`` under a ``keras.StatelessScope`` that maps the model's
        variables to the values being traced; the public methods below are compiled wrappers
        around it.
        """
        result = run(self.strategy, self.model, self.plan, self._loss_fn, x, y, sample_weight,
                     self.training, self._warned)
        check_rows(result)
        return result

    # -- compiled public methods ----------------------------------------------------------------
    def compiled(self, name: str, body):
        """``body`` compiled and cached under ``name``, traced once per input signature and
        counted in ``trace_counts[name]``: a ``tf.function`` (``reduce_retracing=True``) on
        TensorFlow, a ``jax.jit`` over the model's variable values and the arguments on JAX,
        the body run eagerly (nothing traced, ``trace_counts`` stays 0) on PyTorch: the
        backend engine's ``compile_function``. For code that builds its own computations on
        :meth:`compute`, as ``pergrad.stats`` does."""
        if name not in self._compiled:
            def count():
                self.trace_counts[name] += 1
            self._compiled[name] = self._engine.compile_function(
                self.model, body, count, jit_compile=self.jit_compile)
        return self._compiled[name]

    def prepare(self, x, y=None, sample_weight=None) -> tuple:
        """Inputs as tensors (floating arrays in ``keras.config.floatx()``, as Keras's data
        adapters convert them), the model built if needed, the sample weights checked."""
        x, y, sample_weight = _to_tensors(x), _to_tensors(y), _to_tensors(sample_weight)
        if not self.model.built:
            self.model(_slice(x, 0, 1))
        batch = _batch_size(x)
        weights = None if sample_weight is None else sample_weight.shape[0]
        if None not in (batch, weights) and weights != batch:
            raise ValueError(f"sample_weight has {sample_weight.shape[0]} entries for a batch "
                             f"of {batch}.")
        return x, y, sample_weight

    def gradients(self, x, y=None, sample_weight=None) -> list:
        """``g_i`` per trainable variable, each ``(B, *var.shape)``, aligned with
        ``model.trainable_variables``."""
        x, y, sample_weight = self.prepare(x, y, sample_weight)
        fn = self.compiled("gradients",
                            lambda x, y, w: self.compute(x, y, w).gradients())
        batch = _batch_size(x)
        chunk = self._chunk_size(batch)
        if chunk >= batch:
            return fn(x, y, sample_weight)
        parts = [fn(_slice(x, s, s + chunk), _slice(y, s, s + chunk),
                    _slice(sample_weight, s, s + chunk)) for s in range(0, batch, chunk)]
        return [ops.concatenate(list(p), axis=0) for p in zip(*parts, strict=True)]

    def _chunk_size(self, batch: int) -> int:
        if self.memory_budget_bytes is None:
            return batch
        per_example = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize
                          for v in self.model.trainable_variables)
        return max(1, min(batch, self.memory_budget_bytes // max(per_example, 1)))

    def norms(self, x, y=None, sample_weight=None) -> Any:
        """``||g_i||``, the L2 norm of each example's whole gradient, ``(B,)``."""
        x, y, sample_weight = self.prepare(x, y, sample_weight)
        return self.compiled("norms", lambda x, y, w: self.compute(x, y, w).norms())(
            x, y, sample_weight)

    def losses(self, x, y=None, sample_weight=None) -> Any:
        """``l_i``, the per-example losses (sample weights applied), ``(B,)``."""
        x, y, sample_weight = self.prepare(x, y, sample_weight)

        def body(x, y, w):
            return weighted_losses(self._loss_fn(y, self.model(x, training=self.training)), w)

        return self.compiled("losses", body)(x, y, sample_weight)

    def dot(self, x, y, vectors: list, sample_weight=None) -> Any:
        """``<g_i, v>`` for ``vectors`` aligned with ``model.trainable_variables``, ``(B,)``."""
        x, y, sample_weight = self.prepare(x, y, sample_weight)
        vectors = [ops.convert_to_tensor(v) for v in vectors]
        return self.compiled("dot", lambda x, y, w, v: self.compute(x, y, w).dot(v))(
            x, y, sample_weight, vectors)

    def clipped_sum(self, x, y, l2_norm_clip: float, sample_weight=None) -> tuple[list, Any]:
        """``(sum_i c_i g_i per variable, ||g_i||)`` with ``c_i = min(1, C / ||g_i||)`` for
        ``C = l2_norm_clip`` (a positive finite Python or NumPy number).

        Examples whose norm or loss is not finite (a NaN input row, an overflow) are dropped as
        the aggregators of :mod:`pergrad.aggregate` drop them: ``c_i = 0`` and their gradient
        rows are zeroed before the sum (``0 * NaN`` would be NaN). The returned norms are left as
        they are, so the non-finite ones show which examples were dropped.
        """
        clip = positive_real(l2_norm_clip, "l2_norm_clip")
        x, y, sample_weight = self.prepare(x, y, sample_weight)

        def body(x, y, w, clip):
            return finite_clipped_sum(self.compute(x, y, w), clip)

        return self.compiled("clipped_sum", body)(x, y, sample_weight, _wide_scalar(clip))

    def example_mixing(self, x, y=None, sample_weight=None, num_examples: int = 4,
                       at_perturbed_weights: bool = True) -> Any:
        """How much the model or the loss mixes the examples of a batch: a float64 scalar, 0 for
        a model that treats examples independently (up to rounding, see
        :func:`pergrad.engine.mixing_tolerance`).

        ``max_k |l_k^B - l_k^1| / max(|l_k^B|, |l_k^1|, mean_j |l_j^B|)`` over the first
        ``min(num_examples, B)`` examples, where ``l_k^B`` is example ``k``'s loss computed in
        the batch and ``l_k^1`` computed alone, both with ``training=False`` (dropout cannot
        differ). The mean floor keeps a loss near zero from turning rounding into a large
        relative difference. Losses are compared unweighted, so that an example weighted 0
        cannot hide mixing; ``sample_weight`` is only checked for its length. Each difference
        is also measured at randomly perturbed trainable weights, and the larger counts: a
        mixing path behind a factor initialised at zero (a gate, LoRA's ``B``) shows before
        training opens it (:func:`pergrad.engine.checks.mixing_differences`);
        ``at_perturbed_weights=False`` measures the current weights alone.

        Traceable: inside a ``tf.function`` or a ``tf.cond`` branch it adds ``num_examples``
        forward passes of one example to the graph; called eagerly it is compiled and cached.
        """
        num_examples = positive_integer(num_examples, "num_examples")
        x, y, sample_weight = self.prepare(x, y, sample_weight)

        def body(x, y, w):
            del w  # losses are compared unweighted
            return ops.max(mixing_differences(self.model, self._loss_fn, x, y, num_examples,
                                              at_perturbed_weights))

        if _tracing(x):
            return body(x, y, sample_weight)
        key = f"example_mixing/{num_examples}" + ("" if at_perturbed_weights else "/current")
        return self.compiled(key, body)(x, y, sample_weight)

    def check(self, x, y=None, sample_weight=None, rtol: float | None = None,
              num_examples: int = 4) -> None:
        """Verify on one batch that the per-example gradients are what they claim to be.

        Two tests, with relative tolerances that follow :attr:`compute_dtype` unless ``rtol``
        is given (then it is used for both):

        1. **No example mixing** (:meth:`example_mixing` below :func:`mixing_tolerance`): a
           layer or a loss that mixes examples (a mean over the batch axis, BatchNormalization
           in training mode) makes per-example gradients, and DP guarantees, meaningless. Raises
           :class:`pergrad.MixesExamplesError` naming the example and the difference.
        2. **The sum is the batch gradient**: ``sum_i g_i`` must equal ``d/dtheta sum_i l_i``
           computed by an ordinary tape, within :func:`gradient_tolerance` of the largest
           batch-gradient entry. A mismatch means the model does something the engine cannot
           see: a layer's weight used outside that layer's call (tied input and output
           embeddings written as ``h @ embedding.embeddings.T``), or randomness that differs
           between two passes (call with ``training=False`` to check a model with dropout).
           Raises ``ValueError`` naming the variables.
        """
        rtol = None if rtol is None else positive_real(rtol, "rtol")
        num_examples = positive_integer(num_examples, "num_examples")
        x, y, sample_weight = self.prepare(x, y, sample_weight)

        def body(x, y, w):
            mixing = mixing_differences(self.model, self._loss_fn, x, y, num_examples)
            return (mixing, *self._summed_and_batch_gradients(x, y, w))

        mixing, summed, batch = self.compiled(f"check/{num_examples}", body)(
            x, y, sample_weight)
        dtype = self.compute_dtype
        _raise_if_mixing(np.asarray(mixing), mixing_tolerance(dtype) if rtol is None else rtol)
        _raise_if_not_summing(self.model.trainable_variables, summed, batch,
                              gradient_tolerance(dtype) if rtol is None else rtol)

    def _summed_and_batch_gradients(self, x, y, w) -> tuple[list, list]:
        """``sum_i g_i`` by the engine and ``d/dtheta sum_i l_i`` by an ordinary tape."""
        result = self.compute(x, y, w)
        summed = result.weighted_sum(ops.ones_like(result.losses))
        batch = self._engine.batch_gradient(self.model, self._loss_fn, x, y, w, self.training)
        return summed, batch


def _raise_if_mixing(differences: np.ndarray, rtol: float) -> None:
    worst = int(np.argmax(differences))
    if differences[worst] > rtol:
        raise mixing_error(worst, float(differences[worst]))


def _raise_if_not_summing(variables: list, summed: list, batch: list, rtol: float) -> None:
    """Errors relative to the largest batch-gradient entry of the model: some variables'
    gradients are exactly zero in exact arithmetic (attention's key bias) and only noise."""
    scale = max([float(np.max(np.abs(np.asarray(b)))) for b in batch if np.size(b)] + [1e-30])
    wrong = []
    for v, got, want in zip(variables, summed, batch, strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        error = float(np.max(np.abs(got - want), initial=0.0)) / scale
        if not error <= rtol:
            wrong.append(f"{v.path} (relative error {error:.2g})")
    if wrong:
        raise ValueError(
            "The per-example gradients do not add up to the batch gradient for "
            + ", ".join(wrong) + ". A weight is probably used outside its own layer's call "
            "(e.g. tied embeddings); move that use into a layer of its own, or use "
            "strategy='vmap', which differentiates the whole model per example.")


def _wide_scalar(value: float) -> Any:
    """``value`` as a float64 scalar tensor (float32 on JAX without ``jax_enable_x64``).

    On JAX a NumPy scalar: ``jax.jit`` moves it to the device in its C++ dispatch, where an eager
    ``jnp.asarray`` costs one op dispatch per call (a third of the Embedding bag model's whole
    batch gradient: docs/benchmarks.md, "DP noise, dispatch and compilation")."""
    return backend.native().wide_scalar(value)


def _tracing(x) -> bool:
    """Whether this runs inside a trace: a TensorFlow graph being built, or ``x`` a JAX tracer
    (a compiled train step calling the check on its batch)."""
    return backend.native().is_tracing(x)


def finite_clipped_sum(result: PerExampleResult, l2_norm_clip) -> tuple[list, Any]:
    """``(sum_{i kept} min(1, C / ||g_i||) g_i, ||g_i||)``, traceable.

    Example ``i`` is kept when its norm and its loss are finite; a dropped example gets
    coefficient 0 and its rows are zeroed (:meth:`PerExampleResult.masked`) before the sum,
    exactly as :func:`pergrad.aggregate.base.linear_local` does. The norms are returned as
    computed, non-finite ones included.
    """
    result = result.routed(NORMS_THEN_SUMS)
    norms = result.norms()
    keep = ops.logical_and(ops.isfinite(norms), ops.isfinite(result.losses))
    factors = ops.where(keep, clip_factors(norms, l2_norm_clip), ops.zeros_like(norms))
    return result.kept_weighted_sum(factors, keep), norms


def clip_factors(norms, l2_norm_clip):
    """``min(1, C / ||g_i||)``, with 1 for a zero gradient."""
    clip = ops.cast(l2_norm_clip, norms.dtype)
    return minimum(ops.ones_like(norms), clip / maximum(norms, 1e-30))
