"""The per-example gradient engine: plan the taps, record, one backward pass, rules."""

from pergrad.engine.checks import compute_dtype, gradient_tolerance, mixing_error, mixing_tolerance
from pergrad.engine.per_example import PerExample, clip_factors, finite_clipped_sum
from pergrad.engine.result import PerExampleResult
from pergrad.rules.normalization import MixesExamplesError

__all__ = ["MixesExamplesError", "PerExample", "PerExampleResult", "clip_factors",
           "compute_dtype", "finite_clipped_sum", "gradient_tolerance", "mixing_error",
           "mixing_tolerance"]
