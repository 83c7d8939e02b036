"""pergrad: fast per-example gradients, custom aggregation and compiled Jacobians for Keras 3."""

from pergrad._functional import per_example_gradients, per_example_norms, vmap_grad
from pergrad.engine import PerExample, PerExampleResult
from pergrad.rules.normalization import MixesExamplesError

__version__ = "0.1.0"

__all__ = [
    "MixesExamplesError",
    "PerExample",
    "PerExampleResult",
    "per_example_gradients",
    "per_example_norms",
    "vmap_grad",
]
