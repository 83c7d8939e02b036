"""Budget first: DP-SGD configured from the privacy target, as JAX Privacy's ``DPKerasConfig``.

Give the budget ``(target_epsilon, delta)``, the data size ``N``, the batch size ``B`` and the
epochs ``E``; :class:`DPConfig` calibrates the noise multiplier ``sigma`` (the smallest with
``epsilon(N, B, sigma, E, delta) <= target_epsilon``, :func:`pergrad.privacy.noise_multiplier_for`)
and :func:`make_private` wraps a model so that ``fit`` trains with ``dp_mean(C, sigma)``, takes
``batch_size`` and ``epochs`` from the configuration, refuses a different batch size (the
accounting would be wrong), and adds a :class:`~pergrad.keras.PrivacyCallback` that reports
epsilon each epoch and stops training at the budget::

    config = pergrad.keras.DPConfig(target_epsilon=3.0, delta=1e-5, num_examples=len(x),
                                    batch_size=256, epochs=10, l2_norm_clip=1.0)
    private = pergrad.keras.make_private(model, config)
    private.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    private.fit(x, y)                  # 10 epochs of 256, epsilon <= 3.0 at delta 1e-5
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pergrad import aggregate
from pergrad.privacy import epsilon as planned_epsilon
from pergrad.privacy import noise_multiplier_for


@dataclass(frozen=True)
class DPConfig:
    """A DP-SGD configuration from a privacy budget.

    Args:
        target_epsilon: the budget's epsilon, reached at the end of ``epochs``.
        delta: the budget's delta (usually below ``1 / num_examples``).
        num_examples: ``N``, the size of the training set.
        batch_size: ``B``, the (expected) batch size; the sampling rate is ``q = B / N``.
        epochs: ``E``, the planned epochs (fractions allowed); the step count is
            :func:`pergrad.privacy.dp_sgd_steps` ``(N, B, E)``.
        l2_norm_clip: ``C``, each example's gradient is clipped to this L2 norm.
        accountant: ``"rdp"`` or ``"pld"`` (:func:`pergrad.privacy.epsilon`).
        seed: the DP noise seed (``None``: one from the operating system, the safe default).
        poisson: whether batches come from :func:`pergrad.privacy.poisson_batches` (then the
            aggregator divides by the expected batch size ``B``, which must not leak the real
            one); ``False`` for Keras's shuffled fixed-size batches (the customary heuristic).

    Attributes:
        noise_multiplier: ``sigma``, calibrated at construction.
    """

    target_epsilon: float
    delta: float
    num_examples: int
    batch_size: int
    epochs: float
    l2_norm_clip: float = 1.0
    accountant: str = "rdp"
    seed: int | None = None
    poisson: bool = False
    noise_multiplier: float = field(init=False)

    def __post_init__(self) -> None:
        sigma = noise_multiplier_for(self.target_epsilon, self.num_examples, self.batch_size,
                                     self.epochs, self.delta, self.accountant)
        object.__setattr__(self, "noise_multiplier", sigma)
        self.aggregator()  # checks l2_norm_clip, sigma and seed now, not at the first step

    @property
    def epsilon(self) -> float:
        """The epsilon the planned training spends (at most ``target_epsilon``)."""
        return planned_epsilon(self.num_examples, self.batch_size, self.noise_multiplier,
                               self.epochs, self.delta, self.accountant)

    def aggregator(self) -> aggregate.Aggregator:
        """``dp_mean(C, sigma)`` (divided by ``B`` under Poisson sampling)."""
        return aggregate.dp_mean(self.l2_norm_clip, self.noise_multiplier, seed=self.seed,
                                 expected_batch_size=self.batch_size if self.poisson else None)

    def privacy_callback(self, verbose: int = 1):
        """A :class:`~pergrad.keras.PrivacyCallback` that reports epsilon each epoch and stops
        training when the next step would exceed ``target_epsilon``."""
        from pergrad.keras.privacy_callback import PrivacyCallback

        return PrivacyCallback(self.num_examples, self.batch_size, self.noise_multiplier,
                               self.delta, self.accountant, target_epsilon=self.target_epsilon,
                               verbose=verbose)

    def fit_arguments(self, kwargs: dict[str, Any], given_batches: bool,
                      accumulation_steps: int = 1) -> dict[str, Any]:
        """``fit``'s keyword arguments completed from the configuration: ``batch_size`` and
        ``epochs`` where absent (``batch_size`` only for arrays, ``given_batches`` false), and the
        privacy callback unless one is there. A different ``batch_size`` is refused; more
        ``epochs`` than planned are cut short by the callback at the budget.

        Under logical batches (an optimizer with ``gradient_accumulation_steps=k``,
        :mod:`pergrad.keras.logical_batches`) ``batch_size`` is the logical batch: ``fit`` runs
        micro-batches of ``batch_size / k``, which ``k`` must divide."""
        kwargs = dict(kwargs)
        if not given_batches:
            if self.batch_size % accumulation_steps:
                raise ValueError(
                    f"gradient_accumulation_steps={accumulation_steps} does not divide the "
                    f"DPConfig's logical batch_size={self.batch_size}.")
            micro = self.batch_size // accumulation_steps
            batch_size = kwargs.setdefault("batch_size", micro)
            if batch_size != micro:
                raise ValueError(
                    f"fit(batch_size={batch_size}) differs from the DPConfig's batch_size="
                    f"{self.batch_size}" + (f" in {accumulation_steps} micro-batches of {micro}"
                                            if accumulation_steps > 1 else "")
                    + f": the noise was calibrated for sampling rate "
                    f"{self.batch_size}/{self.num_examples}. Make a DPConfig with the batch size "
                    "you train with.")
        kwargs.setdefault("epochs", math.ceil(self.epochs))
        callbacks = list(kwargs.get("callbacks") or [])
        from pergrad.keras.privacy_callback import PrivacyCallback

        if not any(isinstance(c, PrivacyCallback) for c in callbacks):
            callbacks.append(self.privacy_callback())
        kwargs["callbacks"] = callbacks
        return kwargs


def make_private(model: Any, config: DPConfig, **options: Any):
    """``PerExampleModel(model, aggregator=config.aggregator(), **options)`` whose ``fit`` follows
    ``config`` (:meth:`DPConfig.fit_arguments`): the batch size and epochs it was calibrated
    for, and a privacy callback that stops at ``config.target_epsilon``."""
    from pergrad.keras.model import PerExampleModel

    if not isinstance(config, DPConfig):
        raise TypeError(f"config must be a pergrad.keras.DPConfig, got {type(config).__name__}.")
    private = PerExampleModel(model, aggregator=config.aggregator(), **options)
    private.dp_config = config
    return private
