"""Privacy accounting for DP-SGD with Poisson sampling, built on ``dp_accounting``.

One DP-SGD step samples every example independently with probability ``q`` (Poisson sampling),
clips each sampled example's gradient to L2 norm ``C``, sums, and adds Gaussian noise
``N(0, sigma^2 C^2 I)``. That is the *sampled Gaussian mechanism* with noise multiplier
``sigma``; ``steps`` such steps compose. This module builds exactly that event,

    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)

and asks one of ``dp_accounting``'s accountants for the smallest ``epsilon`` such that training is
``(epsilon, delta)``-DP under the add-or-remove-one neighbouring relation. No accounting math is
written here.

The number of steps of ``E`` epochs over ``N`` examples with expected batch size ``B`` is defined
once, by :func:`dp_sgd_steps`::

    steps = floor(E) * ceil(N / B) + ceil(frac(E) * N / B)

which is what :func:`pergrad.privacy.poisson_batches` yields and what
:class:`pergrad.keras.PrivacyCallback` counts when Keras runs over those batches for ``E`` epochs.

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

import contextlib
import contextvars
import logging
import math
import numbers
from collections.abc import Callable, Iterator
from fractions import Fraction
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

# --------------------------------------------------------------------------- argument checks


def _check_number(value: object, name: str, kind: str) -> None:
    """Refuse anything but a real number: bools, strings, arrays, ``None`` raise ``TypeError``.

    Python and numpy scalars (``np.int64``, ``np.float32``, ...) are ``numbers.Real``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {kind}; got {value!r} of type {type(value).__name__}.")


def _as_int(value: object, name: str, minimum: int) -> int:
    """``value`` as a Python ``int >= minimum``; integral floats such as ``1797.0`` are accepted."""
    _check_number(value, name, "an integer")
    if not (math.isfinite(value) and int(value) == value and value >= minimum):
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {kind}; got {value!r}.")
    return int(value)


def _as_float(value: object, name: str) -> float:
    """``value`` (a Python or numpy real number, not a bool) as a Python ``float``."""
    _check_number(value, name, "a real number")
    return float(value)


def _as_epochs(epochs: object, name: str = "epochs") -> Fraction:
    """``epochs`` as an exact fraction, read as the decimal number it prints as.

    ``0.1`` means exactly ``1/10`` (not the binary float just above it), so ``0.1`` epochs of
    ``30`` examples at batch size ``1`` are ``3`` steps, not ``4``.
    """
    _check_number(epochs, name, "a real number")
    if not (math.isfinite(epochs) and epochs > 0):
        raise ValueError(f"{name} must be a positive finite number; got {epochs!r}.")
    if isinstance(epochs, numbers.Rational):
        return Fraction(int(epochs.numerator), int(epochs.denominator))
    return Fraction(repr(float(epochs)))


def _check_delta(delta: object) -> float:
    delta = _as_float(delta, "delta")
    if not 0.0 < delta < 1.0:
        raise ValueError(
            f"delta must be in (0, 1); got {delta}. A common choice is delta < 1/num_examples."
        )
    return delta


def _check_sigma(noise_multiplier: object) -> float:
    sigma = _as_float(noise_multiplier, "noise_multiplier")
    if not (sigma >= 0.0 and math.isfinite(sigma)):
        raise ValueError(f"noise_multiplier must be a finite number >= 0; got {noise_multiplier}.")
    return sigma


def _check_q(sampling_probability: object) -> float:
    q = _as_float(sampling_probability, "sampling_probability")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_probability must be in (0, 1]; got {sampling_probability}.")
    return q


def _check_target(target_epsilon: object) -> float:
    target = _as_float(target_epsilon, "target_epsilon")
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"target_epsilon must be positive and finite; got {target_epsilon}.")
    return target


def _check_sizes(num_examples: object, batch_size: object) -> tuple[int, int]:
    """Validated ``(N, B)`` with ``1 <= B <= N``, so that ``q = B / N`` is in ``(0, 1]``."""
    n = _as_int(num_examples, "num_examples", 1)
    b = _as_int(batch_size, "batch_size", 1)
    if b > n:
        raise ValueError(
            f"batch_size ({b}) must not exceed num_examples ({n}): the sampling probability "
            "batch_size / num_examples must be at most 1."
        )
    return n, b


def _make_accountant_factory(accountant: object) -> Callable[[], dp_accounting.PrivacyAccountant]:
    try:
        return _ACCOUNTANTS[accountant]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(
            f"accountant must be one of {sorted(_ACCOUNTANTS)}; got {accountant!r}."
        ) from None


# --------------------------------------------------------------------------- quiet accountant

# ``dp_accounting``'s RDP accountant computes the RDP of the sampled Gaussian at every order
# ``alpha`` of its grid. For a fractional ``alpha`` it sums a series; when that series has not
# converged after 1000 terms (small ``alpha`` with a large ``q``, e.g. ``q = 0.5``,
# ``sigma = 1.1``, ``alpha = 1.1 ... 1.8``) it logs ``_compute_log_a_frac failed to converge ...
# Excluding this order`` through absl and sets that order's RDP to ``inf``. Epsilon is a minimum
# over orders of a bound that holds at *each* order, so dropping some orders can only make it
# larger: the result stays a valid upper bound. In practice it does not change at all, because
# such small orders pay ``log(1 / delta) / (alpha - 1) > 100`` in the conversion and are never
# the minimizer (for the example above the optimal order is 4.5 with or without them). So the
# warning tells users nothing actionable; pergrad drops exactly that message, and only while one
# of its own accountant calls runs in the current thread or task.
_NOT_CONVERGED = "_compute_log_a_frac failed to converge"
_quiet = contextvars.ContextVar("pergrad_quiet_accountant", default=False)


class _SkippedOrderFilter(logging.Filter):
    """Drops the absl warning about an RDP order that failed to converge, inside pergrad's calls."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            _quiet.get()
            and record.levelno == logging.WARNING
            and isinstance(record.msg, str)
            and record.msg.startswith(_NOT_CONVERGED)
        )


_SKIPPED_ORDER_FILTER = _SkippedOrderFilter()


@contextlib.contextmanager
def _quiet_accountant() -> Iterator[None]:
    """Silence ``_compute_log_a_frac failed to converge`` for the duration of the block.

    The filter sits on the ``absl`` logger (where ``absl.logging`` records go) and is inert
    outside these blocks; every other message, from absl or elsewhere, passes through.
    """
    logging.getLogger("absl").addFilter(_SKIPPED_ORDER_FILTER)  # idempotent
    token = _quiet.set(True)
    try:
        yield
    finally:
        _quiet.reset(token)


def _accountant_epsilon(
    factory: Callable[[], dp_accounting.PrivacyAccountant],
    event: dp_accounting.DpEvent,
    delta: float,
) -> float:
    """Epsilon of ``event`` at ``delta`` from a fresh accountant made by ``factory``."""
    with _quiet_accountant():
        return float(factory().compose(event).get_epsilon(delta))


# --------------------------------------------------------------------------- steps and epsilon


def dp_sgd_steps(num_examples: int, batch_size: int, epochs: float) -> int:
    """Number of DP-SGD steps in ``epochs`` epochs of ``N = num_examples`` examples, batch ``B``.

        steps = floor(E) * ceil(N / B) + ceil(frac(E) * N / B)

    Every whole epoch is ``ceil(N / B)`` steps, exactly the batches
    :func:`pergrad.privacy.poisson_batches` yields per pass (and Keras runs per epoch over a
    dataset of ``N`` examples batched by ``B``); a fractional last epoch is ``ceil(frac(E) * N /
    B)`` more. This is the one step count behind :func:`epsilon`, :func:`noise_multiplier_for`,
    ``poisson_batches(epochs=E)`` and :class:`pergrad.keras.PrivacyCallback`, so all of them agree
    for any ``N``, ``B`` and ``E``. When ``B`` divides ``N`` it equals TensorFlow Privacy's
    ``ceil(E * N / B)``; otherwise it is slightly larger (``N = 1797``, ``B = 64``, ``E = 5``:
    ``5 * 29 = 145`` steps, TensorFlow Privacy counts 141).

    ``epochs`` is read as the decimal number it prints as (``0.1`` is exactly one tenth).

    Raises:
      TypeError: for an argument that is not a number (bools included).
      ValueError: unless ``1 <= B <= N`` are integers and ``E`` is positive and finite.
    """
    n, b = _check_sizes(num_examples, batch_size)
    whole, part = divmod(_as_epochs(epochs), 1)
    return int(whole) * math.ceil(Fraction(n, b)) + math.ceil(part * n / b)


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
    (add-or-remove-one neighbours). Use it when you count the steps yourself.

    Args:
      sampling_probability: ``q`` in ``(0, 1]``; ``batch_size / num_examples`` for DP-SGD.
      noise_multiplier: ``sigma >= 0``, the noise standard deviation divided by the clip norm.
        ``0`` means no noise: the result is ``inf`` (for ``steps > 0``).
      steps: number of noisy steps (``>= 0``); ``0`` steps spend nothing and give ``0.0``.
      delta: target ``delta`` in ``(0, 1)``.
      accountant: ``"rdp"`` (Renyi DP) or ``"pld"`` (privacy loss distributions, tighter and
        slower).

    Python and numpy numbers are accepted; bools and non-numbers raise ``TypeError``.

    Returns:
      ``epsilon`` as a Python float (``math.inf`` when no finite bound exists).
    """
    factory = _make_accountant_factory(accountant)
    delta = _check_delta(delta)
    q = _check_q(sampling_probability)
    sigma = _check_sigma(noise_multiplier)
    steps = _as_int(steps, "steps", 0)
    if steps == 0:
        return 0.0
    if sigma == 0.0:
        return math.inf
    return _accountant_epsilon(factory, _dp_sgd_event(q, sigma, steps), delta)


def epsilon(
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    epochs: float,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """Epsilon spent by DP-SGD after ``epochs`` epochs of Poisson-sampled batches.

    With ``q = B / N`` and ``steps = dp_sgd_steps(N, B, E) = floor(E) * ceil(N / B) +
    ceil(frac(E) * N / B)``, this is ``epsilon_for_steps(q, noise_multiplier, steps, delta,
    accountant)``: the composition of ``steps`` sampled Gaussian mechanisms with noise multiplier
    ``sigma``. It is the epsilon :class:`pergrad.keras.PrivacyCallback` reports after ``fit`` over
    :func:`pergrad.privacy.poisson_batches` for ``E`` epochs.

    For example ``epsilon(60000, 150, 1.3, 15, 1e-5)`` is ``0.7242`` with RDP (``q = 0.0025``,
    ``15 * 400 = 6000`` steps), as TensorFlow Privacy's ``compute_dp_sgd_privacy`` reports; and
    ``epsilon(1797, 64, 1.1, 5, 1e-5)`` counts ``5 * ceil(1797 / 64) = 145`` steps.

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

    Python and numpy numbers are accepted; bools and non-numbers raise ``TypeError``.
    """
    steps = dp_sgd_steps(num_examples, batch_size, epochs)
    n, b = _check_sizes(num_examples, batch_size)
    return epsilon_for_steps(b / n, noise_multiplier, steps, delta, accountant)


# Upper end of the search in :func:`max_steps_for`: a budget that allows this many steps is, for
# any training run, unlimited.
MAX_STEPS_SEARCHED = 10**12


def max_steps_for(
    target_epsilon: float,
    sampling_probability: float,
    noise_multiplier: float,
    delta: float,
    accountant: Accountant = "rdp",
) -> int:
    """Largest number of steps ``T`` with ``epsilon_for_steps(q, sigma, T, delta) <= target``.

    Epsilon is non-decreasing in the number of steps (composition only adds privacy loss), so
    this doubles ``T`` until the accountant's epsilon exceeds ``target_epsilon`` and then bisects
    over the integers. Both ends are checked with the accountant itself: the result ``T``
    satisfies ``epsilon(T) <= target_epsilon < epsilon(T + 1)``. It is ``0`` when a single step
    already exceeds the target (for example ``sigma = 0``), and it is capped at
    ``MAX_STEPS_SEARCHED = 10**12``. About ``2 log2(T)`` accountant calls: milliseconds each with
    RDP, up to seconds each with PLD.

    Args:
      target_epsilon: the privacy budget, a positive finite number.
      sampling_probability, noise_multiplier, delta, accountant: as in
        :func:`epsilon_for_steps`.
    """
    target = _check_target(target_epsilon)
    q, sigma = _check_q(sampling_probability), _check_sigma(noise_multiplier)
    delta = _check_delta(delta)
    _make_accountant_factory(accountant)

    def fits(steps: int) -> bool:
        return epsilon_for_steps(q, sigma, steps, delta, accountant) <= target

    if not fits(1):
        return 0
    lo, hi = 1, 2  # invariant: fits(lo) and, once the loop ends, not fits(hi)
    while fits(hi):
        if hi == MAX_STEPS_SEARCHED:
            return hi
        lo, hi = hi, min(2 * hi, MAX_STEPS_SEARCHED)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


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
    target_epsilon`` for ``sigma``, with ``q = B / N`` and the step count of :func:`epsilon`,
    ``steps = dp_sgd_steps(N, B, E) = floor(E) * ceil(N / B) + ceil(frac(E) * N / B)``. It uses
    ``dp_accounting.calibrate_dp_mechanism`` (Brent's method on an explicit bracket, then a check
    that the returned ``sigma`` does not overspend), so the result always satisfies
    ``epsilon(..., sigma) <= target_epsilon``.

    This is the budget-first route: pick ``(target_epsilon, delta)``, calibrate ``sigma`` here,
    train with it, and let :class:`pergrad.keras.PrivacyCallback` (with ``target_epsilon``) stop
    training should it run more steps than planned.

    Args:
      target_epsilon: the privacy budget, a positive finite number.
      num_examples, batch_size, epochs, delta, accountant: as in :func:`epsilon`.
      tol: tolerance on ``sigma``.

    Raises:
      TypeError: for an argument that is not a number (bools included).
      ValueError: on invalid arguments, or when the target is out of reach (met even with almost
        no noise, ``sigma < 0.01``).
    """
    factory = _make_accountant_factory(accountant)
    delta = _check_delta(delta)
    steps = dp_sgd_steps(num_examples, batch_size, epochs)
    n, b = _check_sizes(num_examples, batch_size)
    target = _check_target(target_epsilon)
    tol = _as_float(tol, "tol")
    if not tol > 0:
        raise ValueError(f"tol must be positive; got {tol}.")
    q = b / n

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return _dp_sgd_event(q, sigma, steps)

    def gap(sigma: float) -> float:
        return _accountant_epsilon(factory, make_event(sigma), delta) - target

    if accountant == "rdp":
        guess, factor = 1.0, 2.0
    else:
        # The PLD accountant is slow at small sigma, so start the bracket search next to the
        # answer: RDP's sigma, which is close and (RDP being looser) usually a little larger.
        guess = noise_multiplier_for(target, n, b, epochs, delta)
        factor = 1.1
    lo, hi = _find_bracket(gap, guess, factor)
    with _quiet_accountant():
        return float(
            dp_accounting.calibrate_dp_mechanism(
                factory,
                make_event,
                target,
                delta,
                bracket_interval=mechanism_calibration.ExplicitBracketInterval(lo, hi),
                tol=tol,
            )
        )
