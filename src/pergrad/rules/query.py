"""What a caller will ask of one per-example result, declared before it asks anything
(:meth:`pergrad.engine.result.PerExampleResult.routed`).

A form can compute ``||g_i||^2`` by several routes of the same math; the cheapest depends on
what reads the result next. A stride-1 convolution's shifted ghost norms cost ``T_in^2 C``
instead of the per-example products' ``T K C O`` (:func:`pergrad.rules.cost.shifted_ghost_wins`),
but a weighted sum ``sum_i c_i g_i`` after them must be recomputed, while after the products it
reads them. So the caller declares what follows, and each form chooses (with the cost model and
the backend's :class:`pergrad.backend.routes.Routes`) the route that serves the whole query:

* :data:`NORMS_ALONE`: nothing of the same result follows (``PerExample.norms``, the monitor's
  norms);
* :data:`NORMS_THEN_SUMS`: weighted sums follow and nothing else (clipping, DP noise, the
  linear aggregators);
* :data:`NORMS_THEN_ROWS`: weighted sums and reads of each example's gradient follow (dot
  products, Gram matrices, the gradients themselves: the gradient statistics, the order
  statistics' gathering).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Query:
    """What follows the per-example norms of one result.

    Attributes:
        sums: weighted sums ``sum_i c_i g_i`` of the same result follow.
        rows: each example's gradient is read again: dot products ``<g_i, v>``, Gram
            matrices ``<g_i, g_j>`` or the per-example gradients themselves.
    """

    sums: bool = False
    rows: bool = False

    @property
    def alone(self) -> bool:
        """Whether the norms are all that is asked."""
        return not (self.sums or self.rows)


NORMS_ALONE = Query()
NORMS_THEN_SUMS = Query(sums=True)
NORMS_THEN_ROWS = Query(sums=True, rows=True)

__all__ = ["NORMS_ALONE", "NORMS_THEN_ROWS", "NORMS_THEN_SUMS", "Query"]
