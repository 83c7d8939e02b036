"""Every route a backend can be forced off for an A/B run (``pergrad.backend.routes.forced``,
the fields of ``Routes``) gives the float64 loop oracle's numbers, and the A/B script's switches
are exactly such fields (nothing patched)."""

from __future__ import annotations

import dataclasses
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
SWITCHED_OFF = {
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
        pex = pergrad.PerExample(model, loss)  # traced (or run, on PyTorch) inside the block
        grads = pex.gradients(x, y)
        computed_norms = pex.norms(x, y)
        summed, _ = pex.clipped_sum(x, y, clip)
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
