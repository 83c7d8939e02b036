"""Gradient statistics of one batch from three ingredients: ``||g_i||^2``, ``<g_i, G>``, ``||G||^2``.

Notation. ``g_i`` is example ``i``'s gradient (sample weight applied), ``A`` the *active* examples
(those with a non-zero sample weight; all of them without weights), ``n = |A|`` and

    G = (1/n) sum_{i in A} g_i                 (the mean, or batch, gradient)
    d_i = <g_i, G>,      mean_{i in A} d_i = ||G||^2.

Every statistic below is a function of ``||g_i||^2``, ``d_i`` and ``||G||^2`` alone, which the
engine computes without forming any ``g_i`` for layers with a rule. Examples outside ``A``
(padding, zero weight) are left out of every sum and every count. With fewer than two active
examples the variance-based statistics are NaN.
"""

from __future__ import annotations

from typing import Any

from keras import ops

from pergrad.backend.ops import divide_no_nan, maximum

#: Keys of the batch-level (scalar) statistics, in a fixed order.
BATCH_STATISTICS = (
    "batch_gradient_norm",
    "gradient_variance",
    "noise_scale",
    "snr",
    "norm_test",
    "inner_product_test",
    "orthogonality_test",
    "gradient_diversity",
    "fraction_opposed",
)

#: Keys of the per-example ``(B,)`` statistics.
PER_EXAMPLE_STATISTICS = ("losses", "norms", "cosine_to_batch", "dot_to_batch", "cosine_to_rest")

#: Scalar statistics against the consensus of the rest of the batch (see
#: :func:`consensus_statistics`).
CONSENSUS_STATISTICS = ("fraction_against_rest",)


def cosine(dots: Any, norms: Any, batch_norm: Any) -> Any:
    """``cos_i = <g_i, G> / (||g_i|| ||G||)``, 0 where either norm is 0."""
    return divide_no_nan(dots, norms * batch_norm)


def batch_statistics(squared_norms: Any, dots: Any, batch_sq_norm: Any,
                     active: Any) -> dict[str, Any]:
    """The batch-level statistics (all scalars), with ``n`` active examples and ``G`` their mean.

    * ``batch_gradient_norm = ||G||``.
    * ``gradient_variance = tr(Sigma) = 1/(n-1) sum_i ||g_i - G||^2
      = (sum_i ||g_i||^2 - n ||G||^2) / (n-1)``: the trace of the unbiased per-example gradient
      covariance.
    * ``noise_scale = B_simple = tr(Sigma) / ||G||^2``: the simple gradient noise scale of
      McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"), an estimate of the
      critical batch size.
    * ``snr = ||G||^2 / (tr(Sigma) / n) = n / B_simple``: squared norm of the mean gradient over
      the variance of its estimate (signal-to-noise of the batch gradient; > 1 means the batch
      gradient is mostly signal).
    * ``norm_test = tr(Sigma) / (n ||G||^2)``: Byrd et al. 2012 ("Sample size selection in
      optimization methods for machine learning"); the batch is large enough for a descent
      direction when ``norm_test <= theta^2``.
    * ``inner_product_test = Var_i(<g_i, G>) / (n ||G||^4)``, with
      ``Var_i(<g_i, G>) = 1/(n-1) sum_i (<g_i, G> - ||G||^2)^2``: Bollapragada et al. 2018
      ("Adaptive sampling strategies for stochastic optimization"), compared with ``theta^2``.
    * ``orthogonality_test = 1/(n-1) sum_i ||g_i - (<g_i, G>/||G||^2) G||^2 / (n ||G||^2)``,
      where ``||g_i - (d_i/||G||^2) G||^2 = ||g_i||^2 - d_i^2 / ||G||^2``: the same paper,
      compared with ``nu^2``.
    * ``gradient_diversity = sum_i ||g_i||^2 / ||sum_i g_i||^2 = sum_i ||g_i||^2 / (n^2 ||G||^2)``:
      Yin et al. 2018 ("Gradient diversity: a key ingredient for scalable distributed learning").
    * ``fraction_opposed = #{i : <g_i, G> < 0} / n``: the share of examples whose gradient points
      against the batch gradient (negative cosine).

    Args:
        squared_norms: ``||g_i||^2``, ``(B,)``.
        dots: ``<g_i, G>``, ``(B,)``.
        batch_sq_norm: ``||G||^2``, a scalar.
        active: ``(B,)`` booleans, the examples that count.
    """
    squared_norms, dots, batch_sq_norm, active = (
        ops.convert_to_tensor(t) for t in (squared_norms, dots, batch_sq_norm, active))
    dtype = squared_norms.dtype
    mask = ops.cast(active, dtype)
    n = ops.sum(mask)
    nan = ops.cast(float("nan"), dtype)
    unbiased = ops.where(n > 1, 1.0 / maximum(n - 1, 1), nan)
    sum_sq = ops.sum(mask * squared_norms)
    variance = maximum(sum_sq - n * batch_sq_norm, 0) * unbiased
    noise_scale = variance / batch_sq_norm
    dot_var = ops.sum(mask * ops.square(dots - batch_sq_norm)) * unbiased
    orthogonal_sq = maximum(squared_norms - ops.square(dots) / batch_sq_norm, 0)
    orthogonal = ops.sum(mask * orthogonal_sq) * unbiased
    opposed = ops.sum(mask * ops.cast(dots < 0, dtype))
    return {
        "batch_gradient_norm": ops.sqrt(batch_sq_norm),
        "gradient_variance": variance,
        "noise_scale": noise_scale,
        "snr": n / noise_scale,
        "norm_test": noise_scale / n,
        "inner_product_test": dot_var / (n * ops.square(batch_sq_norm)),
        "orthogonality_test": orthogonal / (n * batch_sq_norm),
        "gradient_diversity": sum_sq / (n * n * batch_sq_norm),
        "fraction_opposed": opposed / n,
    }


def consensus_statistics(unit_dots: Any, norms: Any, unit_sq_norm: Any,
                         active: Any) -> dict[str, Any]:
    """Each example against the *consensus of the rest* of its batch, one vote per example.

    With ``u_j = g_j / ||g_j||`` and ``U = sum_{j in A} u_j``, the rest's consensus direction for
    example ``i`` is ``U_{-i} = U - u_i`` and

        cosine_to_rest_i = <g_i, U_{-i}> / (||g_i|| ||U_{-i}||)
                         = (<u_i, U> - 1) / sqrt(||U||^2 - 2 <u_i, U> + 1),

    from ``<g_i, U>`` (``unit_dots``), ``||g_i||`` and ``||U||^2`` alone.
    ``fraction_against_rest = #{i in A : cosine_to_rest_i < 0} / n``.

    Why not only ``cosine_to_batch``: the mean gradient ``G`` is dominated by the examples with the
    largest gradients, typically the mislabeled ones, so those *agree* with ``G`` while the clean
    majority looks opposed. Normalizing first gives every example one vote; on the digits demo
    with 10% flipped labels, ranking by mean ``cosine_to_rest`` found the flipped examples with a
    ROC AUC of 0.99, ranking by how often ``cosine_to_batch < 0`` with 0.2-0.35 (worse than chance).
    """
    unit_dots, norms, unit_sq_norm, active = (
        ops.convert_to_tensor(t) for t in (unit_dots, norms, unit_sq_norm, active))
    dtype = norms.dtype
    mask = ops.cast(active, dtype) * ops.cast(norms > 0, dtype)
    unit_self = divide_no_nan(unit_dots, norms)  # <u_i, U>
    rest_sq = maximum(unit_sq_norm - 2.0 * unit_self + 1.0, 0.0)
    cos = divide_no_nan(unit_self - 1.0, ops.sqrt(rest_sq)) * mask
    n = ops.sum(ops.cast(active, dtype))
    against = ops.sum(mask * ops.cast(cos < 0, dtype))
    return {"cosine_to_rest": cos, "fraction_against_rest": against / n}
