"""Layer rules: one module per layer family, each turning a recorded call into gradient forms.

A rule is registered for a Keras layer class with :func:`register`. The engine calls it once per
call of a layer, after the single backward pass, as ``rule.fn(layer, call, output_grad)`` where
``call.inputs`` is what the layer's ``call`` received and ``output_grad`` is the gradient of the
summed loss at the layer's output (at the pre-activation when ``rule.splits_activation``). Row
``i`` of that gradient belongs to example ``i`` alone. The rule returns one form per trainable
variable (see :mod:`pergrad.rules.forms`).

A rule applies only to layers whose ``call`` is the registered class's own: a subclass that
overrides ``call`` computes something else and gets the generic rule instead.

Rules for the layers of optional packages (KerasHub: :mod:`pergrad.rules.keras_hub`) are
registered the first time a rule is looked up after that package was imported; pergrad never
imports it itself.

**Forward hook.** Some layers compute the tensor whose gradient a rule needs inside a loop (the
gate pre-activations of a recurrent layer), where no tape can reach it. A rule may then register
``forward(layer, args, kwargs, tap) -> (outputs, tapped, saved)``: while recording, the engine runs it
*instead of* the layer's ``call`` (inside ``Layer.__call__``, so masks, ``training`` and mixed
precision casting are resolved as for ``call``). ``outputs`` must equal what ``call`` returns;
``tapped`` is a tensor of the outer graph that the outputs depend on, whose gradient the rule
receives as ``output_grad``; ``saved`` is anything else the forward computed that the rule needs
(hidden states of every step, say), handed back as ``call.saved`` and never differentiated.
``tap`` is ``None`` on TensorFlow (the tape reaches ``tapped``); on JAX and PyTorch it adds the
engine's zero perturbation, and the hook must compute the outputs from ``tap(tapped)``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pergrad.rules.forms import Factored, Form, Materialized, Rows, combine, unbroadcast


@dataclass(frozen=True)
class LayerCall:
    """One call of an intercepted layer: its arguments, the tensor(s) the engine taps, and what a
    rule's ``forward`` hook saved for the rule (``None`` without one; for a generic layer, its
    non-trainable values when the call ran). ``generators``: the backend's random generator
    state when the call ran (:meth:`pergrad.backend.protocol.Backend.generator_state`), for a
    generic layer replayed with the draws it made."""

    layer: Any
    args: tuple
    kwargs: dict
    tapped: Any
    saved: Any = None
    generators: Any = None


@dataclass(frozen=True)
class Rule:
    fn: Callable[[Any, LayerCall, Any], list[Form]]
    layer_class: type
    splits_activation: bool = False
    check_call: Callable[[Any, LayerCall], None] | None = None
    applies: Callable[[Any], bool] | None = None
    forward: Callable[[Any, tuple, dict, Any], tuple[Any, Any, Any]] | None = None


_RULES: dict[type, Rule] = {}


def register(*layer_classes: type, splits_activation: bool = False,
             check_call: Callable | None = None, applies: Callable | None = None,
             forward: Callable | None = None) -> Callable:
    """Register ``fn(layer, call, output_grad) -> list[Form]`` as the rule for each of
    ``layer_classes`` (a decorator). ``splits_activation``: the engine taps the pre-activation
    of layers with an ``activation`` attribute; ``applies(layer) -> bool``: the rule holds for
    this instance (else the generic rule); ``check_call(layer, call)``: raise for a call the
    rule cannot handle; ``forward``: the optional hook described in the module docstring. A
    later registration for a class replaces the earlier one."""
    if not layer_classes:
        raise TypeError("register() needs at least one layer class.")
    for layer_class in layer_classes:
        if not isinstance(layer_class, type):
            raise TypeError(f"register() takes layer classes, got {layer_class!r}.")

    def decorate(fn):
        for layer_class in layer_classes:
            _RULES[layer_class] = Rule(fn, layer_class, splits_activation, check_call, applies,
                                       forward)
        return fn

    return decorate


_OPTIONAL_RULES = {"keras_hub": "pergrad.rules.keras_hub"}  # package -> its rules' module
_loaded_optional: set[str] = set()


def _load_optional_rules() -> None:
    """Import the rule modules of optional packages (KerasHub) already imported by the user:
    a model with their layers needs their rules, and pergrad never imports them itself."""
    for package, module in _OPTIONAL_RULES.items():
        if package not in _loaded_optional and package in sys.modules:
            _loaded_optional.add(package)
            importlib.import_module(module)


def find_rule(layer: Any) -> Rule | None:
    """The rule for ``layer``, or ``None`` when it must take the generic rule."""
    _load_optional_rules()
    for cls in type(layer).__mro__:
        rule = _RULES.get(cls)
        if rule is None:
            continue
        if type(layer).call is not cls.call:
            return None
        if rule.applies is not None and not rule.applies(layer):
            return None
        return rule
    return None


def plain_weights(layer) -> bool:
    """The layer's weights are its plain variables: no LoRA adapters, no quantization (those
    compute the kernel from other variables, so they take the generic rule)."""
    return not getattr(layer, "lora_enabled", False) and not getattr(layer, "quantization_mode", None)


def registered_layer_classes() -> list[type]:
    """The layer classes that have a rule (a subclass that overrides ``call`` does not)."""
    _load_optional_rules()
    return list(_RULES)


# Importing the rule modules registers them.
from pergrad.rules import (  # noqa: E402,F401
    conv,
    conv_transpose,
    dense,
    depthwise,
    einsum_dense,
    embedding,
    normalization,
    recurrent,
)

__all__ = ["Factored", "Form", "LayerCall", "Materialized", "Rows", "Rule", "combine",
           "find_rule", "plain_weights", "register", "registered_layer_classes", "unbroadcast"]
