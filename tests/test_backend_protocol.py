"""Every backend package exports what :class:`pergrad.backend.protocol.Backend` declares, with the
same parameters, and the running backend's package is the one pergrad uses."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect

import keras
import pytest

from pergrad import backend
from pergrad.backend import routes
from pergrad.backend.protocol import (
    Backend,
    Engine,
    FunctionalPrimitives,
    JacobianPrimitives,
    Trainer,
)

#: The framework each backend package imports.
FRAMEWORKS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


def _declared(protocol: type = Backend) -> tuple[dict, set]:
    """The protocol's methods (name -> parameters without ``self``) and its constants."""
    methods, constants = {}, set()
    for cls in protocol.__mro__:  # a protocol's own members and those it extends
        if cls is object or not getattr(cls, "_is_protocol", False):
            continue
        methods.update({name: list(inspect.signature(member).parameters)[1:]
                        for name, member in vars(cls).items()
                        if inspect.isfunction(member) and not name.startswith("_")})
        constants |= set(vars(cls).get("__annotations__", {}))
    return methods, constants


#: The running backend's parts above ``backend/`` and what they declare (the Jacobian's
#: primitives: the same everywhere, and on JAX and PyTorch, where
#: ``pergrad.jacobian._functional`` compiles, its own too).
PARTS = {"engine": Engine, "trainer": Trainer, "jacobian": FunctionalPrimitives}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_the_running_backends_parts_export_their_protocol(part):
    protocol = PARTS[part]
    if part == "jacobian" and keras.backend.backend() == "tensorflow":
        protocol = JacobianPrimitives  # tf.function compiles: backend/tensorflow/jacobian_*
    import pergrad.keras  # noqa: F401 - PerExampleModel imports the trainer part first

    module = backend.part(part)
    assert module.__name__ == f"pergrad.backend.{keras.backend.backend()}.{part}"
    methods, constants = _declared(protocol)
    assert methods and (constants or protocol is JacobianPrimitives)
    for method, parameters in methods.items():
        member = getattr(module, method, None)
        assert callable(member), f"{module.__name__} lacks {method}"
        if getattr(member, "__module__", "").startswith("pergrad."):  # not jnp.sum, torch.sum
            got = list(inspect.signature(member).parameters)
            assert got == parameters, f"{module.__name__}.{method}{got} is not {parameters}"
    for constant in constants:
        assert hasattr(module, constant), f"{module.__name__} lacks {constant}"


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_each_backend_package_exports_the_protocol(name):
    if importlib.util.find_spec(FRAMEWORKS[name]) is None:
        pytest.skip(f"{FRAMEWORKS[name]} is not installed here")
    package = importlib.import_module(f"pergrad.backend.{name}")
    methods, constants = _declared()
    assert methods and constants
    for method, parameters in methods.items():
        assert callable(getattr(package, method, None)), f"{name} lacks {method}"
        got = list(inspect.signature(getattr(package, method)).parameters)
        assert got == parameters, f"{name}.{method}{got} is not the protocol's {parameters}"
    for constant in constants:
        assert hasattr(package, constant), f"{name} lacks {constant}"
    assert name == package.NAME
    assert isinstance(package.ROUTES, routes.Routes)
    assert sorted(package.__all__) == sorted(set(methods) | constants)


def test_native_is_the_running_backend():
    package = backend.native()
    assert keras.backend.backend() == package.NAME
    assert package is backend.native()  # chosen once


def test_forced_routes_apply_inside_the_block_only():
    before = backend.native().ROUTES
    with routes.forced(folded_conv_products=not before.folded_conv_products, grouped_conv=None):
        inside = backend.native().ROUTES
        assert inside.folded_conv_products is not before.folded_conv_products
        assert inside.grouped_conv is None
        assert dataclasses.replace(inside, folded_conv_products=before.folded_conv_products,
                                   grouped_conv=before.grouped_conv) == before
    assert backend.native().ROUTES is before
    with pytest.raises(TypeError), routes.forced(no_such_route=True):  # no such field
        pass
    assert backend.native().ROUTES is before


def test_forced_route_changes_the_route_a_rule_takes(monkeypatch):
    """With the slices forced off, a wide patch is gathered by a one-hot convolution (or the
    native patch kernel) instead, with the same patches."""
    import numpy as np

    from pergrad.rules import conv

    x = keras.ops.convert_to_tensor(
        np.random.default_rng(0).normal(size=(2, 6, 6, 20)).astype("float32"))
    width = 3 * 3 * 20  # above the one-hot limit
    with routes.forced(wide_patches_by_slices=True):
        assert conv.patches_by_slices(width)
        sliced = conv.extract_patches(x, (3, 3), (1, 1), (1, 1), "same")
    with routes.forced(wide_patches_by_slices=False):
        assert not conv.patches_by_slices(width)
        gathered = conv.extract_patches(x, (3, 3), (1, 1), (1, 1), "same")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(sliced),
                               keras.ops.convert_to_numpy(gathered), rtol=1e-6, atol=1e-6)


def _compiled(fn):
    """``fn`` compiled as the backend compiles a step (eager on PyTorch)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        return tf.function(fn)
    if keras.backend.backend() == "jax":
        import jax
        return jax.jit(fn)
    return fn


def test_host_call_and_branch_inside_a_compiled_function():
    """``host_call`` reaches NumPy state in program order and returns typed results;
    ``branch`` runs the taken side only (a host side effect shows which)."""
    import numpy as np

    native = backend.native()
    seen = []

    def count(values):
        seen.append(np.asarray(values).copy())

    def step(x):
        total, flag = native.host_call(
            lambda v: (np.float32(np.sum(v)), np.bool_(np.sum(v) > 0)),
            [((), "float32"), ((), "bool")], x)
        native.host_call(count, None, x * 2)
        return native.branch(flag, lambda: total + 1, lambda: total - 1)

    run = _compiled(step)
    got = [float(keras.ops.convert_to_numpy(run(keras.ops.convert_to_tensor(
        np.array(v, "float32"))))) for v in ([1.0, 2.0], [-3.0, 1.0])]
    native.wait_for_host_callbacks()
    assert got == [4.0, -3.0]
    np.testing.assert_array_equal(np.stack(seen), [[2.0, 4.0], [-6.0, 2.0]])


def test_concatenate_over_range_is_the_unrolled_concatenation():
    """``concatenate_over_range(fn, count)`` equals ``concatenate([fn(k) for k in range(count)])``
    eagerly and inside a compiled function, for ``(1, ...)`` results of an index ``k`` that is a
    Python int or a traced int32 scalar (JAX's ``lax.map``)."""
    import numpy as np

    x = np.arange(24, dtype="float32").reshape(4, 3, 2)
    expected = np.concatenate([x[k:k + 1] * (k + 1) + x.sum() for k in range(4)])

    def over_range(values):
        def one(k):
            row = keras.ops.take(values, keras.ops.reshape(k, (1,)), axis=0)
            return row * keras.ops.cast(k + 1, values.dtype) + keras.ops.sum(values)

        return backend.native().concatenate_over_range(one, 4)

    for run in (over_range, _compiled(over_range)):
        got = keras.ops.convert_to_numpy(run(keras.ops.convert_to_tensor(x)))
        assert got.shape == (4, 3, 2)
        np.testing.assert_array_equal(got, expected)
