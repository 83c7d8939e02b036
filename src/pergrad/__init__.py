"""pergrad: fast per-example gradients, custom aggregation and compiled Jacobians for Keras 3.

Public API (everything else is private):

* per-example gradients: :class:`PerExample`, :func:`per_example_gradients`,
  :func:`per_example_norms`, :func:`vmap_grad`, :class:`PerExampleResult`
* Keras training with custom aggregation: :mod:`pergrad.keras`, :mod:`pergrad.aggregate`
* privacy accounting: :mod:`pergrad.privacy`
* gradient analysis: :mod:`pergrad.stats`, :mod:`pergrad.plot`
* Jacobians: :func:`jacobian`, :func:`jacfwd`, :func:`jacrev`, :func:`jvp`, :func:`vjp`,
  :func:`hvp`, :func:`hessian` (the module is ``pergrad.jacobian``; import its other names with
  ``from pergrad.jacobian import ...``, since ``pergrad.jacobian`` the attribute is the function)
"""

from pergrad import aggregate, keras, plot, privacy, stats
from pergrad._functional import per_example_gradients, per_example_norms, vmap_grad
from pergrad.engine import PerExample, PerExampleResult
from pergrad.jacobian import hessian, hvp, jacfwd, jacobian, jacrev, jvp, vjp
from pergrad.rules.normalization import MixesExamplesError

__version__ = "0.1.0"

__all__ = [
    "MixesExamplesError",
    "PerExample",
    "PerExampleResult",
    "aggregate",
    "hessian",
    "hvp",
    "jacfwd",
    "jacobian",
    "jacrev",
    "jvp",
    "keras",
    "per_example_gradients",
    "per_example_norms",
    "plot",
    "privacy",
    "stats",
    "vjp",
    "vmap_grad",
]
