"""Differential privacy for DP-SGD: accounting and Poisson sampling.

- :func:`epsilon` / :func:`epsilon_for_steps`: the ``(epsilon, delta)`` spent by DP-SGD, from
  ``dp_accounting``'s RDP or PLD accountant.
- :func:`dp_sgd_steps`: the one step count behind every epsilon, ``floor(E) * ceil(N / B) +
  ceil(frac(E) * N / B)`` for ``E`` epochs of ``N`` examples at expected batch size ``B``.
- :func:`noise_multiplier_for`: the noise multiplier that meets a target epsilon.
- :func:`max_steps_for`: the most steps a target epsilon allows.
- :func:`poisson_batches`: the Poisson-sampled, padded batches the accounting assumes.
"""

from pergrad.privacy.accounting import (
    dp_sgd_steps,
    epsilon,
    epsilon_for_steps,
    max_steps_for,
    noise_multiplier_for,
)
from pergrad.privacy.sampling import poisson_batches

__all__ = [
    "dp_sgd_steps",
    "epsilon",
    "epsilon_for_steps",
    "max_steps_for",
    "noise_multiplier_for",
    "poisson_batches",
]
