"""Record the calls of tapped layers during one forward pass.

Inside the ``with`` block each tapped layer's ``call`` is replaced by a wrapper that records the
arguments and the output. For ruled layers with an ``activation`` the activation is applied by the
wrapper *after* recording, so the recorded output is the pre-activation, where the rules' formulas
live. A rule with a ``forward`` hook (recurrent layers) computes the outputs itself, in place of
``call``, and names the tensor to tap. On exit every layer is left exactly as it was.

On JAX, where a backward pass reaches only the inputs of a function, ``tap`` adds a zero
perturbation (an input of the differentiated function) to every tapped tensor as it is recorded;
the gradient with respect to that perturbation is the gradient at the tapped tensor. PyTorch
taps the same way, with zeros that are leaves of the autograd graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from pergrad import backend
from pergrad._compat import delete_untracked, set_untracked
from pergrad.backend.ops import snapshot
from pergrad.engine.plan import Plan, draws_random
from pergrad.rules import LayerCall


class ControlFlowError(NotImplementedError):
    """A tapped layer ran inside a loop (a custom RNN cell, ``tf.map_fn``) and cannot be tapped."""


def _graph() -> Any:
    """What the computation being built belongs to (:func:`pergrad.backend.ops.trace_token`:
    the TensorFlow graph being traced), to tell a loop body from the outer trace; JAX traces
    have no such handle (the JAX engine taps no layer that runs inside a loop), and PyTorch's
    eager calls share one."""
    return backend.native().trace_token()


@contextlib.contextmanager
def record_calls(plan: Plan, tap: Callable[[Any], Any] | None = None,
                 order: list | None = None):
    """Yield a dict ``layer id -> list[LayerCall]`` filled while the model runs.

    ``tap(tensors) -> tensors``, when given, is applied to each tapped (pre-activation) output
    before the rest of the model sees it; ``order``, when given, receives every ``LayerCall``
    in the order the calls ran.
    """
    calls: dict[int, list[LayerCall]] = {}
    outer_graph = _graph()
    patched = []

    def note(record: LayerCall) -> None:
        calls.setdefault(id(record.layer), []).append(record)
        if order is not None:
            order.append(record)

    def install(layer, rule):
        original = layer.call
        split = rule is not None and rule.splits_activation
        replayable = tap is not None and rule is None
        draws = replayable and draws_random(layer)

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
                outputs, tapped, saved = rule.forward(layer, args, kwargs, tap)
                note(LayerCall(layer, args, kwargs, tapped, saved))
                return outputs
            # A generic layer replayed on JAX or PyTorch must see the state it ran with (seed
            # states, and on PyTorch torch's generators, which unseeded dropout draws from).
            state = [snapshot(v.value) for v in layer.non_trainable_variables] \
                if replayable else None
            generators = backend.native().generator_state() if draws else None
            activation = getattr(layer, "activation", None) if split else None
            if activation is not None:
                set_untracked(layer, "activation", None)
                try:
                    tapped = original(*args, **kwargs)
                finally:
                    set_untracked(layer, "activation", activation)
                if tap is not None:
                    tapped = tap(tapped)
                outputs = activation(tapped)
            else:
                tapped = original(*args, **kwargs)
                if tap is not None:
                    tapped = tap(tapped)
                outputs = tapped
            note(LayerCall(layer, args, kwargs, tapped, state, generators))
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
