"""pergrad: fast per-example gradients, custom aggregation and compiled Jacobians for Keras 3.

Public API (everything else is private):

* per-example gradients: :class:`PerExample`, :func:`per_example_gradients`,
  :func:`per_example_norms`, :func:`vmap_grad`, :class:`PerExampleResult`,
  :class:`MixesExamplesError`
* Keras training with custom aggregation: :mod:`pergrad.keras`, :mod:`pergrad.aggregate`
* privacy accounting: :mod:`pergrad.privacy`
* gradient analysis: :mod:`pergrad.stats`, :mod:`pergrad.plot`; data debugging (label-error
  scores, TracIn influence) on your own model and data: :mod:`pergrad.analysis`
* Jacobians: :func:`jacobian` (``pergrad.jacobian`` is both the module and the function),
  :func:`jacfwd`, :func:`jacrev`, :func:`jvp`, :func:`vjp`, :func:`hvp`, :func:`hessian`

Names are imported on first use, so ``import pergrad`` (and ``pergrad --help``) does not load
TensorFlow until something needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pergrad._lazy_exports import lazy_exports

__version__ = "0.1.0"

# name -> (module, attribute); attribute None means the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "MixesExamplesError": ("pergrad.rules.normalization", "MixesExamplesError"),
    "PerExample": ("pergrad.engine", "PerExample"),
    "PerExampleResult": ("pergrad.engine", "PerExampleResult"),
    "aggregate": ("pergrad.aggregate", None),
    "analysis": ("pergrad.analysis", None),
    "hessian": ("pergrad.jacobian", "hessian"),
    "hvp": ("pergrad.jacobian", "hvp"),
    "jacfwd": ("pergrad.jacobian", "jacfwd"),
    "jacobian": ("pergrad.jacobian", None),
    "jacrev": ("pergrad.jacobian", "jacrev"),
    "jvp": ("pergrad.jacobian", "jvp"),
    "keras": ("pergrad.keras", None),
    "per_example_gradients": ("pergrad._functional", "per_example_gradients"),
    "per_example_norms": ("pergrad._functional", "per_example_norms"),
    "plot": ("pergrad.plot", None),
    "privacy": ("pergrad.privacy", None),
    "stats": ("pergrad.stats", None),
    "vjp": ("pergrad.jacobian", "vjp"),
    "vmap_grad": ("pergrad._functional", "vmap_grad"),
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from pergrad import aggregate, analysis, jacobian, keras, plot, privacy, stats  # noqa: F401
    from pergrad._functional import per_example_gradients, per_example_norms, vmap_grad  # noqa: F401
    from pergrad.engine import PerExample, PerExampleResult  # noqa: F401
    from pergrad.jacobian import hessian, hvp, jacfwd, jacrev, jvp, vjp  # noqa: F401
    from pergrad.rules.normalization import MixesExamplesError  # noqa: F401
