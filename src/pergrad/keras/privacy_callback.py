"""A Keras callback that reports the privacy spent so far and can enforce a privacy budget."""

from __future__ import annotations

import keras
import numpy as np

from pergrad.privacy.accounting import (
    Accountant,
    _as_int,
    _check_target,
    epsilon_for_steps,
    max_steps_for,
)


class PrivacyCallback(keras.callbacks.Callback):
    """Counts DP-SGD steps, reports ``logs["epsilon"]`` every epoch, optionally enforces a budget.

    The callback counts the training steps that actually ran: after each training batch it
    records Keras's 0-based step index within the epoch, so right after step ``i`` of an epoch
    ``steps`` is the steps of earlier epochs plus ``i + 1``, exact even when training stops in
    the middle of an epoch. The epsilon spent is

        epsilon = epsilon_for_steps(q = batch_size / num_examples, noise_multiplier, steps, delta)

    over all steps counted so far; it is written into ``logs["epsilon"]`` at the end of every
    epoch (so into ``history.history["epsilon"]`` and the progress bar). A run stopped early, a
    ``steps_per_epoch`` override or a second ``fit`` call on the same model are all charged for
    what really happened. Steps accumulate across ``fit`` calls made with the same callback
    instance (further training on the same data spends more privacy); use a new instance for a
    fresh model. After ``fit(poisson_batches(x, y, batch_size=B), epochs=E)`` the count is
    :func:`pergrad.privacy.dp_sgd_steps` ``(N, B, E) = E * ceil(N / B)`` and ``epsilon`` equals
    ``pergrad.privacy.epsilon(N, B, noise_multiplier, E, delta)`` exactly.

    **Budget.** With ``target_epsilon``, the callback computes once, at construction, the largest
    number of steps ``max_steps`` whose epsilon is at most ``target_epsilon``
    (:func:`pergrad.privacy.max_steps_for`), and never lets training go past it:

    - at the end of step number ``max_steps`` it sets ``model.stop_training = True``, so Keras
      finishes that epoch's bookkeeping and returns from ``fit``; it prints ``privacy budget
      reached: epsilon=... after N steps; training stopped`` (unless ``verbose=0``) and sets
      ``budget_exhausted``;
    - a ``fit`` started once the budget is spent raises ``RuntimeError`` at once, and so does a
      step about to start beyond the budget (if something cleared ``stop_training``): a Keras
      callback cannot skip a step, only abort before it runs.

    Keras reports one callback step per *execution*; with ``compile(steps_per_execution=k)``,
    ``k > 1``, a budget cannot be enforced step by step, so ``fit`` raises ``ValueError``. Without
    a budget such runs are counted per execution: a last, partial execution of an epoch is counted
    in full, so the count and epsilon can only err on the high (safe) side.

    The epsilon is a proof only if the batches were Poisson-sampled
    (:func:`pergrad.privacy.poisson_batches`) and the train step clips per-example gradients and
    adds noise with this ``noise_multiplier``; the callback cannot check either. With shuffled
    fixed-size batches it is the customary heuristic.

    Args:
      num_examples: size ``N`` of the training set.
      batch_size: expected batch size ``B``; the sampling probability is ``q = B / N``.
      noise_multiplier: ``sigma``, the noise standard deviation divided by the clip norm.
      delta: target ``delta`` in ``(0, 1)``.
      accountant: ``"rdp"`` or ``"pld"`` (see :func:`pergrad.privacy.epsilon`).
      target_epsilon: optional privacy budget; training stops when the next step would exceed it.
      verbose: ``0`` to stop without printing the budget line.

    Attributes:
      steps: training steps counted so far.
      epsilon: epsilon spent by those steps (``0.0`` before training).
      max_steps: the most steps ``target_epsilon`` allows (``None`` without a budget).
      budget_exhausted: ``True`` once ``max_steps`` steps have run.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        noise_multiplier: float,
        delta: float,
        accountant: Accountant = "rdp",
        *,
        target_epsilon: float | None = None,
        verbose: int = 1,
    ) -> None:
        super().__init__()
        # Validate everything up front, not after the first epoch has been trained.
        num_examples = _as_int(num_examples, "num_examples", 1)
        batch_size = _as_int(batch_size, "batch_size", 1)
        if batch_size > num_examples:
            raise ValueError(
                f"batch_size must be an integer in [1, num_examples={num_examples}]; "
                f"got {batch_size}."
            )
        epsilon_for_steps(batch_size / num_examples, noise_multiplier, 0, delta, accountant)
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.accountant = accountant
        self.verbose = verbose
        self.steps = 0
        self.budget_exhausted = False
        self.target_epsilon: float | None = None
        self.max_steps: int | None = None
        if target_epsilon is not None:
            self.target_epsilon = _check_target(target_epsilon)
            self.max_steps = max_steps_for(
                self.target_epsilon,
                self.sampling_probability,
                self.noise_multiplier,
                self.delta,
                accountant,
            )
        self._steps_before_epoch = 0
        self._accumulation = 1
        self._cached: tuple[int, float] = (0, 0.0)

    @property
    def sampling_probability(self) -> float:
        """``q = batch_size / num_examples``."""
        return self.batch_size / self.num_examples

    @property
    def epsilon(self) -> float:
        """``epsilon_for_steps(q, noise_multiplier, steps, delta)`` for the steps counted so far."""
        if self._cached[0] != self.steps:
            value = epsilon_for_steps(
                self.sampling_probability,
                self.noise_multiplier,
                self.steps,
                self.delta,
                self.accountant,
            )
            self._cached = (self.steps, value)
        return self._cached[1]

    def _spent_message(self) -> str:
        if self.max_steps == 0:
            one = epsilon_for_steps(
                self.sampling_probability, self.noise_multiplier, 1, self.delta, self.accountant
            )
            return (
                f"privacy budget too small: a single step spends epsilon={one:.6g} > "
                f"target_epsilon={self.target_epsilon:g}; no step can be taken."
            )
        return (
            f"privacy budget spent: epsilon={self.epsilon:.8g} after {self.steps} steps "
            f"(the most target_epsilon={self.target_epsilon:g} allows is {self.max_steps}); "
            "another step would exceed it. Training refused."
        )

    def on_train_begin(self, logs: dict | None = None) -> None:
        from pergrad.keras.logical_batches import accumulation_steps

        self._accumulation = accumulation_steps(getattr(self.model, "optimizer", None))
        self._sync_with_model()
        if self.max_steps is None:
            return
        steps_per_execution = getattr(self.model, "steps_per_execution", 1)
        if steps_per_execution != 1:
            raise ValueError(
                f"PrivacyCallback(target_epsilon=...) needs compile(steps_per_execution=1); got "
                f"{steps_per_execution!r}. Keras runs a whole execution before a callback can "
                "stop it, so the budget could be overrun."
            )
        if self.steps >= self.max_steps:
            self.budget_exhausted = True
            raise RuntimeError(self._spent_message())

    def _sync_with_model(self) -> None:
        """Charge the noisy steps the model already took before this callback saw it.

        A ``PerExampleModel`` with a DP aggregator counts its releases in its saved noise stream
        (``noise_state = [seed, counter]``), so a model resumed from a ``.keras`` file, or
        trained earlier with ``train_on_batch`` or without this callback, starts from that count
        instead of 0. The callback's ``noise_multiplier`` must also be the model's.
        """
        model = getattr(self, "model", None)
        state = getattr(model, "noise_state", None)
        aggregator = getattr(model, "aggregator", None)
        if state is None or aggregator is None:
            return
        sigma = aggregator.config.get("noise_multiplier")
        if sigma is not None and abs(float(sigma) - self.noise_multiplier) > 1e-12:
            raise ValueError(
                f"PrivacyCallback(noise_multiplier={self.noise_multiplier}) but the model's "
                f"aggregator adds noise with noise_multiplier={sigma}: the epsilon would be "
                "wrong. Pass the aggregator's noise_multiplier.")
        released = int(np.asarray(state.numpy())[1])
        self.steps = max(self.steps, released)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._steps_before_epoch = self.steps

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.max_steps is not None and self.steps >= self.max_steps:
            # Only reachable if something cleared ``stop_training`` after the budget was reached.
            self.model.stop_training = True
            raise RuntimeError(self._spent_message())

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # ``batch`` is the 0-based index of the last step run in this epoch; under logical
        # batches (gradient_accumulation_steps=k) a step is k of them, released on the k-th.
        self.steps = self._steps_before_epoch + (batch + 1) // self._accumulation
        if self.max_steps is not None and self.steps >= self.max_steps:
            self.model.stop_training = True
            if not self.budget_exhausted and self.verbose:
                print(
                    f"privacy budget reached: epsilon={self.epsilon:.8g} after {self.steps} "
                    f"steps (target_epsilon={self.target_epsilon:g}); training stopped",
                    flush=True,
                )
            self.budget_exhausted = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["epsilon"] = self.epsilon
