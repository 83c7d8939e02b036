"""The PyTorch primitives of `pergrad.jacobian._modes` and `pergrad.jacobian._functional`: ``torch.func.vjp``, ``jvp``,
``grad`` and ``vmap``, run eagerly.

Nothing is compiled: Keras's torch backend runs eagerly, and a built `Jacobian` is reused by
keeping its Python function, not a trace (``trace_count`` counts one build per input
structure). Each call reads a copy of the current values of the Keras variables f uses,
detached from autograd: the weights are constants of the derivative (differentiate with
respect to them by passing them as primals of `jvp`, `vjp` or `hvp`), and a `vjp` pullback
keeps the values it ran with when the weights change later. What f assigns (dropout seed
states, moving statistics) is held back during the call and written once after it, so a call
abandoned to learn a new variable writes nothing. Calls of one computation from several
threads take turns (``State.lock``).

Random layers: every product of one call draws the same dropout mask, as on the other
backends. A seeded layer reads the same seed state in each (the scope maps it); an unseeded
Keras dropout draws from torch's global generator, which ``vmap(randomness="same")`` draws
once per vmap and which is put back to its state at the call's start before every vmap and
every product run alone (:func:`_replaying_randomness`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import pergrad
from pergrad._compat import torch_convolutions_in_vmap
from pergrad.engine.functional import assign_written, stateless
from pergrad.jacobian._functional import (  # noqa: F401 - what JAX and PyTorch share
    convert_argument,
    convert_leaf,
    dispatch,
    flatten,
    hvp_product,
    jvp_product,
    pack_as,
    signature_function,
    structural_key,
    user_function,
    vjp_product,
)
from pergrad.jacobian._structure import (
    jvp_through_zeros,
    no_batch_assert,
    no_dependencies,
    num_elements,
    pull_through_zeros,
    static_batch_size,
)

TRACES = False  # eager: nothing is traced, `trace_count` counts the one build


def compile(state: Any, body: Callable[..., Any]) -> Callable[..., Any]:
    """``body(*args)`` run eagerly on copies of the current values of ``state.variables``
    (`detach`); what the body assigned is written to the variables after it returns."""

    def call(*args: Any) -> Any:
        # NumPy arrays reach f as tensors, as tf.function and jax.jit pass them (a NumPy
        # array times a torch tensor fails)
        args = keras.tree.map_structure(_tensor_if_numpy, args)
        with state.lock, _replaying_randomness():
            variables = list(state.variables)
            with stateless(variables, [detach(v.value) for v in variables]) as scope:
                out = body(*args)
                writes = scope.written(variables)
            assign_written(variables, writes)
        return out

    return call


def _tensor_if_numpy(leaf: Any) -> Any:
    return keras.ops.convert_to_tensor(leaf) if isinstance(leaf, (np.ndarray, np.generic)) \
        else leaf


_CALL = threading.local()  # the random generators' states at the start of the running call


def _generator_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_generator_states(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _same_states(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (
        a[1] is None or all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)))


@contextlib.contextmanager
def _replaying_randomness():
    """Notes torch's generator states at the start of a call, for :func:`_replay`, and leaves
    them after the call as the call's first draws left them: the next call draws anew."""
    previous = getattr(_CALL, "states", None)
    _CALL.states = [_generator_states(), None]  # at the start; after the first draws
    try:
        yield
        after = _CALL.states[1]
        if after is not None:
            _set_generator_states(after)
    finally:
        _CALL.states = previous


def _replay() -> None:
    """Puts torch's generators back to their states at the start of the running call, so that
    every product draws what the call's first draws drew (noting, the first time, where those
    draws left the generators)."""
    states = getattr(_CALL, "states", None)
    if states is None:
        return
    start, after = states
    if after is None:
        now = _generator_states()
        if not _same_states(now, start):
            states[1] = now
    _set_generator_states(start)


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, (torch.Tensor, np.ndarray, np.generic))


def is_float_array(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point()


def detach(value: Any) -> Any:
    """A copy outside autograd: Keras assigns torch variables in place, so a view would
    change under a pullback kept past the call."""
    return value.detach().clone()


def as_array(value: Any, like: Any, *, cast: bool = False) -> Any:
    """`value` as a tensor of `like`'s dtype and device; a tensor passes unchanged unless
    ``cast``."""
    if isinstance(value, torch.Tensor) and not cast:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype=like.dtype, device=like.device)
    return torch.as_tensor(np.asarray(value), dtype=like.dtype, device=like.device)


class _Holes:
    """Sets the None leaves of a structure aside and puts them back: ``torch.func``'s
    transforms and ``vmap`` take tensors only, and f's writes are None where it wrote nothing."""

    def __init__(self) -> None:
        self._template: tuple | None = None

    def take(self, tree: Any) -> list:
        leaves = keras.tree.flatten(tree)
        self._template = (tree, [leaf is None for leaf in leaves])
        return [leaf for leaf in leaves if leaf is not None]

    def put(self, tensors: list) -> Any:
        tree, holes = self._template
        it = iter(tensors)
        return keras.tree.pack_sequence_as(tree, [None if hole else next(it) for hole in holes])


def _with_tensor_aux(fn: Callable[..., tuple[Any, Any]], holes: _Holes) -> Callable:
    def wrapped(*args: Any) -> tuple[Any, list]:
        y, aux = fn(*args)
        return y, holes.take(aux)

    return wrapped


def vjp(fn: Callable[[Any], tuple[Any, Any]], x: Any) -> tuple[Any, Callable, Any]:
    """``(y, pullback, aux)`` for ``fn(x) = (y, aux)``; attention on its math kernel (`jvp`)."""
    holes = _Holes()
    with sdpa_kernel(SDPBackend.MATH):
        y, pullback, aux = torch.func.vjp(_with_tensor_aux(fn, holes), x, has_aux=True)
    return y, pullback, holes.put(aux)


def jvp(fn: Callable[..., tuple[Any, Any]], primals: tuple, tangents: tuple) -> tuple:
    """``(y, J t, aux)`` for ``fn(*primals) = (y, aux)``.

    Scaled dot-product attention runs on its math kernel here and in `vjp`: PyTorch's fused
    CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``, which Keras's
    ``MultiHeadAttention`` reaches) has no forward-mode derivative, and its backward no vmap
    batching rule (vmap would loop over the cotangents)."""
    holes = _Holes()
    with sdpa_kernel(SDPBackend.MATH):
        y, out, aux = torch.func.jvp(_with_tensor_aux(fn, holes), primals, tangents,
                                     has_aux=True)
    return y, out, holes.put(aux)


def grad(fn: Callable[[Any], tuple[Any, Any]]) -> Callable[[Any], tuple[Any, Any]]:
    """``x -> (d fn(x)[0] / dx, aux)``."""
    holes = _Holes()
    inner = torch.func.grad(_with_tensor_aux(fn, holes), has_aux=True)

    def gradient(x: Any) -> tuple[Any, Any]:
        g, aux = inner(x)
        return g, holes.put(aux)

    return gradient


def eval_shape(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)``, run once without autograd: PyTorch has no abstract evaluation (one more
    forward pass per call in forward mode and for Hessians)."""
    _replay()
    with torch.no_grad():
        return fn(x)


def stack_map(fn: Callable[[Any], Any], n: int, chunk_size: int | None, like: Any) -> Any:
    """``fn(i)`` for i in range(n), stacked along a new first axis by one ``torch.func.vmap``
    (``chunk_size`` indices at a time when given); None leaves of ``fn``'s result stay None.

    Keras's torch convolutions copy their input to channels-last memory, which vmap refuses
    inside a forward-mode product: the vmap runs in `pergrad._compat.torch_convolutions_in_vmap`,
    which skips that copy. Where vmap still cannot run f (another op without a batching rule),
    the same products run one at a time, with a warning: the same numbers, n times the calls."""
    holes = _Holes()
    indices = torch.arange(n, device=like.device)
    _replay()
    try:
        with torch_convolutions_in_vmap():
            stacked = torch.func.vmap(lambda i: holes.take(fn(i)), randomness="same",
                                      chunk_size=chunk_size)(indices)
    except RuntimeError as err:
        if "vmap" not in str(err):
            raise
        _warn_unvectorized(err, n)
        rows = []
        for i in indices:
            _replay()
            rows.append(holes.take(fn(i)))
        stacked = [torch.stack(leaves) for leaves in zip(*rows, strict=True)]
    return holes.put(stacked)


def _warn_unvectorized(err: RuntimeError, n: int) -> None:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # Keras bolds the op's message
    lines = [line.strip() for line in plain.splitlines() if line.strip()]
    reason = next((line for line in lines if "vmap" in line), lines[0])
    warnings.warn(
        f"pergrad.jacobian: torch.func.vmap cannot run f ({reason[:200]}); its {n} products "
        "run one at a time instead (the same numbers, slower).", stacklevel=_caller_level())


_PACKAGE = os.path.dirname(os.path.abspath(pergrad.__file__))  # the frames to step over


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside pergrad: the user's call."""
    frame, level = inspect.currentframe().f_back, 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def basis(index: Any, shape: list[int], dtype: Any, like: Any) -> Any:
    """The one-hot e_index of `shape` (a comparison with ``arange``: ``one_hot`` has no batching
    rule), broadcast to the shape of `like` if given (batched)."""
    size = num_elements(shape)
    e = torch.reshape((torch.arange(size, device=index.device) == index).to(dtype), shape)
    return e if like is None else e.expand(like.shape)


def one_example(t: Any, index: Any) -> Any:
    """``t[index:index + 1]`` for a scalar index tensor."""
    return torch.index_select(t, 0, torch.reshape(index, [1]))


def zeros(shape: list[int], dtype: Any, like: Any) -> Any:
    return torch.zeros(shape, dtype=dtype, device=like.device)


zeros_like = torch.zeros_like
reshape = torch.reshape
moveaxis = torch.movedim
sum = torch.sum  # noqa: A001 - the primitive's name in every backend module


def cast(t: Any, dtype: Any) -> Any:
    return t.to(dtype)


# -- what `pergrad.jacobian._modes` needs beyond the transforms: shapes are static here ------
batch_size = static_batch_size
batch_assert = no_batch_assert
depending_on = no_dependencies
pull_one = pull_through_zeros
jvp_along = jvp_through_zeros
