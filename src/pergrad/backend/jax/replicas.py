"""Replicas: none to combine with inside a step (``keras.distribution`` shards one global batch
on JAX, so a step's values are already global; PyTorch runs one process's batch)."""

from __future__ import annotations


def replicas() -> None:
    return None
