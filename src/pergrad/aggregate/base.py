"""The aggregator protocol: ``local`` on each replica, ``cross_replica``, then ``finalize``.

An aggregator turns the per-example gradients ``g_i`` of a batch into one update per variable.
Like an optax gradient transformation it is a small named tuple of pure functions:

* ``local(result, batch) -> Partial``: what one replica computes from its own examples. For a
  *linear* aggregator these are the per-variable sums ``s = sum_i c_i g_i`` (coefficients ``c_i``
  from the per-example norms), which add up across replicas. A *gathering* aggregator (median,
  trimmed mean, custom) keeps every ``g_i`` instead.
* :func:`cross_replica` ``(partial) -> Partial``: under ``tf.distribute`` sums the linear parts
  (``all_reduce``) or concatenates the per-example parts (``all_gather``) over replicas; the
  identity otherwise. Every replica then holds the same global ``Partial``.
* ``finalize(partial, key) -> grads``: the update, from the global partial. Noise is drawn
  here, from a stateless generator keyed by ``key``, an ``int64`` tensor ``[seed, counter]``
  taken from a stream that never repeats (:mod:`pergrad.aggregate.noise`); aggregators without
  noise ignore it (pass ``None``). Under ``tf.distribute`` every replica passes the same key and
  draws the *same* noise, so it enters the global update once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
from keras import ops

from pergrad import backend
from pergrad.aggregate.examples import Batch, finite_examples
from pergrad.aggregate.noise import NoiseSource
from pergrad.backend.ops import zero_rows
from pergrad.rules.query import NORMS_THEN_ROWS, NORMS_THEN_SUMS


class Partial(NamedTuple):
    """What ``local`` returns.

    Attributes:
        values: linear aggregators: one tensor per variable, shaped like it (a sum over
            examples). Gathering aggregators: one ``(B, *var.shape)`` tensor per variable.
        rows: number of rows in the batch (padding and dropped rows included), a float scalar.
        include: gathering aggregators only: ``(B,)`` float, 1 for the examples that count
            (finite and of nonzero weight), 0 for the rest; ``None`` for linear aggregators.
        dropped: number of examples dropped for a non-finite gradient or loss (float scalar).
        examples: gathering aggregators that ask for them (``custom`` with ``losses`` or
            ``predictions`` parameters): ``{"losses": (B,), "predictions": ...}``, rows of
            excluded examples zeroed, gathered across replicas like ``values``; else ``None``.
    """

    values: list
    rows: Any
    include: Any
    dropped: Any
    examples: dict | None = None


class Aggregator(NamedTuple):
    """A named pair of pure functions; build one with the factories in :mod:`pergrad.aggregate`.

    Attributes:
        name: registry name (``"clip_mean"``, ...), used by :func:`serialize`.
        config: the factory's keyword arguments; ``factory(**config)`` rebuilds the aggregator.
        local: ``(PerExampleResult, Batch) -> Partial`` on one replica.
        finalize: ``(Partial, key) -> list[tf.Tensor]``, the update aligned with the variables;
            ``key`` is the noise key (``None`` for aggregators without noise).
        gathers: ``True`` if ``local`` keeps per-example gradients (gathered across replicas)
            rather than sums (summed across replicas).
        clips: ``True`` if each example's influence on the update is bounded (clipping,
            normalization, DP): ``PerExampleModel`` then checks that examples do not mix.
        noise: the :class:`~pergrad.aggregate.noise.NoiseSource` of a noisy (DP) aggregator,
            ``None`` for the others.
    """

    name: str
    config: dict
    local: Callable[[Any, Batch], Partial]
    finalize: Callable[[Partial, Any], list]
    gathers: bool = False
    clips: bool = False
    noise: NoiseSource | None = None

    @property
    def noisy(self) -> bool:
        """Whether ``finalize`` adds random noise (and so needs a fresh key every release)."""
        return self.noise is not None

    def __call__(self, result, sample_weight=None, *, key=None) -> list:
        """The update for one batch on one device: ``finalize(local(result, batch), key)``.

        ``sample_weight`` is the batch's sample weight, if any (the gradients in ``result``
        already include it; order statistics use it to leave out zero-weight rows). A noisy
        aggregator called without ``key`` draws the next key of its own stream, so every call,
        eager or inside a ``tf.function``, gets fresh noise. On JAX, inside ``jax.jit``, pass
        ``key`` as an argument of the compiled function (see :class:`NoiseStream`).
        """
        if key is None and self.noisy:
            key = self.noise.direct_stream(self.name).next_key()
        return self.finalize(self.local(result, Batch.of(result, sample_weight)), key)

    def get_config(self) -> dict:
        return serialize(self)


_REGISTRY: dict[str, Callable[..., Aggregator]] = {}


def register(factory: Callable[..., Aggregator]) -> Callable[..., Aggregator]:
    """Make ``factory`` (e.g. ``clip_mean``) known to :func:`deserialize` under its name."""
    _REGISTRY[factory.__name__] = factory
    return factory


def serialize(aggregator: Aggregator) -> dict:
    """``{"name": ..., "config": {...}}``, JSON-friendly; :func:`deserialize` inverts it."""
    config = dict(aggregator.config)
    if aggregator.name == "custom":
        import keras
        config["fn"] = keras.saving.serialize_keras_object(config["fn"])
    return {"name": aggregator.name, "config": config}


def deserialize(config: dict | Aggregator) -> Aggregator:
    """Rebuild an aggregator from :func:`serialize`'s output (an aggregator passes through)."""
    if isinstance(config, Aggregator):
        return config
    name = config.get("name")
    if name not in _REGISTRY:
        raise ValueError(f"Unknown aggregator {name!r}; known: {sorted(_REGISTRY)}.")
    kwargs = dict(config.get("config", {}))
    if name == "custom":
        import keras
        kwargs["fn"] = keras.saving.deserialize_keras_object(kwargs["fn"])
    return _REGISTRY[name](**kwargs)


def cross_replica(partial: Partial, gathers: bool) -> Partial:
    """Combine the replicas' partials: sum linear values, concatenate per-example ones.

    Outside a ``tf.distribute`` replica context with more than one replica this is the
    identity (on JAX always: ``keras.distribution`` shards one global batch, so the partial is
    already global).
    """
    replicas = backend.native().replicas()
    if replicas is None:
        return partial
    rows, dropped = replicas.sum([partial.rows, partial.dropped])
    if not gathers:
        return Partial(replicas.sum(partial.values), rows, None, dropped)
    values = [replicas.gather(v) for v in partial.values]
    include = replicas.gather(partial.include)
    examples = None if partial.examples is None else keras.tree.map_structure(
        replicas.gather, partial.examples)
    return Partial(values, rows, include, dropped, examples)


# -- helpers shared by the aggregator modules ------------------------------------------------------

def linear_local(coefficients: Callable[[list, Batch], Any], needs_norms: bool):
    """``local`` for ``sum_i c_i g_i`` with ``c = coefficients(squared_norms, batch)``.

    ``squared_norms`` is the list of per-variable ``||g_i[var]||^2`` (``None`` when
    ``needs_norms`` is false). Non-finite examples are dropped (see
    :func:`pergrad.aggregate.examples.finite_examples`): their coefficient is 0 and their rows are
    zeroed before summing, so a NaN cannot leak through ``0 * NaN``.
    """

    def local(result, batch: Batch) -> Partial:
        rows = ops.cast(result.batch_size, result.norm_dtype)
        if needs_norms:
            result = result.routed(NORMS_THEN_SUMS)
            squared = result.squared_norms()
            return _linear_with_norms(result, batch, squared, rows)
        ones = ops.ones([result.batch_size], result.norm_dtype)
        sums = result.weighted_sum(coefficients(None, batch) * ones)
        finite = ops.all(ops.stack([ops.all(ops.isfinite(s)) for s in sums]))

        def fast():
            return [ops.copy(s) for s in sums], ops.zeros([], rows.dtype)

        def slow():  # rebuilt: only this branch, taken on a non-finite sum, needs norms
            inner = result.rebuilt().routed(NORMS_THEN_SUMS)
            squared = inner.squared_norms()
            partial = _linear_with_norms(inner, batch, squared, rows)
            return list(partial.values), partial.dropped

        values, dropped = ops.cond(finite, fast, slow)
        return Partial(list(values), rows, None, dropped)

    def _linear_with_norms(result, batch, squared, rows) -> Partial:
        keep = finite_examples(result, squared, batch)
        dropped = ops.sum(1.0 - ops.cast(keep, rows.dtype))
        zero = ops.zeros_like(squared[0])
        clean = [ops.where(keep, s, zero) for s in squared]
        c = coefficients(clean if needs_norms else None, batch)
        if isinstance(c, (list, tuple)):
            c = [ops.where(keep, ci, ops.zeros_like(ci)) for ci in c]
        else:
            c = ops.where(keep, c * ops.ones_like(zero), zero)

        return Partial(result.kept_weighted_sum(c, keep), rows, None, dropped)

    return local


def gathering_local(result, batch: Batch, with_examples: bool = False) -> Partial:
    """``local`` for order statistics: all ``g_i`` (zeroed where not included) and the mask;
    with ``with_examples`` also each example's loss and predictions (zeroed likewise)."""
    rows = ops.cast(result.batch_size, result.norm_dtype)
    if _static_value(result.batch_size) == 0:
        require_rows(rows, "gathering (median, trimmed_mean, custom)")
    result = result.routed(NORMS_THEN_ROWS)
    squared = result.squared_norms()
    keep = finite_examples(result, squared, batch)
    dropped = ops.sum(1.0 - ops.cast(keep, rows.dtype))
    include = ops.logical_and(keep, batch.nonzero_weight)

    def zero_excluded(t):
        return zero_rows(t, include)

    values = [zero_excluded(g) for g in result.gradients()]
    examples = None
    if with_examples:
        examples = {"losses": zero_excluded(result.losses),
                    "predictions": keras.tree.map_structure(zero_excluded, result.predictions)}
    return Partial(values, rows, ops.cast(include, rows.dtype), dropped, examples)


def _static_value(t) -> Any:
    """``t``'s value where it is known now (a Python number, a constant or eager tensor), else
    ``None``."""
    return t if isinstance(t, (int, float)) else backend.native().static_value(t)


def require_rows(rows, name: str):
    """``rows``, after checking the batch is not empty (a mean over no examples is undefined).

    A batch of statically known size 0 raises ``ValueError`` here; a dynamic one fails at run
    time with the same message.
    """
    message = (f"The {name} aggregator got an empty batch (0 examples); it has no value there. "
               "Skip empty batches, or for DP-SGD over Poisson batches pass "
               "expected_batch_size, which divides by the expected size instead.")
    static = _static_value(rows)
    if static is not None:
        if float(static) <= 0:
            raise ValueError(message)
        return rows
    return backend.native().assert_positive(rows, message)
