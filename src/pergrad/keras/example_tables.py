"""Running per-training-example tables, indexed by example index and updated inside the step."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

#: ``name -> (dtype, how a step updates it)``: ``"add"`` sums the step's values into the entry,
#: ``"set"`` overwrites it with the step's value.
COLUMNS: dict[str, tuple[tf.DType, str]] = {
    "seen": (tf.int64, "add"),
    "opposed": (tf.int64, "add"),
    "cosine_sum": (tf.float64, "add"),
    "against": (tf.int64, "add"),
    "rest_cosine_sum": (tf.float64, "add"),
    "loss_sum": (tf.float64, "add"),
    "last_loss": (tf.float64, "set"),
    "norm_sum": (tf.float64, "add"),
    "self_influence": (tf.float64, "add"),
    "classified": (tf.int64, "add"),
    "error_norm_sum": (tf.float64, "add"),
    "margin_sum": (tf.float64, "add"),
    "forgotten": (tf.int64, "add"),
    "learned": (tf.int64, "set"),
    "last_correct": (tf.int64, "set"),
}


class ExampleTables:
    """One growing ``tf.Variable`` per column of :data:`COLUMNS`, entry ``k`` for example index
    ``k``. Tables grow (with zeros) to the largest index seen, so the dataset size is optional."""

    def __init__(self, size: int = 0) -> None:
        unknown = tf.TensorShape([None])
        self.variables = {
            name: tf.Variable(np.zeros(size, dtype.as_numpy_dtype), dtype=dtype, trainable=False,
                              shape=unknown)
            for name, (dtype, _) in COLUMNS.items()}

    def gather(self, name: str, indices: tf.Tensor) -> tf.Tensor:
        """The entries of ``indices`` (call after :meth:`grow_to`; rows never seen are 0)."""
        return tf.gather(self.variables[name], indices)

    def grow_to(self, indices: tf.Tensor) -> tf.Tensor:
        """Grow every table to hold ``indices``; returns a tensor to depend on."""
        seen = self.variables["seen"]
        needed = tf.reduce_max(tf.concat([indices + 1, tf.zeros([1], tf.int64)], 0))

        def grow():
            extra = needed - tf.size(seen, out_type=tf.int64)
            ops = [t.assign(tf.concat([t, tf.zeros([extra], t.dtype)], 0))
                   for t in self.variables.values()]
            with tf.control_dependencies(ops):
                return tf.constant(True)

        return tf.cond(needed > tf.size(seen, out_type=tf.int64), grow,
                       lambda: tf.constant(False))

    def update(self, indices: tf.Tensor, values: dict[str, tf.Tensor]) -> tf.Operation:
        """Add (or set) ``values[name]`` ``(n,)`` at ``indices`` ``(n,)`` int64, for the columns
        given; call after :meth:`grow_to`."""
        where = indices[:, None]
        ops = []
        for name, value in values.items():
            table = self.variables[name]
            value = tf.cast(value, table.dtype)
            if COLUMNS[name][1] == "add":
                ops.append(table.scatter_nd_add(where, value))
            else:
                ops.append(table.scatter_nd_update(where, value))
        return tf.group(ops)

    def numpy(self) -> dict[str, np.ndarray]:
        return {name: v.numpy() for name, v in self.variables.items()}
