"""Keras integration: ``PerExampleModel`` (custom aggregation and DP-SGD in ``fit``), callbacks."""

from pergrad.keras.model import INDEX_KEY, PerExampleModel

__all__ = ["INDEX_KEY", "PerExampleModel"]

# These two modules are written in parallel with this one; the imports become unconditional once
# both have landed.
try:
    from pergrad.keras.privacy_callback import PrivacyCallback  # noqa: F401
except ImportError:  # pragma: no cover - module not written yet
    pass
else:
    __all__.append("PrivacyCallback")

try:
    from pergrad.keras.monitor import GradientMonitor  # noqa: F401
except ImportError:  # pragma: no cover - module not written yet
    pass
else:
    __all__.append("GradientMonitor")
