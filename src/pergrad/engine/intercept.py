"""Record the calls of tapped layers during one forward pass.

Inside the ``with`` block each tapped layer's ``call`` is replaced by a wrapper that records the
arguments and the output. For ruled layers with an ``activation`` the activation is applied by the
wrapper *after* recording, so the recorded output is the pre-activation, where the rules' formulas
live. A rule with a ``forward`` hook (recurrent layers) computes the outputs itself, in place of
``call``, and names the tensor to tap. On exit every layer is left exactly as it was.
"""

from __future__ import annotations

import contextlib

from pergrad._compat import current_graph, delete_untracked, set_untracked
from pergrad.engine.plan import Plan
from pergrad.rules import LayerCall


class ControlFlowError(NotImplementedError):
    """A tapped layer ran inside a loop (a custom RNN cell, ``tf.map_fn``) and cannot be tapped."""


_graph = current_graph


@contextlib.contextmanager
def record_calls(plan: Plan):
    """Yield a dict ``layer id -> list[LayerCall]`` filled while the model runs."""
    calls: dict[int, list[LayerCall]] = {}
    outer_graph = _graph()
    patched = []

    def install(layer, rule):
        original = layer.call
        split = rule is not None and rule.splits_activation

        def wrapper(*args, **kwargs):
            if _graph() is not outer_graph:
                raise ControlFlowError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) was called inside a loop or "
                    "another nested graph, where pergrad cannot record it. Wrap the loop in its "
                    "own Layer so that the generic rule treats it as one unit."
                )
            if rule is not None and rule.check_call is not None:
                rule.check_call(layer, LayerCall(layer, args, kwargs, None))
            if rule is not None and rule.forward is not None:
                outputs, tapped, saved = rule.forward(layer, args, kwargs)
                calls.setdefault(id(layer), []).append(
                    LayerCall(layer, args, kwargs, tapped, saved))
                return outputs
            activation = getattr(layer, "activation", None) if split else None
            if activation is not None:
                set_untracked(layer, "activation", None)
                try:
                    tapped = original(*args, **kwargs)
                finally:
                    set_untracked(layer, "activation", activation)
                outputs = activation(tapped)
            else:
                tapped = outputs = original(*args, **kwargs)
            calls.setdefault(id(layer), []).append(LayerCall(layer, args, kwargs, tapped))
            return outputs

        had_own = "call" in layer.__dict__
        set_untracked(layer, "call", wrapper)
        patched.append((layer, had_own, original))

    def install_check(layer, rule):
        original = layer.call

        def wrapper(*args, **kwargs):
            rule.check_call(layer, LayerCall(layer, args, kwargs, None))
            return original(*args, **kwargs)

        had_own = "call" in layer.__dict__
        set_untracked(layer, "call", wrapper)
        patched.append((layer, had_own, original))

    try:
        for layer, rule in plan.ruled:
            install(layer, rule)
        for layer in plan.generic:
            install(layer, None)
        for layer, rule in plan.checked:
            install_check(layer, rule)
        yield calls
    finally:
        for layer, had_own, original in reversed(patched):
            if had_own:
                set_untracked(layer, "call", original)
            else:
                delete_untracked(layer, "call")
