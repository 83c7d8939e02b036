"""The per-example gradient engine: plan the taps, record, one backward pass, rules."""

from pergrad.engine.per_example import PerExample, clip_factors
from pergrad.engine.result import PerExampleResult

__all__ = ["PerExample", "PerExampleResult", "clip_factors"]
