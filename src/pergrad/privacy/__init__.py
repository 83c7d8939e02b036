"""Differential privacy for DP-SGD: accounting and Poisson sampling.

- :func:`epsilon` / :func:`epsilon_for_steps`: the ``(epsilon, delta)`` spent by DP-SGD, from
  ``dp_accounting``'s RDP or PLD accountant.
- :func:`dp_sgd_steps`: the one step count behind every epsilon, ``floor(E) * ceil(N / B) +
  ceil(frac(E) * N / B)`` for ``E`` epochs of ``N`` examples at expected batch size ``B``.
- :func:`noise_multiplier_for`: the noise multiplier that meets a target epsilon.
- :func:`max_steps_for`: the most steps a target epsilon allows.
- :func:`poisson_batches`: the Poisson-sampled, padded batches the accounting assumes.

The accounting needs only ``dp_accounting``; :mod:`pergrad.privacy.sampling` (``tf.data``, via
:mod:`pergrad.backend`, which imports Keras) is imported on first use of its names, so pure
accounting (``pergrad privacy`` on the command line) never loads Keras or a backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pergrad._lazy_exports import lazy_exports
from pergrad.privacy.accounting import (
    dp_sgd_steps,
    epsilon,
    epsilon_for_steps,
    max_steps_for,
    noise_multiplier_for,
)

# name -> (module, attribute; None for the module itself), imported on first use: these need
# Keras and TensorFlow.
_LAZY: dict[str, tuple[str, str | None]] = {
    "poisson_batches": ("pergrad.privacy.sampling", "poisson_batches"),
    "sampling": ("pergrad.privacy.sampling", None),
}

__all__ = [
    "dp_sgd_steps",
    "epsilon",
    "epsilon_for_steps",
    "max_steps_for",
    "noise_multiplier_for",
    "poisson_batches",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from pergrad.privacy import sampling  # noqa: F401
    from pergrad.privacy.sampling import poisson_batches  # noqa: F401
