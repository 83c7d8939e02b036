"""Differential privacy for DP-SGD: accounting and Poisson sampling.

- :func:`epsilon` / :func:`epsilon_for_steps`: the ``(epsilon, delta)`` spent by DP-SGD, from
  ``dp_accounting``'s RDP or PLD accountant.
- :func:`noise_multiplier_for`: the noise multiplier that meets a target epsilon.
- :func:`poisson_batches`: the Poisson-sampled, padded batches the accounting assumes.
"""

from pergrad.privacy.accounting import epsilon, epsilon_for_steps, noise_multiplier_for
from pergrad.privacy.sampling import poisson_batches

__all__ = ["epsilon", "epsilon_for_steps", "noise_multiplier_for", "poisson_batches"]
