"""``statistics_from_result`` (traceable) and its compiled wrappers ``gradient_statistics``, ``gram``."""

from __future__ import annotations

from typing import Any

from keras import ops

from pergrad.backend import ENGINE_SUPPORTED, require_supported
from pergrad.backend.ops import add_n, divide_no_nan, maximum
from pergrad.engine import PerExample, PerExampleResult
from pergrad.rules.query import NORMS_THEN_ROWS
from pergrad.stats.formulas import batch_statistics, consensus_statistics, cosine


def active_examples(sample_weight: Any, batch: Any) -> Any:
    """``(B,)`` booleans: the examples with a non-zero sample weight (all when ``None``).

    A ``(B, k)`` weight counts an example as active if any of its entries is non-zero.
    """
    if sample_weight is None:
        return ops.ones([batch], "bool")
    w = ops.convert_to_tensor(sample_weight)
    w = ops.reshape(w, [batch, -1])
    return ops.any(ops.not_equal(w, ops.zeros([], w.dtype)), axis=1)


def layer_of(variable: Any) -> str:
    """The owning layer of a variable: its ``path`` without the last component
    (``"dense_1/kernel"`` -> ``"dense_1"``)."""
    path = getattr(variable, "path", None) or variable.name.split(":")[0]
    return path.rsplit("/", 1)[0] if "/" in path else path


def _per_layer(result: PerExampleResult, squared_norms: list, dots: list,
               mean_sq: list) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[int]] = {}
    for k, v in enumerate(result.variables):
        groups.setdefault(layer_of(v), []).append(k)
    out = {}
    for name, ks in groups.items():
        norms = ops.sqrt(add_n([squared_norms[k] for k in ks]))
        batch_norm = ops.sqrt(add_n([mean_sq[k] for k in ks]))
        layer_dots = add_n([dots[k] for k in ks])
        out[name] = {
            "norms": norms,
            "dot_to_batch": layer_dots,
            "cosine_to_batch": cosine(layer_dots, norms, batch_norm),
            "batch_gradient_norm": batch_norm,
        }
    return out


def statistics_from_result(result: PerExampleResult, sample_weight: Any = None,
                           per_layer: bool = False) -> dict[str, Any]:
    """Per-example and batch gradient statistics from one :class:`PerExampleResult` (traceable).

    Computes ``G = (1/n) sum_{i active} g_i`` with ``result.weighted_sum``, then ``||g_i||^2``
    (``result.squared_norms``) and ``d_i = <g_i, G>`` (``result.dots``): no per-example gradient
    is materialized for a layer with a rule. Per example (``(B,)``):

    * ``losses``: ``l_i`` (sample weight applied);
    * ``norms``: ``||g_i||``;
    * ``dot_to_batch``: ``<g_i, G>``;
    * ``cosine_to_batch``: ``<g_i, G> / (||g_i|| ||G||)`` (0 where a norm is 0);
    * ``cosine_to_rest``: the cosine of ``g_i`` with the rest of the batch's consensus direction
      ``sum_{j != i} g_j / ||g_j||`` (:func:`pergrad.stats.formulas.consensus_statistics`), with
      the scalar ``fraction_against_rest``;

    and the scalars of :func:`pergrad.stats.formulas.batch_statistics` (``batch_gradient_norm``,
    ``gradient_variance``, ``noise_scale``, ``snr``, ``norm_test``, ``inner_product_test``,
    ``orthogonality_test``, ``gradient_diversity``, ``fraction_opposed``).

    Sample weights: ``g_i`` is the gradient of the weighted loss ``w_i l_i``. Examples with
    ``w_i = 0`` (padding) are excluded: ``n`` counts the non-zero weights only, and they enter no
    sum (their norms and cosines are reported as 0).

    With ``per_layer=True`` the result also has ``"per_layer"``: for each layer (variables grouped
    by ``variable.path`` prefix) a dict with that layer's ``norms``, ``dot_to_batch``,
    ``cosine_to_batch`` (against the layer's block ``G[l]`` of the mean gradient) and
    ``batch_gradient_norm`` ``||G[l]||``.
    """
    dtype = result.norm_dtype
    active = active_examples(sample_weight, result.batch_size)
    mask = ops.cast(active, dtype)
    coefficients = mask / maximum(ops.sum(mask), 1)
    # Declared first: a form whose norms build the per-example matrices sums and dots from them.
    result = result.routed(NORMS_THEN_ROWS)
    squared_norms_per_var = result.squared_norms()
    squared_norms = add_n(squared_norms_per_var) * mask
    norms = ops.sqrt(squared_norms)
    # The mean gradient G and the consensus of the batch, one vote per example,
    # U = sum_i g_i / ||g_i||: two weighted sums, then two dot products with every example,
    # each pair in one pass over the per-example data.
    mean_gradient, unit_sum = result.weighted_sums(
        [coefficients, mask * divide_no_nan(ops.ones_like(norms), norms)])
    mean_sq = [ops.sum(ops.square(ops.cast(g, dtype))) for g in mean_gradient]
    batch_sq_norm = add_n(mean_sq)
    dots_per_var, unit_dots_per_var = result.dots_many([mean_gradient, unit_sum])
    dots = add_n(dots_per_var) * mask
    unit_sq_norm = add_n([ops.sum(ops.square(ops.cast(u, dtype))) for u in unit_sum])
    unit_dots = add_n(unit_dots_per_var) * mask
    stats: dict[str, Any] = {
        "losses": result.losses,
        "norms": norms,
        "dot_to_batch": dots,
        "cosine_to_batch": cosine(dots, norms, ops.sqrt(batch_sq_norm)),
    }
    stats.update(batch_statistics(squared_norms, dots, batch_sq_norm, active))
    stats.update(consensus_statistics(unit_dots, norms, unit_sq_norm, active))
    if per_layer:
        stats["per_layer"] = _per_layer(result, squared_norms_per_var, dots_per_var, mean_sq)
    return stats


def gradient_statistics(pex: PerExample, x: Any, y: Any = None, sample_weight: Any = None,
                        per_layer: bool = False) -> dict[str, Any]:
    """:func:`statistics_from_result` of one batch, compiled once per input signature.

    One forward and one backward pass (``pex.compute``); the compiled function is cached on
    ``pex`` (``pex.trace_counts["statistics"]`` counts its traces).

    Example::

        stats = gradient_statistics(pex, x, y)
        stats["cosine_to_batch"]   # (B,)
        stats["noise_scale"]       # scalar
    """
    require_supported("pergrad.stats.gradient_statistics", ENGINE_SUPPORTED)
    x, y, sample_weight = pex.prepare(x, y, sample_weight)
    name = "statistics_per_layer" if per_layer else "statistics"

    def body(x, y, w):
        return statistics_from_result(pex.compute(x, y, w), w, per_layer=per_layer)

    return pex.compiled(name, body)(x, y, sample_weight)


def gram(pex: PerExample, x: Any, y: Any = None, sample_weight: Any = None) -> Any:
    """``K[i, j] = <g_i, g_j>``, ``(B, B)``, compiled; uses each form's Gram (the ghost trick
    ``sum_{t,s} (a_it . a_js)(d_it . d_js)`` for Dense/Conv kernels when cheaper than
    materializing)."""
    require_supported("pergrad.stats.gram", ENGINE_SUPPORTED)
    x, y, sample_weight = pex.prepare(x, y, sample_weight)
    return pex.compiled("gram", lambda x, y, w: pex.compute(x, y, w).gram())(x, y, sample_weight)
