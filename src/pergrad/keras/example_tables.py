"""Running per-training-example tables, indexed by example index.

Two stores with one interface (``grow_to``, ``gather``, ``update``, ``numpy``): on TensorFlow
:class:`ExampleTables` keeps one growing ``tf.Variable`` per column and is updated inside the
compiled step; on JAX :class:`HostTables` keeps NumPy arrays on the host, updated from the
step's per-example values by a host callback (a compiled JAX function cannot grow an array).
Both add in float64 in the order of the steps, so the same steps give the same tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: ``name -> (dtype, how a step updates it)``: ``"add"`` sums the step's values into the entry,
#: ``"set"`` overwrites it with the step's value.
COLUMNS: dict[str, tuple[str, str]] = {
    "seen": ("int64", "add"),
    "opposed": ("int64", "add"),
    "cosine_sum": ("float64", "add"),
    "against": ("int64", "add"),
    "rest_cosine_sum": ("float64", "add"),
    "loss_sum": ("float64", "add"),
    "last_loss": ("float64", "set"),
    "norm_sum": ("float64", "add"),
    "self_influence": ("float64", "add"),
    "classified": ("int64", "add"),
    "error_norm_sum": ("float64", "add"),
    "margin_sum": ("float64", "add"),
    "forgotten": ("int64", "add"),
    "learned": ("int64", "set"),
    "last_correct": ("int64", "set"),
}


class ExampleTables:
    """One growing ``tf.Variable`` per column of :data:`COLUMNS`, entry ``k`` for example index
    ``k``, updated inside a ``tf.function``. Tables grow (with zeros) to the largest index seen,
    so the dataset size is optional."""

    def __init__(self, size: int = 0) -> None:
        import tensorflow as tf

        unknown = tf.TensorShape([None])
        self.variables = {
            name: tf.Variable(np.zeros(size, dtype), dtype=dtype, trainable=False, shape=unknown)
            for name, (dtype, _) in COLUMNS.items()}

    def gather(self, name: str, indices: Any) -> Any:
        """The entries of ``indices`` (call after :meth:`grow_to`; rows never seen are 0)."""
        import tensorflow as tf

        return tf.gather(self.variables[name], indices)

    def grow_to(self, indices: Any) -> Any:
        """Grow every table to hold ``indices``; returns a tensor to depend on."""
        import tensorflow as tf

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

    def update(self, indices: Any, values: dict[str, Any]) -> Any:
        """Add (or set) ``values[name]`` ``(n,)`` at ``indices`` ``(n,)`` int64, for the columns
        given; call after :meth:`grow_to`."""
        import tensorflow as tf

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


class HostTables:
    """The same tables as NumPy arrays on the host (the JAX monitor's store)."""

    def __init__(self, size: int = 0) -> None:
        self.arrays = {name: np.zeros(size, dtype) for name, (dtype, _) in COLUMNS.items()}

    def gather(self, name: str, indices: np.ndarray) -> np.ndarray:
        return self.arrays[name][indices]

    def grow_to(self, indices: np.ndarray) -> None:
        needed = int(indices.max()) + 1 if indices.size else 0
        size = len(self.arrays["seen"])
        if needed > size:
            self.arrays = {name: np.concatenate([a, np.zeros(needed - size, a.dtype)])
                           for name, a in self.arrays.items()}

    def update(self, indices: np.ndarray, values: dict[str, Any]) -> None:
        """As :meth:`ExampleTables.update`: repeated indices add up (``np.add.at``); a ``set``
        column keeps the last value given for an index."""
        for name, value in values.items():
            table = self.arrays[name]
            value = np.asarray(value).astype(table.dtype)
            if COLUMNS[name][1] == "add":
                np.add.at(table, indices, value)
            else:
                table[indices] = value

    def numpy(self) -> dict[str, np.ndarray]:
        return {name: a.copy() for name, a in self.arrays.items()}
