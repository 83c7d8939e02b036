"""Privacy accounting for DP-SGD with Poisson sampling, built on ``dp_accounting``.

One DP-SGD step samples every example independently with probability ``q`` (Poisson sampling),
clips each sampled example's gradient to L2 norm ``C``, sums, and adds Gaussian noise
``N(0, sigma^2 C^2 I)``. That is the *sampled Gaussian mechanism* with noise multiplier
``sigma``; ``steps`` such steps compose. This module builds exactly that event,

    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)

and asks one of ``dp_accounting``'s accountants for the smallest ``epsilon`` such that training is
``(epsilon, delta)``-DP under the add-or-remove-one neighbouring relation. No accounting math is
written here.

Accountants:

- ``"rdp"``: Renyi DP (Mironov 2017; Mironov, Talwar, Zhang 2019), ``dp_accounting.rdp``'s
  ``RdpAccountant`` with its default orders and its RDP-to-(epsilon, delta) conversion. Fast and
  the number most papers and TensorFlow Privacy report.
- ``"pld"``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022),
  ``dp_accounting.pld``'s ``PLDAccountant`` at its default discretization of ``1e-4``. A
  numerically tight upper bound, usually smaller than RDP's for realistic settings, and slower
  (seconds for very small ``sigma``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import dp_accounting
from dp_accounting import mechanism_calibration
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

Accountant = Literal["rdp", "pld"]

_ACCOUNTANTS: dict[str, Callable[[], dp_accounting.PrivacyAccountant]] = {
    "rdp": RdpAccountant,
    "pld": PLDAccountant,
}


def _make_accountant_factory(accountant: str) -> Callable[[], dp_accounting.PrivacyAccountant]:
    try:
        return _ACCOUNTANTS[accountant]
    except KeyError:
        raise ValueError(
            f"accountant must be one of {sorted(_ACCOUNTANTS)}; got {accountant!r}."
        ) from None


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(
            f"delta must be in (0, 1); got {delta}. A common choice is delta < 1/num_examples."
        )


def _check_sizes(num_examples: int, batch_size: int, epochs: float) -> None:
    if int(num_examples) != num_examples or num_examples <= 0:
        raise ValueError(f"num_examples must be a positive integer; got {num_examples}.")
    if int(batch_size) != batch_size or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size}.")
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size ({batch_size}) must not exceed num_examples ({num_examples}): the "
            "sampling probability batch_size / num_examples must be at most 1."
        )
    if not (epochs > 0 and math.isfinite(epochs)):
        raise ValueError(f"epochs must be a positive finite number; got {epochs}.")


def dp_sgd_steps(num_examples: int, batch_size: int, epochs: float) -> int:
    """Number of DP-SGD steps in ``epochs`` epochs: ``ceil(epochs * num_examples / batch_size)``.

    This is TensorFlow Privacy's ``compute_dp_sgd_privacy`` convention, and it matches
    :func:`pergrad.privacy.poisson_batches`, which yields ``ceil(num_examples / batch_size)``
    batches per epoch when ``epochs`` is a whole number.
    """
    _check_sizes(num_examples, batch_size, epochs)
    return int(math.ceil(epochs * num_examples / batch_size))


def _dp_sgd_event(
    sampling_probability: float, noise_multiplier: float, steps: int
) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier)
        ),
        steps,
    )


def epsilon_for_steps(
    sampling_probability: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """Epsilon of ``steps`` Poisson-sampled Gaussian mechanisms at the given ``delta``.

    Each step includes every example independently with probability ``q =
    sampling_probability``, sums the sampled examples' gradients clipped to norm ``C`` and adds
    ``N(0, (noise_multiplier * C)^2 I)``. The function returns the smallest ``epsilon`` the chosen
    ``dp_accounting`` accountant certifies for the composition of ``steps`` such steps
    (add-or-remove-one neighbours).

    Args:
      sampling_probability: ``q`` in ``(0, 1]``; ``batch_size / num_examples`` for DP-SGD.
      noise_multiplier: ``sigma >= 0``, the noise standard deviation divided by the clip norm.
        ``0`` means no noise: the result is ``inf`` (for ``steps > 0``).
      steps: number of noisy steps (``>= 0``); ``0`` steps spend nothing and give ``0.0``.
      delta: target ``delta`` in ``(0, 1)``.
      accountant: ``"rdp"`` (Renyi DP) or ``"pld"`` (privacy loss distributions, tighter and
        slower).

    Returns:
      ``epsilon`` as a Python float (``math.inf`` when no finite bound exists).
    """
    factory = _make_accountant_factory(accountant)
    _check_delta(delta)
    if not 0.0 < sampling_probability <= 1.0:
        raise ValueError(f"sampling_probability must be in (0, 1]; got {sampling_probability}.")
    if not noise_multiplier >= 0.0:
        raise ValueError(f"noise_multiplier must be >= 0; got {noise_multiplier}.")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer; got {steps}.")
    if steps == 0:
        return 0.0
    if noise_multiplier == 0.0:
        return math.inf
    event = _dp_sgd_event(float(sampling_probability), float(noise_multiplier), int(steps))
    return float(factory().compose(event).get_epsilon(delta))


def epsilon(
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    epochs: float,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """Epsilon spent by DP-SGD after ``epochs`` epochs of Poisson-sampled batches.

    With ``q = batch_size / num_examples`` and ``steps = ceil(epochs * num_examples /
    batch_size)`` (TensorFlow Privacy's convention), this is
    ``epsilon_for_steps(q, noise_multiplier, steps, delta, accountant)``: the composition of
    ``steps`` sampled Gaussian mechanisms with noise multiplier ``sigma``.

    For example ``epsilon(60000, 150, 1.3, 15, 1e-5)`` is ``0.7242`` with RDP (``q = 0.0025``,
    ``6000`` steps), as TensorFlow Privacy's ``compute_dp_sgd_privacy`` reports.

    The guarantee assumes each step's batch was Poisson-sampled (see
    :func:`pergrad.privacy.poisson_batches`). For fixed-size shuffled batches the number is the
    customary heuristic, not a proof.

    Args:
      num_examples: size ``N`` of the training set.
      batch_size: expected batch size ``B`` (``q = B / N``), at most ``N``.
      noise_multiplier: ``sigma >= 0``; ``0`` gives ``inf``.
      epochs: number of passes over the data, may be fractional.
      delta: target ``delta`` in ``(0, 1)``, conventionally below ``1 / N``.
      accountant: ``"rdp"`` or ``"pld"``.
    """
    steps = dp_sgd_steps(num_examples, batch_size, epochs)
    return epsilon_for_steps(batch_size / num_examples, noise_multiplier, steps, delta, accountant)


# Smallest noise multiplier the calibration bracket may reach; below it epsilons are astronomical
# (RDP gives ~1e6 at sigma 0.05 for MNIST-sized runs) and the PLD accountant becomes very slow.
_MIN_SIGMA = 1e-2
_MAX_SIGMA = 1e6


def _find_bracket(
    gap: Callable[[float], float], guess: float, factor: float
) -> tuple[float, float]:
    """Return ``(lo, hi)`` with ``gap(lo) > 0 >= gap(hi)`` by geometric steps from ``guess``.

    ``gap(sigma) = epsilon(sigma) - target`` is non-increasing in ``sigma``.
    """
    sigma = guess
    if gap(sigma) > 0:  # too little noise: walk up.
        while True:
            lo, sigma = sigma, sigma * factor
            if sigma > _MAX_SIGMA:
                raise ValueError(
                    f"Could not reach the target epsilon with noise_multiplier up to {_MAX_SIGMA:g}."
                )
            if gap(sigma) <= 0:
                return lo, sigma
    while True:  # enough noise: walk down until there is too little.
        hi, sigma = sigma, sigma / factor
        if sigma < _MIN_SIGMA:
            raise ValueError(
                f"The target epsilon is met even with noise_multiplier {_MIN_SIGMA:g}; it is too "
                "large to calibrate a meaningful noise multiplier."
            )
        if gap(sigma) > 0:
            return sigma, hi


def noise_multiplier_for(
    target_epsilon: float,
    num_examples: int,
    batch_size: int,
    epochs: float,
    delta: float,
    accountant: Accountant = "rdp",
    *,
    tol: float = 1e-6,
) -> float:
    """Smallest noise multiplier ``sigma`` (within ``tol``) with ``epsilon(...) <= target_epsilon``.

    Solves ``epsilon(num_examples, batch_size, sigma, epochs, delta, accountant) =
    target_epsilon`` for ``sigma`` with ``dp_accounting.calibrate_dp_mechanism`` (Brent's method
    on an explicit bracket, then a check that the returned ``sigma`` does not overspend). The
    result therefore always satisfies ``epsilon(..., sigma) <= target_epsilon``.

    Args:
      target_epsilon: the privacy budget, a positive finite number.
      num_examples, batch_size, epochs, delta, accountant: as in :func:`epsilon`.
      tol: tolerance on ``sigma``.

    Raises:
      ValueError: on invalid arguments, or when the target is out of reach (met even with almost
        no noise, ``sigma < 0.01``).
    """
    factory = _make_accountant_factory(accountant)
    _check_delta(delta)
    steps = dp_sgd_steps(num_examples, batch_size, epochs)
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be positive and finite; got {target_epsilon}.")
    if not tol > 0:
        raise ValueError(f"tol must be positive; got {tol}.")
    q = batch_size / num_examples

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return _dp_sgd_event(q, sigma, steps)

    def gap(sigma: float) -> float:
        return factory().compose(make_event(sigma)).get_epsilon(delta) - target_epsilon

    if accountant == "rdp":
        guess, factor = 1.0, 2.0
    else:
        # The PLD accountant is slow at small sigma, so start the bracket search next to the
        # answer: RDP's sigma, which is close and (RDP being looser) usually a little larger.
        guess = noise_multiplier_for(target_epsilon, num_examples, batch_size, epochs, delta)
        factor = 1.1
    lo, hi = _find_bracket(gap, guess, factor)
    return float(
        dp_accounting.calibrate_dp_mechanism(
            factory,
            make_event,
            target_epsilon,
            delta,
            bracket_interval=mechanism_calibration.ExplicitBracketInterval(lo, hi),
            tol=tol,
        )
    )
