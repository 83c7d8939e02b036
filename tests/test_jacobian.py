"""pergrad.jacobian: compiled Jacobians, JVPs, VJPs, HVPs and Hessians, on every backend.

Oracles, in float64 on random non-zero inputs, independent of pergrad's vectorized code: one
vector-Jacobian product per output element in a Python loop (TensorFlow: tape.jacobian
without pfor; JAX: jax.vjp, one call per one-hot cotangent; PyTorch: torch.autograd.grad, one
call per output element), its diagonal blocks for batched Jacobians, and central finite
differences in NumPy.

The functions differentiated use the backend's NumPy (tf.experimental.numpy, jax.numpy, and
on PyTorch the torch functions of the same names): on JAX, Keras's own ops (keras.ops.sin,
tanh, ...) return float32 for float64 inputs.
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pergrad import backend  # noqa: E402
from pergrad.backend import routes  # noqa: E402
from pergrad.jacobian import (  # noqa: E402
    hessian,
    hvp,
    jacfwd,
    jacobian,
    jacrev,
    jvp,
    trace_counts,
    vjp,
)

ON_JAX = keras.backend.backend() == "jax"
ON_TORCH = keras.backend.backend() == "torch"
ON_TF = not (ON_JAX or ON_TORCH)
if ON_JAX:
    import jax
    import jax.numpy as xp
elif ON_TORCH:
    import torch

    def _reduce(op):
        def reduce(t, axis=None, keepdims=False):
            return op(t) if axis is None else op(t, dim=axis, keepdim=keepdims)
        return reduce

    xp = types.SimpleNamespace(  # the NumPy names these tests use, on torch tensors
        sin=torch.sin, cos=torch.cos, tanh=torch.tanh, matmul=torch.matmul,
        reshape=torch.reshape, argmax=torch.argmax, sum=_reduce(torch.sum),
        prod=_reduce(torch.prod),
        ones=lambda shape, dtype: torch.ones(shape, dtype=getattr(torch, dtype)),
        zeros=lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, dtype)),
        asarray=lambda t, dtype: torch.as_tensor(t, dtype=getattr(torch, dtype)),
        tensordot=lambda a, b, axes: torch.tensordot(a, b, dims=axes),
    )
else:
    import tensorflow as tf

    xp = tf.experimental.numpy

tf_only = pytest.mark.skipif(not ON_TF, reason="TensorFlow behaviour (tf.function, TensorSpec)")
not_tf = pytest.mark.skipif(ON_TF, reason="JAX and PyTorch behaviour (no tf.function)")


def numpy(t):
    """A NumPy copy of a tensor (a torch tensor that requires grad included)."""
    return keras.ops.convert_to_numpy(t)

F64 = "float64"
RTOL = 1e-6
FD_RTOL = 1e-5
FD_EPS = 1e-6
# The same float64 math batched or chunked differently agrees to rounding.
REPEAT_RTOL = 1e-12
# The same through Keras layers: on PyTorch, Keras computes a float64 Dense layer's matmul in
# float32 (keras.ops.matmul's dtype comes from keras.backend.result_type, which maps 64-bit to
# 32-bit; upstream keras-team/keras#23704), so Keras models there are accurate to float32 only:
# finite differences take a wider step and two routes through such a layer agree to float32.
# The loop oracle runs through the same layers and keeps RTOL, and functions of torch's own
# ops keep the float64 tolerances above. (On the small CNN, finite differences of step
# 1e-4/1e-3/1e-2 miss by 2e-2/2e-3/2e-4 relative: rounding, not truncation, dominates.)
MODEL_FD_RTOL, MODEL_FD_EPS, MODEL_REPEAT_RTOL = (
    (1e-3, 1e-2, 1e-6) if ON_TORCH else (FD_RTOL, FD_EPS, REPEAT_RTOL))


@pytest.fixture(autouse=True)
def _floatx64(float64):
    """floatx float64: Keras layers and Python floats in float64 on every backend (on PyTorch,
    Keras's Dense matmul still rounds as float32: see MODEL_REPEAT_RTOL)."""
    yield


def rand(*shape, seed=0, dtype=F64):
    values = np.random.default_rng([seed, 7]).normal(size=shape).astype(dtype)
    return keras.ops.convert_to_tensor(values)


def close(a, b, rtol=RTOL, atol=None):
    """Relative closeness, scaled by the reference's magnitude (entries may be ~0)."""
    a, b = numpy(a), numpy(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(np.max(np.abs(b)), 1e-30)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol if atol is not None else rtol * scale)


def assert_nested_close(a, b, rtol=RTOL):
    keras.tree.assert_same_structure(a, b)
    for x, y in zip(keras.tree.flatten(a), keras.tree.flatten(b), strict=True):
        close(x, y, rtol)


def central_fd(f, x, eps=FD_EPS):
    """Finite-difference Jacobian of a single-tensor f: shape (*out, *in)."""
    x = numpy(x).astype(np.float64)
    cols = []
    for i in range(x.size):
        d = np.zeros(x.size)
        d[i] = eps
        d = d.reshape(x.shape)
        hi = numpy(f(keras.ops.convert_to_tensor(x + d)))
        lo = numpy(f(keras.ops.convert_to_tensor(x - d)))
        cols.append((hi - lo) / (2 * eps))
    out_shape = cols[0].shape
    return np.stack(cols, axis=-1).reshape(out_shape + x.shape)


def oracle_jacobian(f, x):
    """One VJP per output element, in a loop (no vectorization): shape (*out, *in)."""
    if ON_TORCH:
        x = x.detach().requires_grad_(True)
        y = f(x)
        flat = y.reshape(-1)
        rows = [torch.autograd.grad(flat[j], x, retain_graph=True, allow_unused=True)[0]
                for j in range(flat.numel())]
        rows = [np.zeros(x.shape) if r is None else numpy(r) for r in rows]
        return np.stack(rows).reshape(tuple(y.shape) + tuple(x.shape))
    if ON_TF:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y = f(x)
        return np.asarray(tape.jacobian(y, x, experimental_use_pfor=False))
    y, pullback = jax.vjp(f, x)
    apply = jax.jit(lambda p, u: p(u)[0])
    rows = [np.asarray(apply(pullback, e.reshape(y.shape))) for e in np.eye(y.size, dtype=y.dtype)]
    return np.stack(rows).reshape(tuple(y.shape) + tuple(x.shape))


def oracle_batch_jacobian(f, x):
    """The diagonal blocks J[b, ..., b, ...] of the full oracle Jacobian: (B, *ex(out), *ex(in))."""
    full = oracle_jacobian(f, x)
    batch = x.shape[0]
    out_ex = full.shape[1 : full.ndim - len(x.shape)]
    in_ex = tuple(x.shape[1:])
    square = full.reshape(batch, int(np.prod(out_ex)), batch, int(np.prod(in_ex)))
    return np.einsum("bmbn->bmn", square).reshape((batch, *out_ex, *in_ex))


def oracle_grad(f, x):
    """Gradient of a scalar f (tape / jax.grad / torch.autograd.grad)."""
    if ON_JAX:
        return jax.grad(f)(x)
    if ON_TORCH:  # create_graph: the Hessian test differentiates this gradient again
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        return torch.autograd.grad(f(x), x, create_graph=True)[0]
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = f(x)
    return tape.gradient(y, x)


def pure_call(model, training):
    """The model as a function of its input alone, through stateless_call: writes nothing."""
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]

    def call(t):
        return model.stateless_call(trainable, frozen, t, training=training)[0]

    return call


def mlp(n_in=4, hidden=6, n_out=3, dropout=None):
    layers = [keras.Input((n_in,), dtype="float64")]
    layers.append(keras.layers.Dense(hidden, activation="sigmoid", dtype="float64"))
    if dropout:
        layers.append(keras.layers.Dropout(dropout, dtype="float64"))
    layers.append(keras.layers.Dense(n_out, dtype="float64"))
    keras.utils.set_random_seed(1)
    return keras.Sequential(layers)


def small_cnn():
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2), dtype="float64"),
            keras.layers.Conv2D(3, 3, activation="sigmoid", dtype="float64"),
            keras.layers.Conv2D(2, 2, strides=2, activation="sigmoid", dtype="float64"),
            keras.layers.Flatten(dtype="float64"),
            keras.layers.Dense(4, dtype="float64"),
        ]
    )


def nested_f(inp):
    """Nested inputs {'a': (3,), 'b': (2, 2)} -> nested outputs (scalar, {'m': (2, 3)})."""
    a, b = inp["a"], inp["b"]
    s = xp.sum(xp.sin(a)) * xp.prod(b)
    m = xp.tanh(xp.matmul(b, xp.reshape(a, (1, 3)) * xp.ones((2, 1), F64)))
    return s, {"m": m}


def nested_input(seed=0):
    return {"a": rand(3, seed=seed), "b": rand(2, 2, seed=seed + 1)}


# ---------------------------------------------------------------------------------------------
# Correctness against tape.jacobian and finite differences


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_mlp_full_jacobian_matches_tape_and_fd(mode):
    model = mlp()
    x = rand(2, 4, seed=3)  # not batched: the full (2, 3, 2, 4) Jacobian
    jac = jacobian(model, mode=mode)
    J = jac(x)
    assert J.shape == (2, 3, 2, 4)
    close(J, oracle_jacobian(model, x))
    close(J, central_fd(model, x, MODEL_FD_EPS), MODEL_FD_RTOL)
    assert jac.mode in ("rev", "fwd")


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_cnn_input_jacobian_batched_matches_batch_jacobian_and_fd(mode):
    model = small_cnn()
    x = rand(3, 6, 6, 2, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # vectorized on every backend: no per-product loop
        J = jacobian(model, mode=mode, batched=True)(x)
    assert J.shape == (3, 4, 6, 6, 2)
    close(J, oracle_batch_jacobian(model, x))
    close(J[1], central_fd(model, x[1:2], MODEL_FD_EPS)[0, :, 0], MODEL_FD_RTOL)


@pytest.mark.parametrize("per_example", [False, True])
def test_batched_forward_mode_by_either_route_matches_the_oracle(per_example):
    """Batched forward mode pushes one tangent shared by the whole batch, or (JAX's route,
    ``Routes.per_example_forward_mode``, forced here on every backend) maps over the examples,
    each a batch of one: both give the loop oracle's numbers, for a CNN (in chunks too) and
    for nested inputs and outputs with an empty leaf."""
    model = small_cnn()
    x = rand(3, 6, 6, 2, seed=4)

    def f(inp):
        u, v, empty = inp
        return {"p": xp.tanh(u[:, :2] * v), "q": xp.sum(u, axis=1) * v[:, 0] + xp.sum(empty)}

    u, v, empty = rand(3, 4, seed=11), rand(3, 2, seed=12), rand(3, 0, seed=13)
    with routes.forced(per_example_forward_mode=per_example):
        cnn = jacobian(model, mode="fwd", batched=True)(x)
        chunked = jacobian(model, mode="fwd", batched=True, chunk_size=5)(x)
        nested = jacobian(f, mode="fwd", batched=True)((u, v, empty))
    close(cnn, oracle_batch_jacobian(model, x))
    close(chunked, cnn, MODEL_REPEAT_RTOL)
    close(nested["p"][0], oracle_batch_jacobian(lambda t: f((t, v, empty))["p"], u))
    close(nested["p"][1], oracle_batch_jacobian(lambda t: f((u, t, empty))["p"], v))
    close(nested["q"][0], oracle_batch_jacobian(lambda t: f((t, v, empty))["q"][:, None], u)[:, 0])
    assert nested["q"][2].shape == (3, 0) and nested["p"][2].shape == (3, 2, 0)


def test_batched_forward_mode_takes_the_per_example_route_where_the_backend_says(monkeypatch):
    """Where ``Routes.per_example_forward_mode`` is on (TensorFlow, JAX), inference takes it and
    ``training=True`` (f's examples may share batch statistics) does not; PyTorch, where it did
    not win, never does."""
    from pergrad.jacobian import _modes

    calls = []
    route = _modes._jacobian_fwd_per_example
    monkeypatch.setattr(_modes, "_jacobian_fwd_per_example",
                        lambda *a, **k: calls.append(1) or route(*a, **k))
    model = small_cnn()
    x = rand(3, 6, 6, 2, seed=4)
    jacobian(model, mode="fwd", batched=True)(x)
    assert len(calls) == (1 if backend.native().ROUTES.per_example_forward_mode else 0)
    assert backend.native().ROUTES.per_example_forward_mode == (not ON_TORCH)
    calls.clear()
    jacobian(model, mode="fwd", batched=True, training=True)(x)
    jacobian(model, mode="fwd", batched=False)(x[:1])
    assert not calls
    if ON_TF:  # a new batch size retraces with the batch known at run time only: the shared
        # tangent's route, whose assertions check the outputs' batch then
        jac = jacobian(model, mode="fwd", batched=True)
        jac(x)
        x4 = rand(4, 6, 6, 2, seed=5)
        J4 = jac(x4)
        assert len(calls) == 1 and jac.trace_count == 2
        close(J4, oracle_batch_jacobian(model, x4))


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_nested_inputs_and_outputs(mode):
    x = nested_input()
    J = jacobian(nested_f, mode=mode)(x)
    # Outputs outer, inputs inner, like JAX.
    assert J[0]["a"].shape == (3,) and J[0]["b"].shape == (2, 2)
    assert J[1]["m"]["a"].shape == (2, 3, 3) and J[1]["m"]["b"].shape == (2, 3, 2, 2)
    for out_index, out_key in [(0, None), (1, "m")]:
        for in_key in ("a", "b"):

            def leaf_fn(v, in_key=in_key, out_index=out_index, out_key=out_key):
                y = nested_f({**x, in_key: v})[out_index]
                return y if out_key is None else y[out_key]

            block = J[out_index] if out_key is None else J[out_index][out_key]
            close(block[in_key], oracle_jacobian(leaf_fn, x[in_key]))
            close(block[in_key], central_fd(leaf_fn, x[in_key]), FD_RTOL)


def test_several_positional_args_and_argnums():
    def f(a, b, scale):
        return xp.tanh(a * b) * scale

    a, b, scale = rand(3, seed=1), rand(3, seed=2), 1.5
    jac_all = jacobian(f, argnums=(0, 1))
    Ja, Jb = jac_all(a, b, scale)  # inner structure: the tuple of differentiated args
    close(Ja, oracle_jacobian(lambda v: f(v, b, scale), a))
    close(Jb, oracle_jacobian(lambda v: f(a, v, scale), b))
    Jb_only = jacobian(f, argnums=1, mode="fwd")(a, b, scale)
    close(Jb_only, Jb)
    # Default: every positional arg, as one tuple-shaped structure.
    Ja2, Jb2 = jacobian(lambda p, q: f(p, q, scale))(a, b)
    close(Ja2, Ja)
    close(Jb2, Jb)


def test_non_square_fwd_and_rev_agree_and_auto_picks_cheaper():
    w_tall = rand(3, 40, seed=5)
    w_wide = rand(40, 3, seed=6)

    def tall(x):  # 3 inputs -> 40 outputs: forward mode needs 3 JVPs, reverse 40 VJPs
        return xp.tanh(xp.matmul(x, w_tall))

    def wide(x):  # 40 inputs -> 3 outputs
        return xp.tanh(xp.matmul(x, w_wide))

    for f, n_in, expected in [(tall, 3, "fwd"), (wide, 40, "rev")]:
        x = rand(n_in, seed=7)
        auto = jacobian(f)
        assert auto.mode is None and auto.mode_requested == "auto"
        J = auto(x)
        assert auto.mode == expected
        close(jacfwd(f)(x), jacrev(f)(x))
        close(J, oracle_jacobian(f, x))
        close(J, central_fd(f, x), FD_RTOL)


def test_auto_rule_boundary():
    # Forward mode iff 1.5 * inputs < outputs: a JVP costs about 1.5 VJPs.
    x = rand(10, seed=3)
    for n_out, expected in [(15, "rev"), (16, "fwd")]:
        w = rand(10, n_out, seed=n_out)
        jac = jacobian(lambda v, w=w: xp.sin(xp.matmul(v, w)))
        jac(x)
        assert jac.mode == expected


def test_auto_batched_uses_per_example_sizes():
    w = rand(2, 30, seed=8)

    def f(x):  # per example 2 -> 30, so forward mode even though B*2 > 30
        return xp.sin(x @ w)

    jac = jacobian(f, batched=True)
    x = rand(40, 2, seed=9)
    J = jac(x)
    assert jac.mode == "fwd"
    close(J, oracle_batch_jacobian(f, x))


def test_mixed_dtypes_and_empty_leaves():
    def f(inp):
        a, e = inp  # a: float32 (3,), e: float64 (0,), unused by one output
        return {"y": xp.asarray(xp.sin(a), F64) * 2.0, "z": xp.sum(e) + xp.asarray(a[0], F64)}

    x = (rand(3, dtype="float32") * 0 + np.float32([0.1, 0.5, -0.3]), xp.zeros((0,), F64))
    ref = {
        "y": (np.diag(2 * np.cos([0.1, 0.5, -0.3])), np.zeros((3, 0))),
        "z": (np.array([1.0, 0.0, 0.0]), np.zeros((0,))),
    }
    for mode in ("rev", "fwd"):
        J = jacobian(f, mode=mode)(x)
        for key in ("y", "z"):
            for got, want in zip(J[key], ref[key], strict=True):
                # blocks take the output's dtype in both modes
                assert keras.backend.standardize_dtype(got.dtype) == F64
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Batched, chunked


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_batched_equals_diagonal_blocks_of_full_jacobian(mode):
    model = mlp(n_in=5, n_out=3)
    x = rand(4, 5, seed=10)
    full = numpy(jacobian(model, mode=mode)(x))  # (4, 3, 4, 5)
    batched = numpy(jacobian(model, mode=mode, batched=True)(x))  # (4, 3, 5)
    assert batched.shape == (4, 3, 5)
    for b in range(4):
        close(batched[b], full[b, :, b, :])
        for b2 in range(4):
            if b2 != b:
                assert np.all(full[b, :, b2, :] == 0)  # examples are independent


def test_batched_nested_structures():
    def f(inp):
        u, v = inp
        return {"p": xp.tanh(u[:, :2] * v), "q": xp.sum(u, axis=1) * v[:, 0]}

    u, v = rand(3, 4, seed=11), rand(3, 2, seed=12)
    for mode in ("rev", "fwd"):
        J = jacobian(f, mode=mode, batched=True)((u, v))
        assert J["p"][0].shape == (3, 2, 4) and J["p"][1].shape == (3, 2, 2)
        assert J["q"][0].shape == (3, 4) and J["q"][1].shape == (3, 2)
        close(J["p"][0], oracle_batch_jacobian(lambda t: f((t, v))["p"], u))
        close(J["p"][1], oracle_batch_jacobian(lambda t: f((u, t))["p"], v))
        qu = oracle_batch_jacobian(lambda t: f((t, v))["q"][:, None], u)[:, 0]
        close(J["q"][0], qu)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
@pytest.mark.parametrize("batched", [False, True])
def test_chunked_equals_unchunked(mode, batched):
    model = mlp(n_in=7, hidden=5, n_out=7)
    x = rand(3, 7, seed=13)
    ref = numpy(jacobian(model, mode=mode, batched=batched)(x))
    # 1 (every product alone), 3 (uneven: full chunks and a remainder), 7 (one per chunk)
    for chunk in (1, 3, 7, 100):
        J = jacobian(model, mode=mode, batched=batched, chunk_size=chunk)(x)
        np.testing.assert_allclose(J, ref, rtol=MODEL_REPEAT_RTOL, atol=MODEL_REPEAT_RTOL * 1e-2)


def test_chunked_nested():
    x = nested_input(seed=3)
    ref = jacobian(nested_f, mode="rev")(x)
    for mode in ("rev", "fwd"):
        assert_nested_close(jacobian(nested_f, mode=mode, chunk_size=2)(x), ref)


def test_jit_compile_matches():
    model = mlp()
    x = rand(3, 4, seed=14)
    ref = jacobian(model, batched=True)(x)
    for mode in ("rev", "fwd"):
        close(jacobian(model, mode=mode, batched=True, jit_compile=True)(x), ref)


@settings(max_examples=6, deadline=None)
@given(
    n_in=st.integers(1, 5),
    n_out=st.integers(1, 5),
    batch=st.integers(1, 4),
    chunk=st.one_of(st.none(), st.integers(1, 4)),
)
def test_random_shapes_match_tape(n_in, n_out, batch, chunk):
    w = rand(n_in, n_out, seed=n_in * 10 + n_out)

    def f(x):
        return xp.tanh(x @ w) * xp.sum(x, axis=1, keepdims=True)

    x = rand(batch, n_in, seed=batch)
    ref = oracle_batch_jacobian(f, x)
    for mode in ("rev", "fwd"):
        close(jacobian(f, mode=mode, batched=True, chunk_size=chunk)(x), ref)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_attention_block_input_jacobian(mode):
    # DESIGN.md: vectorized_map over a transformer block's stateless_call can segfault without
    # XLA. Input Jacobians vectorize the VJP/JVP of the whole call instead; check they run.
    keras.utils.set_random_seed(4)
    inp = keras.Input((4, 6), dtype="float64")
    h = keras.layers.MultiHeadAttention(2, 3, dtype="float64")(inp, inp)
    h = keras.layers.LayerNormalization(dtype="float64")(h + inp)
    model = keras.Model(inp, keras.layers.Dense(5, activation="gelu", dtype="float64")(h))
    x = rand(8, 4, 6, seed=18)
    J = jacobian(model, mode=mode, batched=True)(x)
    assert J.shape == (8, 4, 5, 4, 6)
    close(J, oracle_batch_jacobian(model, x))


# ---------------------------------------------------------------------------------------------
# Keras training flag


def test_keras_training_flag():
    model = mlp(n_in=4, hidden=30, n_out=2, dropout=0.5)
    x = rand(2, 4, seed=15)
    # Default training=False: dropout off, deterministic, equal to the inference tape.
    J = jacobian(model, batched=True)(x)
    close(J, oracle_batch_jacobian(pure_call(model, training=False), x))

    # training=True: a dropout mask is applied, the same for every VJP/JVP of one call.
    # Jacobian of the hidden layer (Dense -> Dropout) shows it: each unit's row is either
    # zero (dropped) or 2x the inference row (kept, scaled by 1/(1-0.5)).
    hidden = keras.Sequential(model.layers[:2])
    ref = numpy(jacobian(hidden, batched=True)(x))  # (2, 30, 4)
    for mode in ("rev", "fwd"):
        Jt = numpy(jacobian(hidden, mode=mode, batched=True, training=True)(x))
        dropped = np.all(Jt == 0, axis=-1)
        assert dropped.any() and not dropped.all()
        np.testing.assert_allclose(Jt[~dropped], 2 * ref[~dropped], rtol=MODEL_REPEAT_RTOL)


def test_batchnorm_training_full_jacobian():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="float64"),
            keras.layers.Dense(4, dtype="float64"),
            keras.layers.BatchNormalization(dtype="float64"),
        ]
    )
    x = rand(5, 3, seed=16)
    ref = oracle_jacobian(pure_call(model, training=True), x)  # mixes examples
    for mode in ("rev", "fwd"):
        close(jacobian(model, mode=mode, training=True)(x), ref)


# ---------------------------------------------------------------------------------------------
# jvp, vjp, hvp, hessian


def test_jvp_and_vjp_match_jacobian():
    x = nested_input(seed=4)
    t = nested_input(seed=5)
    J = jacobian(nested_f)(x)
    y, jv = jvp(nested_f, x, t)
    assert_nested_close(y, nested_f(x))
    # (J t)_k = sum_l J_kl . t_l
    expected_s = sum(xp.sum(J[0][k] * t[k]) for k in ("a", "b"))
    close(jv[0], expected_s)
    expected_m = sum(xp.tensordot(J[1]["m"][k], t[k], axes=len(t[k].shape)) for k in ("a", "b"))
    close(jv[1]["m"], expected_m)

    u = (rand(seed=6), {"m": rand(2, 3, seed=7)})
    y2, vjp_fn = vjp(nested_f, x)
    assert_nested_close(y2, nested_f(x))
    g = vjp_fn(u)
    for k in ("a", "b"):
        expected = u[0] * J[0][k] + xp.tensordot(u[1]["m"], J[1]["m"][k], axes=2)
        close(g[k], expected)


def test_jvp_vjp_tuple_primals_are_positional_args():
    def f(a, b):
        return xp.sin(a) * b

    a, b = rand(3, seed=8), rand(3, seed=9)
    ta, tb = rand(3, seed=10), rand(3, seed=11)
    _, jv = jvp(f, (a, b), (ta, tb))
    close(jv, xp.cos(a) * b * ta + xp.sin(a) * tb)
    _, vjp_fn = vjp(f, (a, b))
    ga, gb = vjp_fn(xp.ones(3, F64))
    close(ga, xp.cos(a) * b)
    close(gb, xp.sin(a))


def test_hvp_and_hessian_match_tape_and_fd():
    def f(inp):
        return xp.sum(xp.sin(inp["p"]) * inp["q"] ** 2) + xp.prod(inp["p"])

    x = {"p": rand(3, seed=12), "q": rand(3, seed=13)}
    H = hessian(f)(x)
    for k1 in ("p", "q"):
        for k2 in ("p", "q"):

            def grad_k1(v, k1=k1, k2=k2):  # d f / d x[k1], as a function of x[k2]
                point = {**x, k2: v}
                return oracle_grad(lambda u, point=point: f({**point, k1: u}), point[k1])

            close(H[k1][k2], oracle_jacobian(grad_k1, x[k2]))
            close(H[k1][k2], central_fd(grad_k1, x[k2]), FD_RTOL)
    v = {"p": rand(3, seed=14), "q": rand(3, seed=15)}
    hv = hvp(f, x, v)
    for k1 in ("p", "q"):
        close(hv[k1], sum(xp.matmul(H[k1][k2], v[k2]) for k2 in ("p", "q")))


def test_batched_hessian_and_chunks():
    def f(x):  # one scalar per example
        return xp.sum(xp.tanh(x) ** 3, axis=1) * xp.prod(x, axis=1)

    x = rand(3, 4, seed=16)
    Hb = numpy(hessian(f, batched=True)(x))
    assert Hb.shape == (3, 4, 4)
    for b in range(3):
        close(Hb[b], hessian(lambda v, b=b: f(v[None])[0])(x[b]))
    np.testing.assert_allclose(numpy(hessian(f, batched=True, chunk_size=3)(x)), Hb,
                               rtol=REPEAT_RTOL)


def test_hvp_with_keras_weights_matches_double_tape():
    model = mlp(n_in=3, hidden=4, n_out=2)
    x = rand(5, 3, seed=17)
    weights = model.trainable_variables

    def loss(ws):  # uses the model's variables, which are the primals
        return xp.sum(model(x) ** 2)

    v = [rand(*w.shape, seed=20 + i) for i, w in enumerate(weights)]
    hv = hvp(loss, weights, v)
    expected = reverse_over_reverse(model, x, v)
    assert len(hv) == len(expected) == 4
    for a, b in zip(hv, expected, strict=True):
        close(a, b)
    # New weights are read at the next call, with no new trace.
    model.set_weights([2 * w for w in model.get_weights()])
    for a, b in zip(hvp(loss, weights, v), reverse_over_reverse(model, x, v), strict=True):
        close(a, b)
    assert trace_counts(loss) == {"hvp": 1}


def reverse_over_reverse(model, x, v):
    """H v of sum(model(x)^2) in the weights: the gradient of <grad, v> (no forward mode)."""
    weights = model.trainable_variables
    if ON_JAX:
        frozen = [w.value for w in model.non_trainable_variables]

        def loss_of(values):
            return xp.sum(model.stateless_call(values, frozen, x)[0] ** 2)

        def g_dot_v(values):
            g = jax.grad(loss_of)(values)
            return sum(xp.sum(gi * vi) for gi, vi in zip(g, v, strict=True))

        return jax.grad(g_dot_v)([w.value for w in weights])
    if ON_TORCH:
        values = [w.value for w in weights]  # the Parameters model(x) reads
        g = torch.autograd.grad(xp.sum(model(x) ** 2), values, create_graph=True)
        gv = sum(xp.sum(gi * vi) for gi, vi in zip(g, v, strict=True))
        return torch.autograd.grad(gv, values)
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            y = xp.sum(model(x) ** 2)
        g = inner.gradient(y, weights)
        gv = tf.add_n([xp.sum(gi * vi) for gi, vi in zip(g, v, strict=True)])
    return outer.gradient(gv, weights)


# ---------------------------------------------------------------------------------------------
# Compile once


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_same_signature_never_retraces_new_batch_size_at_most_once(mode):
    model = mlp()
    jac = jacobian(model, mode=mode, batched=True)
    for seed in range(3):
        jac(rand(4, 4, seed=seed))
    assert jac.trace_count == 1
    jac(rand(6, 4, seed=5))
    n = jac.trace_count
    # jax.jit traces each batch size; TensorFlow relaxes the batch dimension at most once;
    # PyTorch builds once per structural key, which leaves the batch size out.
    if ON_JAX:
        assert n == 2
    elif ON_TORCH:
        assert n == 1
    else:
        assert n <= 2
    for batch in (7, 9, 2, 7, 9):
        x = rand(batch, 4, seed=batch)
        close(jac(x), oracle_batch_jacobian(model, x))  # the batch-relaxed trace is right too
    # TensorFlow relaxes the batch dimension once; jax.jit traces each batch size once.
    assert jac.trace_count == (n + 3 if ON_JAX else n)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_new_weights_are_read_without_retracing(mode):
    """Compiled Jacobians and products read the variables at every call, whether f is the
    model or a function that uses it (on JAX the variables' values are jit arguments; on
    PyTorch a copy is read at every call)."""
    model = mlp(n_in=3, hidden=5, n_out=2)
    x = rand(4, 3, seed=30)

    def uses_model(t):
        return model(t) * 2.0

    direct = jacobian(model, mode=mode, batched=True)
    indirect = jacobian(uses_model, mode=mode, batched=True)
    t = rand(4, 3, seed=31)
    before = numpy(direct(x))
    indirect(x)
    jvp(uses_model, x, t)
    rng = np.random.default_rng(5)
    model.set_weights([w + 0.5 * rng.normal(size=w.shape) for w in model.get_weights()])
    after = direct(x)
    expected = oracle_batch_jacobian(pure_call(model, training=False), x)
    close(after, expected)
    close(indirect(x), 2 * expected)
    _, tangent_out = jvp(uses_model, x, t)
    close(tangent_out, 2 * np.einsum("boi,bi->bo", expected, numpy(t)))
    assert not np.allclose(before, after)
    assert direct.trace_count == indirect.trace_count == 1
    assert trace_counts(uses_model) == {"jvp": 1}


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_training_dropout_draws_a_new_mask_every_call(mode):
    keras.utils.set_random_seed(7)
    layer = keras.Sequential([keras.Input((3,), dtype=F64), keras.layers.Dense(20, dtype=F64),
                              keras.layers.Dropout(0.5, dtype=F64)])
    x = rand(2, 3, seed=32)
    jac = jacobian(layer, mode=mode, batched=True, training=True)
    masks = [np.all(numpy(jac(x)) == 0, axis=-1) for _ in range(3)]
    assert all(m.any() and not m.all() for m in masks)
    assert not (np.array_equal(masks[0], masks[1]) and np.array_equal(masks[1], masks[2]))
    assert jac.trace_count == 1


@pytest.mark.skipif(ON_TF, reason="TensorFlow's forward mode runs f once per input leaf, each "
                    "drawing its own mask (docs/jacobian.md, Caveats)")
@pytest.mark.parametrize("vectorized", [True, False])
def test_one_dropout_mask_per_call_across_input_leaves_and_convolutions(vectorized,
                                                                        monkeypatch):
    """Every product of one call sees the same dropout mask: forward mode runs one set of
    products per input leaf, and each unit is dropped for both leaves or for neither. On
    PyTorch, ``vectorized=False`` takes away the scope that lets Keras's convolution run under
    vmap, so the products run one at a time, each from the same generator state."""
    if not vectorized:
        if not ON_TORCH:
            pytest.skip("only PyTorch runs products one at a time")
        from pergrad.backend.torch import jacobian as _on_torch

        monkeypatch.setattr(_on_torch, "torch_convolutions_in_vmap", contextlib.nullcontext)
    keras.utils.set_random_seed(8)
    a_in, b_in = keras.Input((5, 5, 2), dtype=F64), keras.Input((3,), dtype=F64)
    conv = keras.layers.Flatten(dtype=F64)(keras.layers.Conv2D(2, 3, dtype=F64)(a_in))
    hidden = keras.layers.Dense(40, dtype=F64)(
        keras.layers.Concatenate(dtype=F64)([conv, b_in]))
    model = keras.Model([a_in, b_in], keras.layers.Dropout(0.5, dtype=F64)(hidden))
    x = [rand(2, 5, 5, 2, seed=40), rand(2, 3, seed=41)]
    jac = jacobian(model, mode="fwd", batched=True, training=True)
    if vectorized:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            J = jac(x)
    else:
        with pytest.warns(UserWarning, match="50 products run one at a time") as caught:
            J = jac(x)
        # Attributed to the user's call (this file), past every frame inside pergrad.
        assert [w.filename for w in caught if "products run one at a time" in str(w.message)
                ] == [__file__]
    dropped_a = np.all(numpy(J[0]).reshape(2, 40, -1) == 0, axis=-1)
    dropped_b = np.all(numpy(J[1]).reshape(2, 40, -1) == 0, axis=-1)
    assert dropped_a.any() and not dropped_a.all()
    np.testing.assert_array_equal(dropped_a, dropped_b)


@not_tf
def test_vjp_pullback_keeps_the_weights_it_ran_with():
    """JAX's and PyTorch's vjp_fn runs only the backward pass of the call that made it, with
    the weights of that call, whatever was assigned since (TensorFlow recomputes)."""
    # float32: Keras's torch matmul would cast float64 weights to a float32 copy (above), and
    # the pullback must keep the weights themselves as they were
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((3,), dtype="float32"),
                              keras.layers.Dense(5, activation="tanh", dtype="float32"),
                              keras.layers.Dense(2, dtype="float32")])
    x, u = rand(4, 3, seed=42, dtype="float32"), rand(4, 2, seed=43, dtype="float32")
    _, vjp_fn = vjp(model, x)
    expected = numpy(vjp_fn(u))
    model.set_weights([3 * w for w in model.get_weights()])
    close(vjp_fn(u), expected)
    _, fresh = vjp(model, x)
    assert not np.allclose(numpy(fresh(u)), expected)


def test_concurrent_calls_of_one_jacobian():
    """Threads share one Jacobian (PyTorch runs every call through the shared state)."""
    import sys
    import threading

    model = mlp()
    jac = jacobian(model, mode="rev", batched=True)
    xs = [rand(3, 4, seed=50 + i) for i in range(4)]
    expected = [numpy(jac(x)) for x in xs]
    errors: list = []

    def work(i):
        try:
            for _ in range(25):
                np.testing.assert_allclose(numpy(jac(xs[i])), expected[i], rtol=1e-12)
        except Exception as err:  # noqa: BLE001 - reported below, with its thread
            errors.append((i, err))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: a race shows within a few calls
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors


@pytest.mark.only_on("jax", "torch", reason="TensorFlow's run is test_cli's bench smoke test")
@pytest.mark.slow(reason="a Jacobian benchmark run with every baseline: ~15 s")
def test_bench_jacobian_runs_and_agrees_with_its_baselines():
    from pergrad.bench import jacobian as bench

    rows = bench.run(quick=True)
    baselines = (["jax.vmap(jacrev)", "jacrev of sum"] if ON_JAX
                 else ["autograd loop", "torch.func jacrev"])
    others = {"jax.vmap(jacfwd)"} if ON_JAX else set()
    assert {r["method"] for r in rows} == {*baselines, *others, "pergrad rev", "pergrad fwd",
                                           "pergrad auto"}
    for r in rows:  # float32 models: every method's Jacobian equals the second baseline's
        assert r["max_abs_diff_vs_baseline_2"] < 1e-5, r
    assert f"x vs {baselines[1]}" in bench.markdown(rows)


def test_bench_jacobian_header_names_the_framework_and_its_version():
    """``python benchmarks/bench_jacobian.py`` printed its header after the run from
    ``tf.__version__``, which the lazy TensorFlow module does not forward: it failed there."""
    from pergrad.bench import jacobian as bench

    line = bench.header()
    framework = "PyTorch" if ON_TORCH else "JAX" if ON_JAX else "TensorFlow"
    assert line.startswith(framework + " ") and keras.__version__ in line


@tf_only
@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_unknown_batch_output_mismatch_fails_at_run_time(mode):
    # With a free batch dimension the output's batch size is only known when running.
    jac = jacobian(
        lambda x: xp.tanh(x[:2]),
        mode=mode,
        batched=True,
        input_signature=[tf.TensorSpec([None, 3], F64)],
    )
    close(jac(rand(2, 3)), oracle_batch_jacobian(lambda x: xp.tanh(x[:2]), rand(2, 3)))
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="output of f does not keep the batch size"
    ):
        jac(rand(4, 3))


@tf_only
@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_static_batch_with_an_output_of_unknown_batch_fails_at_run_time(mode):
    """A static input batch, an output whose batch only running tells (a boolean mask): the
    rows kept must not be taken for examples 0, 1, ... of the batch."""
    jac = jacobian(lambda x: xp.tanh(tf.boolean_mask(x, x[:, 0] > 0)), mode=mode, batched=True)
    x = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.2], [2.0, -1.0, 0.3]])
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="output of f does not keep the batch size"
    ):
        jac(x)


def test_new_example_shape_traces_once_per_shape():
    def f(x):
        return xp.sin(x) * xp.sum(x)

    jac = jacobian(f)
    close(jac(rand(3, seed=1)), oracle_jacobian(f, rand(3, seed=1)))
    close(jac(rand(5, seed=2)), oracle_jacobian(f, rand(5, seed=2)))  # static 5, not relaxed
    jac(rand(3, seed=3))
    jac(rand(5, seed=4))
    assert jac.trace_count == 2


@tf_only
def test_input_signature():
    model = mlp()
    spec = tf.TensorSpec([None, 4], F64)
    jac = jacobian(model, batched=True, input_signature=[spec])
    for batch in (2, 5, 3):
        x = rand(batch, 4, seed=batch)
        close(jac(x), oracle_batch_jacobian(model, x))
    assert jac.trace_count == 1
    with pytest.raises(ValueError, match="non-batch dimension"):
        jacobian(model, batched=True, input_signature=[tf.TensorSpec([None, None], F64)])(
            rand(2, 4)
        )


def test_one_shot_helpers_trace_once_per_f():
    def f(x):
        return xp.sum(xp.sin(x) ** 2)

    for seed in range(4):
        x, t = rand(5, seed=seed), rand(5, seed=seed + 10)
        jvp(f, x, t)
        _, vjp_fn = vjp(f, x)
        vjp_fn(keras.ops.convert_to_tensor(1.0, F64))
        hvp(f, x, t)
    assert trace_counts(f) == {"jvp": 1, "forward": 1, "vjp": 1, "hvp": 1}


def test_one_shot_cache_does_not_keep_f_alive():
    import gc
    import weakref

    def make():
        def f(x):
            return xp.sum(x**2)

        jvp(f, rand(2), rand(2))
        return weakref.ref(f)

    ref = make()
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------------------------------------
# Errors


def test_error_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of 'auto', 'rev', 'fwd'.*'reverse'"):
        jacobian(xp.sin, mode="reverse")


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_error_bad_chunk_size(bad):
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        jacobian(xp.sin, chunk_size=bad)


def test_error_non_float_input_names_the_argument():
    with pytest.raises(TypeError, match=r"args\[0\]\['b'\] has dtype int32.*floating"):
        jacobian(lambda d: d["a"])({"a": rand(2), "b": np.int32([1, 2])})
    with pytest.raises(TypeError, match=r"primals\[0\] has dtype int32"):
        jvp(xp.sin, np.int32([1, 2]), np.int32([1, 2]))


def test_error_non_float_output():
    with pytest.raises(TypeError, match="output.*int(32|64).*floating outputs"):
        jacobian(lambda x: xp.argmax(x))(rand(3))


def test_error_batched_mismatched_batch_sizes():
    with pytest.raises(ValueError, match=r"args\[0\] has batch size 4 and args\[1\] has 5"):
        jacobian(lambda a, b: a + b[:4], batched=True)(rand(4, 2), rand(5, 2))


def test_error_batched_output_without_batch():
    with pytest.raises(ValueError, match="leading dimension 1 while the inputs have batch size 4"):
        jacobian(lambda x: xp.sum(x, axis=0, keepdims=True), batched=True)(rand(4, 2))
    with pytest.raises(ValueError, match="scalar"):
        jacobian(lambda x: x, batched=True)(rand())


def test_error_training_on_plain_function():
    with pytest.raises(ValueError, match="training=True applies to Keras layers"):
        jacobian(xp.sin, training=True)


def test_error_argnums_out_of_range():
    with pytest.raises(ValueError, match="argnums=2 refers to argument 2"):
        jacobian(lambda a, b: a * b, argnums=2)(rand(2), rand(2))


def test_error_hessian_needs_scalar():
    with pytest.raises(ValueError, match="must return a scalar"):
        hessian(xp.sin)(rand(3))
    with pytest.raises(ValueError, match="one scalar per example"):
        hessian(xp.sin, batched=True)(rand(2, 3))


@not_tf
def test_jax_and_torch_refuse_input_signature_and_variables_as_jacobian_arguments():
    with pytest.raises(NotImplementedError, match="input_signature is a tf.function feature"):
        jacobian(xp.sin, input_signature=[object()])
    variable = keras.Variable(np.ones(3))
    with pytest.raises(TypeError, match=r"args\[0\] is a Keras variable.*jvp/vjp/hvp"):
        jacobian(lambda v: v * 2.0)(variable)


def test_error_tangent_structure():
    with pytest.raises(ValueError, match="tangents must have the same nested structure"):
        jvp(lambda d: d["a"], {"a": rand(2)}, {"b": rand(2)})
    with pytest.raises(ValueError, match="shape"):
        jvp(xp.sin, rand(2), rand(3))
