"""Combining values across ``tf.distribute`` replicas inside a replica function."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Replicas:
    """The replicas of the running ``tf.distribute`` replica context."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def sum(self, values: list) -> list:
        """Each of ``values`` summed over the replicas."""
        return list(self._context.all_reduce(tf.distribute.ReduceOp.SUM, list(values)))

    def gather(self, t: Any) -> Any:
        """``t`` of every replica concatenated along the first axis (``all_gather`` forgets
        static shapes; the non-batch dimensions are known)."""
        return tf.reshape(self._context.all_gather(t, axis=0), [-1, *t.shape[1:]])


def replicas() -> Replicas | None:
    """The replicas to combine with, or ``None`` outside a replica context with more than one
    replica."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return Replicas(context)
