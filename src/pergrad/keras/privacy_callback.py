"""A Keras callback that reports the privacy spent so far as ``logs["epsilon"]``."""

from __future__ import annotations

import keras

from pergrad.privacy.accounting import Accountant, epsilon_for_steps


class PrivacyCallback(keras.callbacks.Callback):
    """Writes the DP-SGD epsilon spent so far into ``logs["epsilon"]`` after every epoch.

    The callback counts the training steps that actually ran: after each training batch it
    records Keras's 0-based step index, so an epoch that ended after step ``i`` counts ``i + 1``
    steps, and at the end of every epoch it evaluates

        epsilon = epsilon_for_steps(q = batch_size / num_examples, noise_multiplier, steps, delta)

    over all steps seen so far. So a run stopped early, a ``steps_per_epoch`` override or a
    second ``fit`` call on the same model are all charged for what really happened. Steps
    accumulate across ``fit`` calls made with the same callback instance (further training on the
    same data spends more privacy); use a new instance for a fresh model. With
    ``compile(steps_per_execution=k)``, ``k > 1``, Keras reports the step index of a whole
    execution, so a last, partial execution of an epoch is counted in full: the count, and the
    epsilon, can only err on the high (safe) side.

    The value appears in ``history.history["epsilon"]`` and in the progress bar. It is a proof
    only if the batches were Poisson-sampled (:func:`pergrad.privacy.poisson_batches`) and the
    train step clips per-example gradients and adds noise with this ``noise_multiplier``; the
    callback cannot check either. With shuffled fixed-size batches it is the customary heuristic.

    Args:
      num_examples: size ``N`` of the training set.
      batch_size: expected batch size ``B``; the sampling probability is ``q = B / N``.
      noise_multiplier: ``sigma``, the noise standard deviation divided by the clip norm.
      delta: target ``delta`` in ``(0, 1)``.
      accountant: ``"rdp"`` or ``"pld"`` (see :func:`pergrad.privacy.epsilon`).

    Attributes:
      steps: training steps counted so far.
      epsilon: epsilon after the last completed epoch (``0.0`` before training).
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        noise_multiplier: float,
        delta: float,
        accountant: Accountant = "rdp",
    ) -> None:
        super().__init__()
        # Validate everything up front, not after the first epoch has been trained.
        if int(num_examples) != num_examples or num_examples <= 0:
            raise ValueError(f"num_examples must be a positive integer; got {num_examples}.")
        if int(batch_size) != batch_size or not 0 < batch_size <= num_examples:
            raise ValueError(
                f"batch_size must be an integer in [1, num_examples={num_examples}]; "
                f"got {batch_size}."
            )
        epsilon_for_steps(batch_size / num_examples, noise_multiplier, 0, delta, accountant)
        self.num_examples = int(num_examples)
        self.batch_size = int(batch_size)
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.accountant = accountant
        self.steps = 0
        self.epsilon = 0.0
        self._epoch_steps = 0

    @property
    def sampling_probability(self) -> float:
        """``q = batch_size / num_examples``."""
        return self.batch_size / self.num_examples

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_steps = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # ``batch`` is the 0-based index of the last step run in this epoch.
        self._epoch_steps = batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.steps += self._epoch_steps
        self._epoch_steps = 0
        self.epsilon = epsilon_for_steps(
            self.sampling_probability,
            self.noise_multiplier,
            self.steps,
            self.delta,
            self.accountant,
        )
        if logs is not None:
            logs["epsilon"] = self.epsilon
