"""How a batch's per-example gradients are computed: ``auto`` (layer rules, one backward pass)
and the whole-model baselines ``loop``, ``jacobian`` and ``vmap``, each defined once per backend
(``engine`` of each backend package: :func:`pergrad.backend.part`), all returning a
:class:`PerExampleResult`."""

from __future__ import annotations

from pergrad import backend
from pergrad.engine.losses import weighted_losses
from pergrad.engine.plan import Plan
from pergrad.engine.result import PerExampleResult

STRATEGIES = ("auto", "vmap", "jacobian", "loop")


def engine_module():
    """The running backend's engine module."""
    backend.require_supported("pergrad's engine", backend.ENGINE_SUPPORTED)
    return backend.part("engine")


def run(strategy: str, model, plan: Plan, loss_fn, x, y, sample_weight, training: bool,
        warned: set) -> PerExampleResult:
    engine = engine_module()
    if strategy == "auto":
        return engine.run_auto(model, plan, loss_fn, x, y, sample_weight, training, warned)
    return engine.RUNNERS[strategy](model, loss_fn, x, y, sample_weight, training)


__all__ = ["STRATEGIES", "engine_module", "run", "weighted_losses"]
