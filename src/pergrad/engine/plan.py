"""Which layers the engine taps, and how.

Walking the model from the top, each layer with trainable weights is either

* **ruled**: its class has a rule (:mod:`pergrad.rules`); its calls are recorded and the rule turns
  them into gradient forms;
* **generic**: it owns weights directly, has no rule, or is a wrapper that runs its sublayers in a
  loop or on reshaped batches (an RNN without a rule of its own, Bidirectional, TimeDistributed);
  its per-example gradients are per-example VJPs of that layer alone;
* **checked**: a layer without trainable weights whose rule refuses some calls (a
  BatchNormalization without scale and offset still mixes examples in training mode);
* **descended**: a container (a model, MultiHeadAttention, a user's block of layers) that owns no
  weights itself; its sublayers are planned in turn.

Trainable variables the top-level model owns directly (``self.add_weight`` in a subclassed model)
belong to no tapped layer: they are *residual*, and get per-example gradients from a vectorized
Jacobian of the per-example losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras

from pergrad._compat import own_trainable_variables, owns_seed_generator, sublayers
from pergrad.rules import Rule, find_rule

_OPAQUE = (keras.layers.RNN, keras.layers.Bidirectional, keras.layers.TimeDistributed)


@dataclass
class Plan:
    ruled: list[tuple[Any, Rule]] = field(default_factory=list)
    generic: list[Any] = field(default_factory=list)
    residual: list[Any] = field(default_factory=list)
    checked: list[tuple[Any, Rule]] = field(default_factory=list)

    @property
    def tapped_layers(self) -> list[Any]:
        return [layer for layer, _ in self.ruled] + list(self.generic)

    def describe(self) -> list[tuple[str, str, str]]:
        """``(layer name, class, how)`` for every tapped layer and residual variable."""
        rows = [(layer.name, type(layer).__name__, "rule") for layer, _ in self.ruled]
        rows += [(layer.name, type(layer).__name__, "generic") for layer in self.generic]
        rows += [(v.path, "Variable", "residual") for v in self.residual]
        return rows


def _own_trainable(layer) -> list:
    return own_trainable_variables(layer)


def _sublayers(layer) -> list:
    return sublayers(layer, recursive=False)


def _has_trainable(layer) -> bool:
    """Whether any variable of ``layer`` or of its sublayers is trainable, as the model's
    ``trainable_variables`` counts them. Not ``layer.trainable_variables``, which is empty for a
    layer whose own ``trainable`` flag is off even when a sublayer's is on again: KerasHub's
    ``Backbone.enable_lora`` freezes every layer, then sets ``trainable = True`` on the LoRA
    targets alone (``query``, ``value``), inside frozen attention blocks."""
    return any(v.trainable for v in layer.variables)


def make_plan(model) -> Plan:
    """Plan the taps of a built Keras model (see the module docstring)."""
    plan = Plan()
    seen: set[int] = set()

    def visit(layer, top: bool) -> None:
        trainable = layer.trainable_variables if top else _has_trainable(layer)
        if id(layer) in seen or not trainable:
            return
        seen.add(id(layer))
        rule = find_rule(layer)
        if rule is not None:
            plan.ruled.append((layer, rule))
        elif top:
            plan.residual.extend(_own_trainable(layer))
            for sub in _sublayers(layer):
                visit(sub, top=False)
        elif isinstance(layer, _OPAQUE) or _own_trainable(layer) or not _sublayers(layer):
            plan.generic.append(layer)
        else:
            for sub in _sublayers(layer):
                visit(sub, top=False)

    visit(model, top=True)
    # Layers without trainable weights are not tapped, but one that mixes examples (a
    # BatchNormalization without scale and offset) must still be refused in training mode.
    ruled = {id(layer) for layer, _ in plan.ruled}
    for layer in sublayers(model):
        rule = find_rule(layer)
        if (id(layer) not in ruled and rule is not None and rule.check_call is not None
                and layer.trainable):
            plan.checked.append((layer, rule))
    covered = {id(v) for layer in plan.tapped_layers for v in layer.trainable_variables}
    covered |= {id(v) for v in plan.residual}
    # A variable reached only through a non-layer attribute of the model is residual too.
    plan.residual += [v for v in model.trainable_variables if id(v) not in covered]
    return plan


def draws_random(layer: Any) -> bool:
    """Whether ``layer`` or one of its sublayers draws random numbers in training mode: it owns
    a seed generator and is not a dropout layer or recurrent cell whose rates are all 0
    (Keras's cells own one even without dropout). The functional engines (JAX, PyTorch) replay
    such a layer with the seed state it ran with instead of calling it per example."""
    def own(sublayer) -> bool:
        if not owns_seed_generator(sublayer):
            return False
        rates = [getattr(sublayer, name) for name in ("rate", "dropout", "recurrent_dropout")
                 if isinstance(getattr(sublayer, name, None), (int, float))]
        return not rates or any(rate > 0 for rate in rates)
    return any(own(s) for s in sublayers(layer, include_self=True))
