"""`pergrad.jacobian`'s compiled computations and one-shot products on the functional
backends, JAX and PyTorch, on a backend's ``vjp``, ``jvp``, ``grad`` and ``vmap``
(``backend.jax.jacobian``: ``jax.*``; ``backend.torch.jacobian``: ``torch.func.*``). The
Jacobian and Hessian math is `_modes`, the same on every backend; what is theirs is here: the
state a computation threads through f, its compilation per input structure (`Dispatch`), and
``jvp``, ``vjp`` (a pullback that leaves the compiled call) and ``hvp``.

**State.** A compiled computation reads the values of the Keras variables f uses (a Keras
layer's ``variables``, and any other variable f was seen to read) as arguments: on JAX those of
its ``jax.jit`` (:func:`pergrad.backend.jax.engine.compile_function`), so new weights are read at
every call without retracing, never baked in as constants; on PyTorch, which runs eagerly, a
copy of their current values at every call, detached from autograd (the weights are constants
of the derivative, and a pullback kept past the call keeps the values it ran with). The
functions differentiated are pure: f runs inside them under a ``keras.StatelessScope``
(:class:`_Reads`) mapping those variables to their values, so what f assigns (dropout seed
states, BatchNorm's moving statistics with ``training=True``) leaves the ``vjp``/``jvp`` as an
auxiliary output, never as a tracer stored in a variable, and is written back once per call. The scope notes any other variable f reads or writes; a call that met one is
abandoned (on JAX before XLA compiles it; its writes are dropped) and run again with that
variable among the arguments.

"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable
from types import ModuleType
from typing import Any

import keras

from pergrad import backend
from pergrad._compat import is_keras_variable
from pergrad.jacobian._cache import compiled_for
from pergrad.jacobian._call import make_caller, primal_args
from pergrad.jacobian._structure import leaf_paths, single_output, to_tensor


def _backend() -> ModuleType:
    """The running backend's primitives: ``compile``, ``is_array``, ``is_float_array``,
    ``detach``, ``vjp``, ``jvp``, ``grad``, ``stack_map``, ``eval_shape``, ``basis``,
    ``zeros_like``, ``zeros``, ``reshape``, ``moveaxis``, ``cast``, ``as_array``, ``sum``."""
    return backend.part("jacobian")


# -- structures and the user's f: as Keras and Python have them ------------------------------
flatten = keras.tree.flatten
pack_as = keras.tree.pack_sequence_as


def convert_leaf(x: Any) -> Any:
    """``x`` as a tensor of the backend; a Keras variable passes unchanged."""
    return x if is_keras_variable(x) else keras.ops.convert_to_tensor(x)


def user_function(f: Callable[..., Any]) -> Callable[..., Any]:
    """f as it is: JAX traces Python control flow, PyTorch runs it."""
    return f


# -- Keras variables as values ----------------------------------------------------------------
class _Reads(keras.StatelessScope):
    """A StatelessScope over given values that notes every other Keras variable used."""

    def __init__(self, pairs: list, unmapped: dict) -> None:
        super().__init__(state_mapping=pairs)
        self._initial = dict(self.state_mapping)
        self._unmapped = unmapped

    def get_current_value(self, variable: Any) -> Any:
        value = super().get_current_value(variable)
        if value is None:
            self._unmapped.setdefault(id(variable), variable)
        return value

    def add_update(self, update: tuple) -> None:
        if id(update[0]) not in self._initial:
            self._unmapped.setdefault(id(update[0]), update[0])
        super().add_update(update)

    def writes(self, variables: list) -> list:
        """What f assigned to each of `variables`; None where it assigned nothing."""
        out = []
        for v in variables:
            value = self.state_mapping.get(id(v))
            out.append(None if value is self._initial.get(id(v)) else value)
        return out


class State:
    """The Keras variables a compiled computation reads besides its arguments."""

    def __init__(self, f: Any) -> None:
        self.variables: list = list(f.variables) if isinstance(f, keras.Layer) else []
        self.unmapped: dict[int, Any] = {}
        self.values: list = []  # while tracing: the traced values of `variables`
        # PyTorch runs every call through `_tracing` (nothing is traced once and kept): its
        # calls hold this lock, as they share `values`, `unmapped` and `variables`.
        self.lock = threading.RLock()

    def learn(self) -> bool:
        """Adds the variables f used unmapped; True when there were new ones."""
        known = {id(v) for v in self.variables}
        new = [v for key, v in self.unmapped.items() if key not in known]
        self.unmapped.clear()
        self.variables.extend(new)
        return bool(new)


_ACTIVE = threading.local()  # the State of the computation being traced


@contextlib.contextmanager
def _tracing(state: State):
    previous = getattr(_ACTIVE, "state", None)
    _ACTIVE.state = state
    state.values = [v.value for v in state.variables]  # as the backend's `compile` maps them
    try:
        yield
    finally:
        _ACTIVE.state = previous
        state.values = []


def stateless(fn: Callable[[Any], Any], bind: Callable[[Any], list] | None = None):
    """``fn`` as a pure function ``d -> (fn(d), writes)`` of the traced computation's state.

    ``bind(d)`` gives further (variable, value) pairs to map (primals that are variables).
    `keep` writes ``writes`` back."""
    state = _ACTIVE.state
    variables, values = list(state.variables), list(state.values)

    def pure(d: Any) -> tuple[Any, list]:
        pairs = list(zip(variables, values, strict=True)) + (bind(d) if bind else [])
        with _Reads(pairs, state.unmapped) as scope:
            y = fn(d)
        return y, scope.writes(variables)

    return pure


def pure(fn: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, list]]:
    """``fn`` as ``d -> (fn(d), writes)`` for `pergrad.jacobian._modes`: `stateless` inside
    a computation of this module (JAX, PyTorch); on TensorFlow, whose trace reads and writes
    the variables itself, ``fn`` with no writes."""
    if getattr(_ACTIVE, "state", None) is None:
        return lambda d: (fn(d), [])
    return stateless(fn)


def keep(writes: list) -> None:
    """Assigns what f wrote (see `stateless`) in the compiled call's scope, from where
    the backend's ``compile`` writes it to the variables after the call (nothing on
    TensorFlow: no writes, see `pure`)."""
    if not writes:
        return
    variables = _ACTIVE.state.variables
    for variable, value in zip(variables, writes, strict=True):
        if value is not None:
            variable.assign(value)


def first_writes(stacked_writes: list) -> list:
    """Writes from a vmapped or chunked product: every product wrote the same; keep one."""
    return [None if w is None else w[0] for w in stacked_writes]


# -- compilation ------------------------------------------------------------------------------
class _Retrace(Exception):
    """A trace used a Keras variable that is not among its arguments yet."""


def _static_key(leaf: Any) -> Hashable:
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))  # the compiled object's template keeps `leaf` alive
    return (type(leaf).__name__, leaf)


def structural_key(args: tuple, batched: bool) -> Hashable:
    """Nesting, dtypes, the shapes that fix the Jacobian's layout (all but the batch dimension
    when batched; ``jax.jit`` traces each batch size itself) and the Python values of `args`."""
    B = _backend()
    leaves = flatten(args)
    keys = []
    for leaf in leaves:
        if B.is_array(leaf):
            shape = tuple(leaf.shape)
            keys.append(("T", str(leaf.dtype), (None, *shape[1:]) if batched and shape else shape))
        else:
            keys.append(("P", _static_key(leaf)))
    return repr(pack_as(args, [0] * len(leaves))), tuple(keys)


class Compiled:
    """``run(*args)`` as one ``jax.jit`` over the arrays in args and the values of `state`'s
    variables (on PyTorch: run eagerly on their current values); other leaves of args (Python
    values) are constants of the trace, so call it with the same ones each time (`Dispatch`
    keys by them). `trace_count` counts the traces kept (a trace abandoned to add a variable
    is not counted; on PyTorch, which traces nothing, it is 1 once the first call ran)."""

    def __init__(self, run: Callable[..., Any], state: State, *, all_arrays: bool = False) -> None:
        self.trace_count = 0
        self._run = run
        self._state = state
        self._all_arrays = all_arrays  # args are pytrees of arrays (jax.jit flattens them)
        self._template: tuple | None = None
        self._call: Callable[..., Any] | None = None

    def _body(self, *dynamic: Any) -> Any:
        if self._all_arrays:
            args = dynamic
        else:
            structure, leaves, arrays = self._template
            it = iter(dynamic)
            full = [next(it) if a else leaf for leaf, a in zip(leaves, arrays, strict=True)]
            args = pack_as(structure, full)
        with _tracing(self._state):
            out = self._run(*args)
        if self._state.learn():
            raise _Retrace
        if _backend().TRACES or not self.trace_count:
            self.trace_count += 1  # PyTorch: counts the one build, not every eager run
        return out

    def __call__(self, *args: Any) -> Any:
        if self._all_arrays:
            dynamic = args
        else:
            leaves = flatten(args)
            arrays = [_backend().is_array(leaf) for leaf in leaves]
            dynamic = [leaf for leaf, a in zip(leaves, arrays, strict=True) if a]
            if self._template is None:
                constants = [None if a else leaf for leaf, a in zip(leaves, arrays, strict=True)]
                self._template = (args, constants, arrays)
        if self._call is None:
            self._call = _backend().compile(self._state, self._body)
        while True:
            try:
                return self._call(*dynamic)
            except _Retrace:
                continue  # traced again with the new variables' values as arguments


class Dispatch:
    """One `Compiled` per structural key, sharing what they learn about f's variables."""

    def __init__(self, build: Callable[[Hashable], Callable[..., Any]], f: Any) -> None:
        self._build = build
        self._state = State(f)
        self._by_key: dict[Hashable, Compiled] = {}
        self._lock = threading.Lock()

    @property
    def trace_count(self) -> int:
        return sum(c.trace_count for c in self._by_key.values())

    def __call__(self, key: Hashable, *args: Any) -> Any:
        compiled = self._by_key.get(key)
        if compiled is None:
            with self._lock:
                compiled = self._by_key.setdefault(key, Compiled(self._build(key), self._state))
        return compiled(*args)


def dispatch(build: Callable[[Hashable], Callable[..., Any]], f: Any, *, name: str,
             jit_compile: bool) -> Dispatch:
    """One `Compiled` per structural key (``jit_compile`` means nothing here: XLA compiles
    everything on JAX, nothing is compiled on PyTorch)."""
    del name, jit_compile
    return Dispatch(build, f)


def signature_function(run: Callable[..., Any], *, name: str, jit_compile: bool,
                       input_signature: Any, what: str) -> Any:
    """No such thing: ``input_signature`` is a ``tf.function`` feature."""
    del run, name, jit_compile, input_signature
    raise NotImplementedError(
        f"{what}: input_signature is a tf.function feature and has no meaning on JAX, where "
        "jax.jit compiles once per input shape (a new batch size traces once more), or on "
        "PyTorch, where nothing is compiled. Leave input_signature=None."
    )


def convert_argument(arg: Any, pos: int, what: str) -> Any:
    """A differentiated argument: float arrays pass; others are converted or refused."""
    if _backend().is_float_array(arg):
        return arg
    paths = leaf_paths(arg, f"args[{pos}]")
    converted = [to_tensor(leaf, p, what) for leaf, p in zip(flatten(arg), paths, strict=True)]
    for leaf, p in zip(converted, paths, strict=True):
        if is_keras_variable(leaf):
            raise TypeError(
                f"{what}: {p} is a Keras variable; this transform differentiates with respect "
                "to array arguments. Pass keras.ops.convert_to_tensor(v) and use it inside f, "
                "or use pergrad.jacobian.jvp/vjp/hvp, which accept variables."
            )
    return pack_as(arg, converted)


# -- one-shot products: jvp, vjp, hvp -----------------------------------------------------------
class _Layout:
    """Where the Keras variables sit among the primal leaves, and the primals' nesting: the
    part of one call's primals that a compiled product keeps (its cache key holds the
    variables' identities)."""

    def __init__(self, structure: Any, slots: list) -> None:
        self.structure = structure
        self.slots = slots
        self.key = (repr(structure), tuple(None if v is None else id(v) for v in slots))

    def pack(self, flat: list) -> tuple:
        return pack_as(self.structure, flat)

    def bound(self, call: Callable[..., Any]):
        """(fn, bind) for `stateless`: f of the flat primal arrays, the variables mapped to
        their entries (f is called with the variables themselves)."""
        slots = self.slots

        def fn(flat: list) -> Any:
            leaves = [a if v is None else v for v, a in zip(slots, flat, strict=True)]
            return call(*self.pack(leaves))

        def bind(flat: list) -> list:
            return [(v, a) for v, a in zip(slots, flat, strict=True) if v is not None]

        return fn, bind


class _Primals:
    """One call's primals: every leaf as an array (a Keras variable's as its value) and their
    `_Layout`."""

    def __init__(self, args: tuple, what: str) -> None:
        if not args:
            raise ValueError(f"{what}: primals is an empty tuple; pass f's arguments.")
        leaves = flatten(args)
        self.paths = leaf_paths(args, "primals")
        converted = [to_tensor(leaf, p, what) for leaf, p in zip(leaves, self.paths, strict=True)]
        slots = [v if is_keras_variable(v) else None for v in converted]
        detach = _backend().detach
        self.arrays = [detach(v.value) if s is not None else v
                       for v, s in zip(converted, slots, strict=True)]
        self.layout = _Layout(pack_as(args, list(range(len(leaves)))), slots)

    def pack(self, flat: list) -> tuple:
        return self.layout.pack(flat)

    def match(self, other: Any, name: str, what: str) -> list:
        """Flat tangents/vectors checked against the primals' structure, dtypes and shapes."""
        other_args, _ = primal_args(other)
        try:
            keras.tree.assert_same_structure(self.layout.structure, other_args)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"{what}: {name} must have the same nested structure as primals. {err}"
            ) from err
        out = []
        paths = [p.replace("primals", name, 1) for p in self.paths]
        for p, t, path in zip(self.arrays, flatten(other_args), paths, strict=True):
            t = _backend().as_array(t, p)
            if t.dtype != p.dtype:
                raise TypeError(f"{what}: {path} has dtype {t.dtype}, primal has {p.dtype}.")
            if t.shape != p.shape:
                raise ValueError(f"{what}: {path} has shape {t.shape}, primal has shape "
                                 f"{p.shape}.")
            out.append(t)
        return out


def _compiled(f: Any, kind: str, training: bool, primals: _Primals,
              make_run: Callable[[Callable[..., Any], _Layout], Callable[..., Any]]) -> Compiled:
    layout = primals.layout

    def build(f_ref: Callable[[], Any]) -> Compiled:
        def run(*args: Any) -> Any:
            return make_run(make_caller(f_ref(), training, kind), layout)(*args)

        return Compiled(run, State(f_ref()), all_arrays=True)

    return compiled_for(f, kind, (bool(training), layout.key), build)


def _jvp_run(call, layout):
    def run(arrays, tangents):
        fn, bind = layout.bound(call)
        y, out, writes = _backend().jvp(stateless(fn, bind), (arrays,), (tangents,))
        keep(writes)
        return y, out
    return run


def _forward_run(call, layout):
    def run(arrays):
        fn, bind = layout.bound(call)
        y, pullback, writes = _backend().vjp(stateless(fn, bind), arrays)
        keep(writes)
        return y, pullback  # a pytree: it leaves the jit and enters the next one
    return run


def _backward_run(call, layout):
    def run(pullback, cotangents):
        return pullback(cotangents)[0]
    return run


def _hvp_run(call, layout):
    def run(arrays, vectors):
        fn, bind = layout.bound(call)
        pure = stateless(fn, bind)

        def objective(a):
            y, writes = pure(a)
            return single_output(y, False, "hvp"), writes

        B = _backend()
        _, hv, writes = B.jvp(B.grad(objective), (arrays,), (vectors,))
        keep(writes)
        return hv
    return run


def jvp_product(f: Any, primals: Any, tangents: Any, *, training: bool) -> tuple[Any, Any]:
    """``(f(x), J(x) t)`` (see `pergrad.jacobian.jvp`)."""
    args, _ = primal_args(primals)
    prim = _Primals(args, "jvp")
    tans = prim.match(tangents, "tangents", "jvp")
    return _compiled(f, "jvp", training, prim, _jvp_run)(prim.arrays, tans)


def vjp_product(f: Any, primals: Any, *, training: bool) -> tuple[Any, Callable[[Any], Any]]:
    """``(f(x), vjp_fn)``; ``vjp_fn`` runs only the backward pass (see `pergrad.jacobian.vjp`)."""
    args, was_tuple = primal_args(primals)
    prim = _Primals(args, "vjp")
    outputs, pullback = _compiled(f, "forward", training, prim, _forward_run)(prim.arrays)
    backward = _compiled(f, "vjp", training, prim, _backward_run)

    def vjp_fn(cotangents: Any) -> Any:
        try:
            keras.tree.assert_same_structure(outputs, cotangents)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"vjp_fn: cotangents must be structured like f's outputs. {err}"
            ) from err
        as_array = _backend().as_array
        cts = keras.tree.map_structure(lambda y, u: as_array(u, y, cast=True), outputs,
                                       cotangents)
        for y, u in zip(flatten(outputs), flatten(cts), strict=True):
            if u.shape != y.shape:
                raise ValueError(
                    f"vjp_fn: a cotangent has shape {u.shape}, the matching output {y.shape}."
                )
        grads = prim.pack(backward(pullback, cts))
        return grads if was_tuple else grads[0]

    return outputs, vjp_fn


def hvp_product(f: Any, primals: Any, vectors: Any, *, training: bool) -> Any:
    """``H(x) v``, forward-over-reverse (see `pergrad.jacobian.hvp`)."""
    args, was_tuple = primal_args(primals)
    prim = _Primals(args, "hvp")
    vecs = prim.match(vectors, "vectors", "hvp")
    out = prim.pack(_compiled(f, "hvp", training, prim, _hvp_run)(prim.arrays, vecs))
    return out if was_tuple else out[0]
