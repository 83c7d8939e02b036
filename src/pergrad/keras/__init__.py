"""Keras integration: ``PerExampleModel`` (custom aggregation and DP-SGD in ``fit``), callbacks,
``DPConfig``/``make_private`` (DP-SGD from a privacy budget), ``replace_batch_normalization``
(a DP-ready copy of a model with BatchNormalization)."""

from pergrad.keras.batch_norm import replace_batch_normalization
from pergrad.keras.checkpoints import TracInCheckpoints
from pergrad.keras.distributed import fit_distributed, multi_worker_strategy
from pergrad.keras.dp_config import DPConfig, make_private
from pergrad.keras.faults import DistributedBackup, WorkerFailureError
from pergrad.keras.model import INDEX_KEY, PerExampleModel
from pergrad.keras.monitor import GradientMonitor
from pergrad.keras.privacy_callback import PrivacyCallback

__all__ = ["INDEX_KEY", "DPConfig", "DistributedBackup", "GradientMonitor", "PerExampleModel",
           "PrivacyCallback", "TracInCheckpoints", "WorkerFailureError", "fit_distributed",
           "make_private", "multi_worker_strategy", "replace_batch_normalization"]
