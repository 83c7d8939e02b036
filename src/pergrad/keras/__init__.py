"""Keras integration: ``PerExampleModel`` (custom aggregation and DP-SGD in ``fit``), callbacks."""

from pergrad.keras.checkpoints import TracInCheckpoints
from pergrad.keras.distributed import fit_distributed, multi_worker_strategy
from pergrad.keras.faults import DistributedBackup, WorkerFailureError
from pergrad.keras.model import INDEX_KEY, PerExampleModel
from pergrad.keras.monitor import GradientMonitor
from pergrad.keras.privacy_callback import PrivacyCallback

__all__ = ["INDEX_KEY", "DistributedBackup", "GradientMonitor", "PerExampleModel", "PrivacyCallback",
           "TracInCheckpoints", "WorkerFailureError", "fit_distributed", "multi_worker_strategy"]
