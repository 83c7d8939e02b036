"""What every backend package exports: the :class:`Backend` protocol; what its ``engine``,
``trainer`` and ``jacobian`` modules export: :class:`Engine`, :class:`Trainer` and
:class:`JacobianPrimitives` (:class:`FunctionalPrimitives` on JAX and PyTorch).

``pergrad.backend.tensorflow``, ``pergrad.backend.jax`` and ``pergrad.backend.torch`` are packages
with these names, as Keras's own ``keras/src/backend/{tensorflow,jax,torch}`` are; the running
one is chosen once (:func:`pergrad.backend.native`). Everything above ``backend/`` asks that
module instead of testing which backend runs. ``tests/test_backend_protocol.py`` checks that each
package exports every name below with the same parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from pergrad.backend.routes import Routes


class Backend(Protocol):
    """The primitives one Keras backend gives the rest of pergrad."""

    #: The Keras backend's name: ``"tensorflow"``, ``"jax"`` or ``"torch"``.
    NAME: str
    #: Keras's recurrent loop holds ``h_{t-1}`` at a masked step (else the previous output).
    RNN_MASK_HOLDS_STATE: bool
    #: Keras's loop returns ``go_backwards`` sequences in the input's order.
    RNN_BACKWARDS_IN_INPUT_ORDER: bool
    #: The backend's route choices (:class:`pergrad.backend.routes.Routes`).
    ROUTES: Routes

    # --- arrays -----------------------------------------------------------------------------
    def matmul_ta(self, a: Any, b: Any) -> Any:
        """``a^T b`` over the last two axes, batched over the leading ones."""

    def outer_products(self, a: Any, d: Any) -> Any:
        """``m[b, i, g, o] = a[b, i, g] d[b, g, o]``."""

    def segment_sum(self, values: Any, segments: Any, num_segments: Any) -> Any:
        """``out[n] = sum_{k: segments[k] = n} values[k]``."""

    def row_squared_norms(self, t: Any) -> Any:
        """``(B,)``: ``||t[i]||^2`` over every axis but the first."""

    def vjp(self, fn: Callable[[Any], Any], primal: Any, cotangent: Any) -> Any:
        """``d/dp <fn(p), cotangent>`` at ``p = primal``."""

    def map_in_chunks(self, fn: Callable[..., Any], arrays: tuple, chunk: int) -> Any:
        """``fn(*arrays)``, possibly over consecutive chunks of ``chunk`` rows."""

    def concatenate_over_range(self, fn: Callable[[Any], Any], count: int) -> Any:
        """``concatenate([fn(k) for k in range(count)])`` of ``(1, ...)`` results: one rolled
        loop where a compiler would otherwise compile ``fn`` ``count`` times (JAX). ``k`` is a
        Python ``int`` or a traced ``int32`` scalar; ``fn`` must keep its side effects (variable
        writes, added losses) in a scope of its own: nothing traced may leave a rolled loop."""

    def unique_row_squared_norms(self, ids: Any, flat_d: Any, num_rows: int) -> Any:
        """``(B,)``: an embedding table's per-example squared norms by a native ``unique`` over
        the (example, row) keys (where ``ROUTES.embedding_norms`` is ``"unique"``)."""

    def image_patches(self, x: Any, kernel_size: Any, strides: Any, dilation: Any,
                      padding: str) -> Any:
        """``(B, out_h, out_w, K C)`` patches of a channels-last 2-D input by a native kernel,
        or ``None`` where the backend has none worth taking."""

    def recurrence(self, body: Callable, extras: int, elems: tuple, zero: Any, states: tuple,
                   sequences: bool) -> tuple:
        """A recurrent rule's loop over time-major ``elems``: ``(outputs or None, last output,
        final states, h_{t-1} stacked, extras stacked)``."""

    # --- native convolution kernels (taken where ``ROUTES`` says so) ---------------------------
    def grouped_filter_gradients_available(self, dtype: Any) -> bool:
        """Whether :meth:`grouped_filter_gradients` runs here for ``dtype`` now."""

    def grouped_filter_gradients(self, source: Any, d: Any, kernel_size: tuple, strides: tuple,
                                 padding: str) -> Any:
        """``(B, 1, O, K C)``: a convolution's per-example kernel gradients from one native
        filter gradient with the batch as groups (``source``: the input as the kernel pads it
        by ``padding``)."""

    def depthwise_filter_gradients(self, source: Any, d: Any, kernel_size: tuple,
                                   strides: tuple, dilation: tuple, padding: str,
                                   multiplier: int) -> Any:
        """``(B, C, M, K)``: a depthwise convolution's per-example kernel gradients from one
        native depthwise filter gradient, the batch folded into the channels."""

    def depthwise_products_by_forward_conv(self, padded: Any, d: Any, sizes: list,
                                           kernel_size: tuple, strides: tuple, dilation: tuple,
                                           multiplier: int) -> Any:
        """``(B, C, M, K)``: the same as one forward depthwise convolution of the padded input
        with the output gradient as its filter."""

    # --- random state outside Keras's seed generators --------------------------------------
    def generator_state(self) -> Any:
        """The state of the random generators a layer may draw from besides its Keras seed
        state (PyTorch's own, which Keras's unseeded dropout draws from), or ``None`` where a
        layer's non-trainable values hold all of it."""

    def replaying_generators(self, state: Any) -> contextlib.AbstractContextManager:
        """A block that draws from the generators as they were in ``state`` (one of
        :meth:`generator_state`), leaving them afterwards as they were before it."""

    # --- values and tracing -----------------------------------------------------------------
    def trace_token(self) -> Any:
        """What a cached intermediate belongs to, or ``None`` where no cache is needed."""

    def snapshot(self, t: Any) -> Any:
        """``t``'s value now, unchanged by later in-place writes."""

    def static_value(self, t: Any) -> Any:
        """``t``'s value where it is known now (not a symbolic tensor), else ``None``."""

    def assert_positive(self, t: Any, message: str) -> Any:
        """``t``, checked to be positive when the computation runs, where the value is not
        known while it is built; ``t`` unchanged where it always is."""

    def wide_float(self) -> str:
        """The widest float dtype the backend computes in now."""

    def full_float32(self) -> contextlib.AbstractContextManager:
        """A block in which float32 products round as float32 (no TensorFloat-32)."""

    def wide_scalar(self, value: float) -> Any:
        """``value`` as a scalar of :meth:`wide_float`, passed the cheapest way into a compiled
        function."""

    def is_tracing(self, x: Any) -> bool:
        """Whether a compiled function is being traced now (``x``: an input of it)."""

    def has_strategy(self) -> bool:
        """Whether a ``tf.distribute`` strategy scope is active."""

    def process_count(self) -> int:
        """The processes of one multi-process program that pergrad coordinates (JAX)."""

    def tensor_float_32(self) -> bool:
        """Whether float32 matmuls run as TensorFloat-32 by default here."""

    def layer_rounding(self, layer: Any, dtype: str) -> str:
        """The dtype whose rounding ``layer``'s output has when it computes in ``dtype``."""

    def replicas(self) -> Any:
        """The replicas a step's values are combined across (``.sum(values)``,
        ``.gather(t)``), or ``None`` where there are none to combine with (one replica, or
        values already global)."""

    # --- host state ------------------------------------------------------------------------------
    def host_call(self, fn: Callable[..., Any], results: list | None, *args: Any) -> Any:
        """``fn(*args)`` on the host with NumPy arguments, in program order, from inside or
        outside a compiled function; ``results``: its outputs' ``[(shape, dtype), ...]``
        (``None``: it returns nothing)."""

    def branch(self, predicate: Any, true_fn: Callable[[], Any],
               false_fn: Callable[[], Any]) -> Any:
        """``true_fn()`` where the scalar ``predicate`` holds, else ``false_fn()``."""

    def wait_for_host_callbacks(self) -> None:
        """Return once every dispatched :meth:`host_call` has run."""

    # --- noise keys and draws -----------------------------------------------------------------
    def check_noise_keys(self) -> None:
        """A ``ValueError`` saying what to do where noise keys cannot be held now (JAX without
        64-bit integers)."""

    def enable_noise_keys(self) -> None:
        """Let this process hold noise keys (JAX: turn on 64-bit integers; a program's
        first step, before any array is made)."""

    def new_key_state(self, seed: int) -> Any:
        """The state ``[seed, 0]`` of a stream of noise keys held outside a model."""

    def take_key(self, state: Any) -> Any:
        """The key ``[seed, counter]`` in a :meth:`new_key_state` state; its counter
        advances by one."""

    def next_key(self, state: Any, step: Any) -> Any:
        """The key held by the int64 variable ``state``; its counter advances by ``step``."""

    def gaussian_noise(self, key: Any, values: list, stddev: float) -> list:
        """``N(0, stddev^2 I)`` shaped like each of ``values``, stateless in ``key``."""


class Engine(Protocol):
    """``pergrad.backend.<name>.engine``: how one batch's per-example gradients are computed
    on this backend, under the backend-neutral tail of :mod:`pergrad.engine.assemble`."""

    #: The whole-model baselines by strategy name: ``"jacobian"``, ``"vmap"``, ``"loop"``.
    RUNNERS: dict

    def run_auto(self, model: Any, plan: Any, loss_fn: Any, x: Any, y: Any, sample_weight: Any,
                 training: bool, warned: set) -> Any:
        """One forward pass with taps at the layers ``plan`` names, one backward pass of the
        summed weighted loss to the taps, then each layer's rule (or the generic rule):
        a :class:`pergrad.engine.result.PerExampleResult`."""

    def batch_gradient(self, model: Any, loss_fn: Any, x: Any, y: Any, sample_weight: Any,
                       training: bool) -> list:
        """The gradient of ``sum_i w_i l_i`` with respect to the trainable variables."""

    def compile_function(self, model: Any, body: Callable[..., Any], on_trace: Callable[[], Any],
                         jit_compile: bool = False) -> Any:
        """``body`` compiled the backend's way over ``model``'s variables (TensorFlow: a
        ``tf.function``; JAX: one ``jax.jit`` over the variables' values; PyTorch: eager);
        ``on_trace()`` runs at each trace."""


class Trainer(Protocol):
    """``pergrad.backend.<name>.trainer``: the per-backend part of the one train step of
    :mod:`pergrad.keras.step`, and ``PerExampleModel``'s trainer base (``Trainer``), as Keras
    composes ``Model`` from its backend's trainer. (Each module's ``train_step`` takes Keras's
    arguments for that backend: ``(model, data)``, on JAX ``(model, state, data)``.)"""

    #: The step reads every variable through a scope that records their values (JAX, PyTorch).
    RECORD_VALUES: bool
    #: The base class of ``PerExampleModel``: the mixing state, ``fit``, ``train_on_batch``.
    Trainer: type
    #: Only the rows where ``counted`` holds, for Keras's metrics; ``None`` where shapes stay
    #: static and zero weights do it instead (JAX).
    kept_rows: Any

    def check_example_mixing(self, model: Any, engine: Any, x: Any, y: Any,
                             sample_weight: Any) -> list:
        """The first batch's example-mixing check: what the state changes wait for."""

    def after(self, checks: list) -> contextlib.AbstractContextManager:
        """A block whose state changes wait for ``checks``."""

    def replicas(self) -> int:
        """The replicas the optimizer sums over (``tf.distribute``), else 1."""

    def local_and_stats(self, model: Any, result: Any, batch: Any, indices: Any,
                        sample_weight: Any, extras: Any) -> tuple:
        """The aggregator's local part and the monitor's statistics where they are computed
        alongside it (else ``None``)."""

    def monitor(self, model: Any, result: Any, indices: Any, sample_weight: Any,
                extras: dict) -> dict:
        """The monitor's statistics of this step."""

    def apply(self, optimizer: Any, grads: list, variables: list, trainable: list) -> None:
        """``optimizer`` applies ``grads`` to ``variables``."""


class ModePrimitives(Protocol):
    """``pergrad.backend.<name>.jacobian`` on every backend: what :mod:`pergrad.jacobian._modes`
    computes Jacobians and Hessians with, inside one compiled trace or eager call."""

    def batch_size(self, t: Any) -> Any:
        """``t``'s leading dimension: an int when static, else a scalar tensor."""

    def batch_assert(self, t: Any, axis: int, batch: Any, message: str) -> Any:
        """An op failing at run time unless ``t.shape[axis] == batch`` (``None`` where shapes
        are always static)."""

    def depending_on(self, deps: list, t: Any) -> Any:
        """``t``, computed after the ops ``deps``."""

    def vjp(self, fn: Callable[[Any], tuple[Any, Any]], x: Any) -> tuple[Any, Callable, Any]:
        """``(y, pullback, aux)`` for ``fn(x) = (y, aux)``."""

    def pull_one(self, pullback: Callable, y: Any, k: int, u: Any) -> list:
        """The flat input gradient of the cotangent ``u`` on ``y``'s flat leaf ``k`` (zero on
        the others)."""

    def jvp_along(self, fn: Callable[[Any], tuple[Any, Any]], x: Any, index: int,
                  t: Any) -> tuple:
        """``(y, J t, aux)`` for ``fn(x) = (y, aux)`` along the tangent ``t`` of ``x``'s flat
        leaf ``index`` (zero on the others)."""

    def grad(self, fn: Callable[[Any], tuple[Any, Any]]) -> Callable[[Any], tuple[Any, Any]]:
        """``x -> (d fn(x)[0] / dx, aux)``."""

    def eval_shape(self, fn: Callable[[Any], Any], x: Any) -> Any:
        """``fn(x)``'s structure, shapes and dtypes."""

    def stack_map(self, fn: Callable[[Any], Any], n: int, chunk_size: int | None,
                  like: Any) -> Any:
        """``fn(i)`` for ``i`` in ``range(n)``, stacked (vectorized, or in chunks)."""

    def basis(self, index: Any, shape: list[int], dtype: Any, like: Any) -> Any:
        """The one-hot ``e_index`` of ``shape``, broadcast to ``like``'s shape if given."""

    def zeros(self, shape: list[int], dtype: Any, like: Any) -> Any:
        """Zeros of ``shape`` on ``like``'s device."""

    def one_example(self, t: Any, index: Any) -> Any:
        """``t[index:index + 1]`` for a (possibly traced, vectorized) scalar ``index``."""

    def zeros_like(self, t: Any) -> Any:
        """Zeros shaped like ``t``."""

    def reshape(self, t: Any, shape: Any) -> Any:
        """``t`` reshaped."""

    def moveaxis(self, t: Any, source: int, destination: int) -> Any:
        """``t`` with axis ``source`` moved to ``destination``."""

    def cast(self, t: Any, dtype: Any) -> Any:
        """``t`` as ``dtype``."""

    def sum(self, t: Any) -> Any:  # noqa: A003 - the primitive's name in every backend module
        """The sum of every element of ``t``."""


class JacobianPrimitives(ModePrimitives, Protocol):
    """``pergrad.backend.<name>.jacobian`` on every backend: besides the modes' primitives, what
    :mod:`pergrad.jacobian` walks structures, compiles and computes one-shot products with
    (``tf.function`` on TensorFlow, ``jax.jit`` on JAX, eager torch.func on PyTorch)."""

    def flatten(self, structure: Any) -> list:
        """The leaves of ``structure`` (dict keys sorted, None a leaf)."""

    def pack_as(self, structure: Any, leaves: list) -> Any:
        """``leaves`` nested like ``structure`` (the inverse of :meth:`flatten`)."""

    def convert_leaf(self, x: Any) -> Any:
        """``x`` as a tensor of the backend; the backend's variables pass unchanged."""

    def user_function(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """What a plain function f becomes before it is traced (AutoGraph on TensorFlow)."""

    def dispatch(self, build: Callable[[Hashable], Callable[..., Any]], f: Any, *, name: str,
                 jit_compile: bool) -> Any:
        """``(key, *args) -> build(key)(*args)``, compiled once per structural key and counting
        its traces (``trace_count``)."""

    def signature_function(self, run: Callable[..., Any], *, name: str, jit_compile: bool,
                           input_signature: Any, what: str) -> Any:
        """``run`` compiled once for a user's input signature (``NotImplementedError`` naming
        ``what`` where a backend has no such thing)."""

    def structural_key(self, args: tuple, batched: bool) -> Hashable:
        """What of ``args`` fixes a compiled Jacobian's layout (nesting, dtypes, shapes; all but
        the batch dimension when batched)."""

    def convert_argument(self, arg: Any, pos: int, what: str) -> Any:
        """A differentiated argument as floating tensors (``TypeError`` naming its path when
        it cannot be one)."""

    def jvp_product(self, f: Callable[..., Any], primals: Any, tangents: Any, *,
                    training: bool) -> tuple[Any, Any]:
        """``(f(x), J(x) t)``, compiled once per f (:func:`pergrad.jacobian.jvp`)."""

    def vjp_product(self, f: Callable[..., Any], primals: Any, *,
                    training: bool) -> tuple[Any, Callable[[Any], Any]]:
        """``(f(x), u -> u^T J(x))``, compiled once per f (:func:`pergrad.jacobian.vjp`)."""

    def hvp_product(self, f: Callable[..., Any], primals: Any, vectors: Any, *,
                    training: bool) -> Any:
        """``H(x) v`` of a scalar f, compiled once per f (:func:`pergrad.jacobian.hvp`)."""


class FunctionalPrimitives(JacobianPrimitives, Protocol):
    """``pergrad.backend.<name>.jacobian`` on JAX and PyTorch: besides the above, what
    :mod:`pergrad.jacobian._functional` (their shared ``dispatch`` and products) compiles with."""

    #: ``compile`` traces its body once per shape (JAX), or runs it eagerly (PyTorch).
    TRACES: bool

    def compile(self, state: Any, body: Callable[..., Any]) -> Callable[..., Any]:
        """``body(*args)`` compiled over ``args`` and the values of ``state.variables``."""

    def is_array(self, leaf: Any) -> bool:
        """Whether ``leaf`` is an array argument (not a Python constant of the trace)."""

    def is_float_array(self, leaf: Any) -> bool:
        """Whether ``leaf`` is a floating-point array of the backend."""

    def detach(self, value: Any) -> Any:
        """``value`` without autograd history."""

    def as_array(self, value: Any, like: Any, *, cast: bool = False) -> Any:
        """``value`` as an array of ``like``'s dtype."""

    def jvp(self, fn: Callable[..., tuple[Any, Any]], primals: tuple, tangents: tuple) -> tuple:
        """``(y, J t, aux)`` for ``fn(*primals) = (y, aux)``."""


__all__ = ["Backend", "Engine", "FunctionalPrimitives", "JacobianPrimitives", "ModePrimitives",
           "Trainer"]
