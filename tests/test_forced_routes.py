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


def _oracle_case(rng) -> tuple:
    """The text model, a batch of 6, and the float64 loop oracle's per-example gradients
    (``expected``, flattened side by side in ``flat``), their norms and a clip at their median."""
    model = _text_model()
    x = rng.integers(0, 20, size=(6, 12)).astype("int32")
    y = rng.integers(0, 3, size=(6,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected, _ = loop_gradients(model, keras_loss(loss), x, y)
    flat = np.concatenate([e.reshape(len(x), -1) for e in expected], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    return model, loss, x, y, expected, flat, norms, float(np.median(norms))


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
    model, loss, x, y, expected, flat, norms, clip = _oracle_case(rng)
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


def _route(query, **facts):
    from pergrad.rules.cost import factored_route

    sizes = {"positions": 12, "inputs": 16, "outputs": 8, "matrix_elements": 6 * 16 * 8,
             "native_products": False, "rule_ghost": False, "ghost_before_sums": False,
             "native_sums": False}
    sizes.update(facts)
    return factored_route(query=query, **sizes)


def test_factored_route_cost_model():
    """The routes a factored weight takes are a function of its sizes, kernels and the declared
    query only: the rule's ghost norms where nothing follows (or only sums, where the rule says
    its sum follows them cheaply), sums read from the matrices only after norms that build
    them, one position by outer products, and ``forced`` overriding the norms' choice."""
    from pergrad.rules.query import NORMS_ALONE, NORMS_THEN_ROWS, NORMS_THEN_SUMS

    dense = _route(NORMS_THEN_SUMS)  # T=12, I=16, O=8: the GEMM wins by the cost model
    assert (dense.norms, dense.dots, dense.sums, dense.gradients) == (
        "matrices", "matrices", "matrices", "variable_order")
    assert _route(NORMS_ALONE).sums == "inputs"  # no norms declared before the sums
    assert _route(NORMS_THEN_ROWS).gradients == "blocks"
    assert _route(NORMS_THEN_SUMS, matrix_elements=2**25 + 1).sums == "inputs"  # too large
    assert _route(NORMS_THEN_SUMS, matrix_elements=None, native_sums=True).sums == "native"
    assert _route(NORMS_THEN_SUMS, positions=2, inputs=512, outputs=512).norms == "gram"
    wide = _route(NORMS_THEN_SUMS, positions=4, inputs=4096, outputs=4096)
    assert (wide.norms, wide.dots, wide.sums) == ("gram", "inputs", "inputs")
    one = _route(NORMS_THEN_ROWS, positions=1)
    assert (one.norms, one.dots, one.sums) == ("outer", "inputs", "inputs")
    conv = {"native_products": True, "rule_ghost": True, "native_sums": True}
    assert _route(NORMS_ALONE, **conv).norms == "rule_ghost"
    assert _route(NORMS_THEN_SUMS, **conv).norms == "matrices"
    assert _route(NORMS_THEN_SUMS, ghost_before_sums=True, **conv).sums == "native"
    assert _route(NORMS_THEN_SUMS, ghost_before_sums=True, **conv).norms == "rule_ghost"
    assert _route(NORMS_THEN_ROWS, ghost_before_sums=True, **conv).norms == "matrices"
    assert _route(NORMS_ALONE, forced="matrices", **conv).norms == "matrices"
    assert _route(NORMS_THEN_ROWS, forced="ghost", **conv).norms == "rule_ghost"
    assert _route(NORMS_THEN_ROWS, forced="ghost").norms == "gram"
    assert _route(NORMS_THEN_ROWS, forced="matrices", positions=4, inputs=4096,
                  outputs=4096).norms == "matrices"
    with pytest.raises(ValueError, match="factored_norms"):
        _route(NORMS_ALONE, forced="fastest")


@pytest.mark.parametrize("choice", ["ghost", "matrices"])
def test_forced_factored_norms_give_the_oracles_numbers(float64, rng, choice):
    """``routes.forced(factored_norms=...)`` takes the named norms route on every factored
    weight (read off the routed forms while tracing), and every quantity after it (clipped
    sums, gradients, the Gram matrix, dot products) still gives the float64 loop oracle's
    numbers."""
    from pergrad.rules.forms import Factored
    from pergrad.rules.query import NORMS_THEN_ROWS

    model, loss, x, y, expected, flat, norms, clip = _oracle_case(rng)
    vectors = [keras.ops.convert_to_tensor(rng.normal(size=v.shape))
               for v in model.trainable_variables]
    taken = set()

    def body(x, y, w):
        result = pex.compute(x, y, w).routed(NORMS_THEN_ROWS)
        taken.update(f.route.norms for f in result.forms if isinstance(f, Factored))
        n = result.norms()
        clipped = result.weighted_sum(keras.ops.minimum(1.0, clip / n))
        return n, clipped, result.gradients(), result.gram(), result.dot(vectors)

    with routes.forced(factored_norms=choice):
        pex = pergrad.PerExample(model, loss)
        computed_norms, summed, grads, gram, dots = pex.compiled("forced", body)(
            *pex.prepare(x, y))
    # The Dense kernel over 12 positions takes the Gram form only when forced, the Conv1D its
    # shifted ghost norms; the last Dense (one position) its outer products either way.
    assert taken == ({"gram", "rule_ghost", "outer"} if choice == "ghost"
                     else {"matrices", "outer"})
    for g, e, v in zip(grads, expected, model.trainable_variables, strict=True):
        assert_close(g, e, atol=1e-6 * np.max(np.abs(e)), what=f"gradients {v.path}")
    assert_close(computed_norms, norms, what="norms")
    for s, e, v in zip(summed, expected, model.trainable_variables, strict=True):
        want = np.tensordot(np.minimum(1.0, clip / norms), e, axes=1)
        assert_close(s, want, atol=1e-6 * np.max(np.abs(want)), what=f"clipped sum {v.path}")
    assert_close(gram, flat @ flat.T, what="gram")
    want = flat @ np.concatenate([np.asarray(keras.ops.convert_to_numpy(v)).ravel()
                                  for v in vectors])
    assert_close(dots, want, what="dots")
