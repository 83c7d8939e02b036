"""``PerExampleModel``'s train step on the PyTorch backend.

Keras's torch trainer calls ``train_step(data)`` eagerly and expects the variables to change in
place, as on TensorFlow. The step is the one train step :func:`pergrad.keras.step.train_step`
with this module's PyTorch parts:

* the first-batch example-mixing check reads its result on the host (everything is eager), and a
  mixing model raises :class:`pergrad.MixesExamplesError` before the step changes anything: no
  weight, optimizer slot, iteration count or noise counter moves. The model's
  ``example_mixing_status`` weight remembers the outcome (0 unchecked, 1 checked, 2 refused), so
  later steps skip the check, or are refused the same way until ``compile`` resets it;
* the monitor is called with the step's ``PerExampleResult``;
* rows of weight 0 (Poisson padding, dropped examples) are removed before the compiled metrics,
  as on TensorFlow;
* ``optimizer.apply`` runs under ``torch.no_grad()``, as in Keras's own torch step.
"""

from __future__ import annotations

import sys
import warnings

import keras
import torch
from keras import ops

from pergrad.engine import compute_dtype, mixing_tolerance
from pergrad.keras import fit_parts, step
from pergrad.rules.normalization import MixesExamplesError

UNCHECKED, CHECKED, REFUSED = step.UNCHECKED, step.CHECKED, step.REFUSED
RECORD_VALUES = True
after = step.after  # eager: the check has raised before any state changes
local_and_stats = step.local_only
monitor = step.call_monitor


def replicas() -> int:
    return 1


def train_step(model, data) -> dict:
    """One ``PerExampleModel`` step, variables written in place (see the module doc)."""
    return step.train_step(model, data, on=sys.modules[__name__])


def check_example_mixing(model, engine, x, y, sample_weight) -> list:
    """On the first batch, measure how much examples mix; raise if over the tolerance."""
    status = model.mixing_status
    if status is None:
        return []
    current = int(ops.convert_to_numpy(status.value))
    detail = ""
    if current == UNCHECKED:
        tolerance = mixing_tolerance(compute_dtype(model.model))
        # The check's own forward passes write nothing: their writes stay in this scope.
        with keras.StatelessScope(state_mapping=[(v, v.value) for v in model.variables]):
            error = float(ops.convert_to_numpy(engine.example_mixing(x, y, sample_weight)))
        current = CHECKED if error <= tolerance else REFUSED
        status.assign(current)
        detail = f" Relative difference: {error:.3g} (tolerance {tolerance:.1g})."
    if current == REFUSED:
        raise MixesExamplesError(step.REFUSED_MESSAGE + detail)
    return []


def kept_rows(structure, counted):
    """Only the rows where ``counted`` is true. Targets may arrive as NumPy arrays
    (``train_on_batch``): they become tensors on ``counted``'s device first (a NumPy array
    indexed by a CUDA mask fails)."""
    return keras.tree.map_structure(
        lambda t: None if t is None else ops.convert_to_tensor(t)[counted], structure)


def apply(optimizer, grads: list, variables: list, trainable: list) -> None:
    """``optimizer.apply(grads, variables)`` outside autograd."""
    del trainable
    with torch.no_grad():
        optimizer.apply(grads, variables)


class Trainer:
    """``PerExampleModel``'s PyTorch trainer part: eager, so a refused first step raises
    :class:`pergrad.MixesExamplesError` itself, and ``jit_compile`` is refused with a warning."""

    def _add_mixing_state(self) -> None:
        fit_parts.add_mixing_status(self)

    def _compiled_for_backend(self, kwargs: dict) -> None:
        if self.jit_compile:
            # The step reads values on the host (the mixing check, noise keys, the monitor's
            # tables), which torch.compile would split into many graphs.
            warnings.warn("PerExampleModel runs its train step eagerly on PyTorch; "
                          "jit_compile=True (torch.compile) is ignored.", stacklevel=3)
            self.jit_compile = False
        if self.mixing_status is not None:
            self.mixing_status.assign(0)  # a new loss may mix examples: check it again

    def fit(self, *args, **kwargs):
        args, kwargs = fit_parts.with_monitor_callback(self, args, kwargs)
        return super().fit(*args, **kwargs)
