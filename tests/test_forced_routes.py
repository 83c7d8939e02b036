"""Every route a backend can be forced off for an A/B run (``pergrad.backend.routes.forced``,
the fields of ``Routes``) gives the float64 loop oracle's numbers, and the A/B script's switches
are exactly such fields (nothing patched)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib

import keras
import numpy as np
import pytest
from oracle import assert_close, keras_loss, loop_gradients

import pergrad
from pergrad import backend
from pergrad.backend import routes

#: Each route's field and the value that switches it off (the other route of the same math).
SWITCHED_OFF: dict = {
    "shifted_ghost_norms": False,
    "products_in_variable_order": False,
    "one_pass_row_norms": False,
    "nested_xla_outer_products": False,
    "native_segment_sums": False,
    "conv_filter_gradient_sums": "never",
}


def _text_model(vocabulary: int = 20, length: int = 12) -> keras.Model:
    """Embedding (segment sums), a stride-1 Conv1D over 16 channels (the shifted products and
    the shifted ghost norms), Dense layers (outer products and ``A^T D`` products)."""
    ids = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 16)(ids)
    h = keras.layers.Conv1D(16, 3, padding="same", activation="tanh")(h)
    h = keras.layers.Dense(8, activation="tanh")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(3)(h))


#: Per field, the function that only the route it names calls (module, attribute), and the
#: backends whose runs read the field on the model below (elsewhere it changes nothing there).
ROUTE_TAKEN = {
    "shifted_ghost_norms": ("pergrad.rules.conv", "_shifted_ghost_norms",
                            {"tensorflow", "jax", "torch"}),
    "products_in_variable_order": ("pergrad.rules.forms", "Factored._products_in_variable_order",
                                   {"tensorflow", "jax", "torch"}),
    "one_pass_row_norms": ("pergrad.backend.tensorflow.ops", "_euclidean_row_squared_norms",
                           {"tensorflow"}),
    "nested_xla_outer_products": ("pergrad.backend.tensorflow.ops", "_xla_outer_products",
                                  {"tensorflow"}),
    "native_segment_sums": ("pergrad.backend.tensorflow.ops", "_xla_segment_sum",
                            {"tensorflow"}),
    "conv_filter_gradient_sums": ("pergrad.rules.conv", "_filter_gradient", {"tensorflow"}),
}


def _spy(monkeypatch, field: str) -> list:
    """Counts the calls of the function only ``field``'s route calls."""
    module_name, attribute, _ = ROUTE_TAKEN[field]
    owner = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _run_every_query(model, loss, x, y, clip) -> tuple:
    pex = pergrad.PerExample(model, loss)  # traced (or run, on PyTorch) here
    return pex.gradients(x, y), pex.norms(x, y), pex.clipped_sum(x, y, clip)[0]


@pytest.mark.parametrize("field", sorted(SWITCHED_OFF))
def test_a_forced_route_is_the_one_taken(rng, monkeypatch, field):
    """Where a backend reads the field on this model, its route runs by default and not once
    forced off (so the oracle test below compares two routes, not one route twice)."""
    if keras.backend.backend() not in ROUTE_TAKEN[field][2]:
        pytest.skip(f"{keras.backend.backend()} does not read {field} on this model")
    calls = _spy(monkeypatch, field)
    model = _text_model()
    x = rng.integers(0, 20, size=(6, 12)).astype("int32")
    y = rng.integers(0, 3, size=(6,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    _run_every_query(model, loss, x, y, 0.1)
    assert calls, f"{field}: its route was not taken by default"
    calls.clear()
    with routes.forced(**{field: SWITCHED_OFF[field]}):
        _run_every_query(model, loss, x, y, 0.1)
    assert not calls, f"{field}: its route was taken while forced off"


@pytest.mark.parametrize("field", sorted(SWITCHED_OFF))
def test_a_route_forced_off_gives_the_oracles_numbers(float64, rng, field):
    model = _text_model()
    x = rng.integers(0, 20, size=(6, 12)).astype("int32")
    y = rng.integers(0, 3, size=(6,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected, _ = loop_gradients(model, keras_loss(loss), x, y)
    flat = np.concatenate([e.reshape(len(x), -1) for e in expected], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    clip = float(np.median(norms))
    factors = np.minimum(1.0, clip / norms)

    with routes.forced(**{field: SWITCHED_OFF[field]}):
        grads, computed_norms, summed = _run_every_query(model, loss, x, y, clip)
    for g, e, v in zip(grads, expected, model.trainable_variables, strict=True):
        assert_close(g, e, atol=1e-6 * np.max(np.abs(e)), what=f"gradients {v.path}")
    assert_close(computed_norms, norms, what="norms")
    for s, e, v in zip(summed, expected, model.trainable_variables, strict=True):
        want = np.tensordot(factors, e, axes=1)
        assert_close(s, want, atol=1e-6 * np.max(np.abs(want)), what=f"clipped sum {v.path}")


def _ab_routes():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "ab_routes.py"
    spec = importlib.util.spec_from_file_location("ab_routes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_ab_switch_is_a_forced_route():
    """Each ``--switch`` of benchmarks/ab_routes.py is ``routes.forced`` of fields of ``Routes``
    (so no A/B run patches a module), and the profile is restored after its block."""
    fields = {f.name for f in dataclasses.fields(routes.Routes)}
    before = backend.native().ROUTES
    for name, (_, _, switched_off) in _ab_routes().SWITCHES.items():
        context = switched_off()
        changes = dict(context.kwds)  # entering the context forgets them
        assert context.func is routes.forced.__wrapped__, name
        assert changes and set(changes) <= fields, name
        with context:
            inside = backend.native().ROUTES
        assert inside == dataclasses.replace(before, **changes), name
        assert backend.native().ROUTES is before, name
    assert set(SWITCHED_OFF) <= fields
