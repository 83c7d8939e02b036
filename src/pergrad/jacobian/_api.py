"""Reusable compiled Jacobians and Hessians: `jacobian`, `jacfwd`, `jacrev`, `hessian`."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import keras

from pergrad import backend
from pergrad.backend import require_supported
from pergrad.jacobian import _modes
from pergrad.jacobian._call import (
    Argnums,
    diff_positions,
    make_caller,
    normalize_argnums,
    split_args,
)
from pergrad.jacobian._modes import MODES, choose_mode
from pergrad.jacobian._structure import flatten, input_size, leaf_paths, rank


def _check_chunk_size(chunk_size: int | None, what: str) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(
            f"{what}: chunk_size must be a positive integer (the most JVPs/VJPs vectorized at "
            f"once) or None for no chunking, got {chunk_size!r}."
        )
    return chunk_size


def _diff_paths(args: tuple, argnums: int | tuple[int, ...] | None) -> list[str]:
    """Leaf paths of the differentiated structure, named by positional argument."""
    positions = diff_positions(argnums, len(args), "jacobian")
    return [p for pos in positions for p in leaf_paths(args[pos], f"args[{pos}]")]


class _CompiledDerivative:
    """Shared machinery: argument checks, structural dispatch, trace counting."""

    _what = "derivative"

    def __init__(
        self,
        f: Callable[..., Any],
        *,
        argnums: Argnums,
        batched: bool,
        chunk_size: int | None,
        jit_compile: bool,
        training: bool,
        input_signature: Any,
    ) -> None:
        what = self._what
        self.f = f
        self.batched = bool(batched)
        self.chunk_size = _check_chunk_size(chunk_size, what)
        self.jit_compile = bool(jit_compile)
        self.training = bool(training)
        self.argnums = normalize_argnums(argnums, what)
        self._call_f = make_caller(f, self.training, what)
        self._last_key: Hashable | None = None
        self._built = False
        self.input_signature = input_signature
        # The backend compiles: one tf.function per structural key on TensorFlow, one jax.jit
        # on JAX, torch.func transforms run eagerly on PyTorch.
        self._backend = backend.part("jacobian")
        self._signature_fn: Any = None
        if input_signature is not None:
            self._signature_fn = self._backend.signature_function(
                self._build("input_signature"),
                name=what,
                jit_compile=self.jit_compile,
                input_signature=input_signature,
                what=what,
            )
        self._dispatch = self._backend.dispatch(
            self._build, f, name=what, jit_compile=self.jit_compile
        )

    @property
    def trace_count(self) -> int:
        """Number of times this object's computation was traced (all signatures)."""
        n = self._dispatch.trace_count
        return n + (self._signature_fn.trace_count if self._signature_fn else 0)

    # -- call path ------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        positions = diff_positions(self.argnums, len(args), self._what)
        args = tuple(
            self._convert(arg, pos) if pos in positions else arg for pos, arg in enumerate(args)
        )
        if self.batched:
            self._check_batch(args, positions)
        if not self._built:
            self._maybe_build(args)
        if self._signature_fn is not None:
            self._last_key = "input_signature"
            return self._signature_fn(*args)
        key = self._backend.structural_key(args, self.batched)
        self._last_key = key
        return self._dispatch(key, *args)

    def _convert(self, arg: Any, pos: int) -> Any:
        """Differentiated argument: float tensors pass through; others converted or refused."""
        return self._backend.convert_argument(arg, pos, self._what)

    def _check_batch(self, args: tuple, positions: list[int]) -> None:
        leaves = [leaf for pos in positions for leaf in flatten(args[pos])]
        sizes = {leaf.shape[0] if rank(leaf) else "scalar" for leaf in leaves}
        sizes.discard(None)
        if len(sizes) <= 1 and "scalar" not in sizes:
            return
        # Something is wrong: find the culprit's name.
        what = self._what
        paths = [p for pos in positions for p in leaf_paths(args[pos], f"args[{pos}]")]
        first: tuple[str, int] | None = None
        for leaf, path in zip(leaves, paths, strict=True):
            if not rank(leaf):
                raise ValueError(
                    f"{what}: batched=True but input {path} is a scalar; every "
                    "differentiated input needs a leading batch dimension."
                )
            size = leaf.shape[0]
            if first is None or first[1] is None:
                first = (path, size)
            elif size is not None and size != first[1]:
                raise ValueError(
                    f"{what}: batched=True needs every differentiated input to share the "
                    f"leading batch dimension, but {first[0]} has batch size {first[1]} "
                    f"and {path} has {size}. Pass inputs of equal batch size, or use "
                    "batched=False for the full Jacobian."
                )

    def _maybe_build(self, args: tuple) -> None:
        """Builds an unbuilt Keras model eagerly once, so no variable is created in a trace."""
        f = self.f
        if isinstance(f, keras.Layer) and not f.built:
            f(*args, training=False)
        self._built = True

    def _build(self, key: Hashable) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            diff, rebuild = split_args(args, self.argnums)
            x_paths = _diff_paths(args, self.argnums)

            def fn(d: Any) -> Any:
                return self._call_f(*rebuild(d))

            return self._compute(fn, diff, x_paths, key)

        return run

    def _compute(self, fn: Callable[[Any], Any], x: Any, x_paths: list[str], key: Hashable) -> Any:
        raise NotImplementedError


class Jacobian(_CompiledDerivative):
    """A compiled Jacobian of f. Create with `jacobian`; call with f's positional arguments.

    Attributes:
      mode_requested: "auto", "rev" or "fwd", as passed.
      mode: the mode used for the latest call's signature ("rev" or "fwd"); with
        ``mode="auto"`` it is None until the first call.
      trace_count: how many times the computation was traced (TensorFlow, JAX); on PyTorch,
        which traces nothing, how many input structures it was built for.
    """

    _what = "jacobian"

    def __init__(self, f: Callable[..., Any], *, mode: str = "auto", **kwargs: Any) -> None:
        if mode not in MODES:
            raise ValueError(
                f"jacobian: mode must be one of {', '.join(repr(m) for m in MODES)}, got "
                f"{mode!r}. Use 'rev' for few outputs, 'fwd' for few inputs, 'auto' to choose."
            )
        self.mode_requested = mode
        self._mode_by_key: dict[Hashable, str] = {}
        super().__init__(f, **kwargs)

    @property
    def mode(self) -> str | None:
        if self.mode_requested != "auto":
            return self.mode_requested
        return self._mode_by_key.get(self._last_key)

    def _compute(self, fn: Callable[[Any], Any], x: Any, x_paths: list[str], key: Hashable) -> Any:
        mode = self._mode_by_key.get(key, self.mode_requested)  # PyTorch runs this every call
        math = _modes
        if mode == "auto":
            n_in = input_size(x, x_paths, batched=self.batched, what="jacobian")
            n_out = math.output_sizes(fn, x, batched=self.batched, what="jacobian")
            mode = choose_mode(n_in, n_out)
        self._mode_by_key[key] = mode
        if mode == "rev":
            return math.jacobian_rev(fn, x, batched=self.batched, chunk_size=self.chunk_size,
                                     x_paths=x_paths)
        return math.jacobian_fwd(fn, x, batched=self.batched, chunk_size=self.chunk_size,
                                 x_paths=x_paths, inference=not self.training)

    def __repr__(self) -> str:
        return (
            f"<pergrad Jacobian of {getattr(self.f, '__name__', type(self.f).__name__)}: "
            f"mode={self.mode_requested!r} (used: {self.mode!r}), batched={self.batched}, "
            f"chunk_size={self.chunk_size}, traces={self.trace_count}>"
        )


class Hessian(_CompiledDerivative):
    """A compiled Hessian of a scalar f (forward-over-reverse). Create with `hessian`."""

    _what = "hessian"

    def _compute(self, fn: Callable[[Any], Any], x: Any, x_paths: list[str], key: Hashable) -> Any:
        return _modes.hessian_fwd_over_rev(
            fn, x, batched=self.batched, chunk_size=self.chunk_size, x_paths=x_paths
        )


def jacobian(
    f: Callable[..., Any],
    mode: str = "auto",
    batched: bool = False,
    chunk_size: int | None = None,
    jit_compile: bool = False,
    *,
    argnums: Argnums = None,
    training: bool = False,
    input_signature: Any = None,
) -> Jacobian:
    """Returns a compiled function computing the Jacobian of f.

    For f mapping inputs x (a tensor or nested structure; several positional arguments are
    one tuple-shaped structure) to outputs y (likewise), ``jacobian(f)(*args)`` returns
    J with ``J[k][l] = d y_k / d x_l`` of shape (*shape(y_k), *shape(x_l)), nested like JAX:
    outputs outer, inputs inner (a single tensor when both are single tensors).

    Args:
      f: a Keras model or layer (called with ``training=training``), or a function of the
        backend's ops.
      mode: ``"rev"`` (one VJP u^T J per output element, vectorized), ``"fwd"`` (one JVP J t
        per input element, vectorized: `tf.autodiff.ForwardAccumulator` on TensorFlow, ``jvp``
        on JAX and PyTorch), or ``"auto"``:
        forward mode iff 1.5 x (input elements) < (output elements), per example when
        batched (a JVP costs about 1.5 VJPs). The choice is `Jacobian.mode` after a call.
      batched: f maps a batch to a batch with independent examples; returns per-example
        Jacobians of shape (B, *ex(y_k), *ex(x_l)), where ex() drops the batch dimension,
        at the vectorized width of one example's Jacobian (like ``batch_jacobian``).
      chunk_size: at most this many JVPs/VJPs are vectorized at once (bounds memory; each
        one covers the whole batch when batched); results are identical.
      jit_compile: compile with XLA (no effect on JAX, where XLA compiles everything, or on
        PyTorch, where nothing is compiled).
      argnums: differentiate with respect to these positional arguments only (JAX
        convention); None means all of them. Others are passed through (tensors or Python
        values; a new Python value retraces).
      training: passed to Keras layers and models; True turns on dropout and BatchNorm's batch
        statistics. Not allowed for plain functions.
      input_signature: optional `tf.TensorSpec` list for the positional arguments, as for
        `tf.function`; it must fix every dimension (all but the batch one when batched).
        TensorFlow only (`NotImplementedError` on JAX, where each input shape traces once, and
        on PyTorch).

    Returns:
      A `Jacobian`: call it with f's positional arguments. It is traced once per input
      signature (nesting, dtypes and shapes; with batched=True, a new batch size retraces at
      most once on TensorFlow, once per batch size on JAX) and reused for every later call.
      It reads the current values of the Keras variables f uses at every call. On PyTorch it
      is built once per input structure and runs eagerly (`torch.func`).
    """
    require_supported("pergrad.jacobian")
    return Jacobian(
        f,
        mode=mode,
        argnums=argnums,
        batched=batched,
        chunk_size=chunk_size,
        jit_compile=jit_compile,
        training=training,
        input_signature=input_signature,
    )


def jacfwd(
    f: Callable[..., Any],
    batched: bool = False,
    chunk_size: int | None = None,
    jit_compile: bool = False,
    **kwargs: Any,
) -> Jacobian:
    """`jacobian` with ``mode="fwd"``: columns J e_i by forward mode (few inputs, many outputs)."""
    return jacobian(f, "fwd", batched, chunk_size, jit_compile, **kwargs)


def jacrev(
    f: Callable[..., Any],
    batched: bool = False,
    chunk_size: int | None = None,
    jit_compile: bool = False,
    **kwargs: Any,
) -> Jacobian:
    """`jacobian` with ``mode="rev"``: rows e_j^T J by reverse mode (few outputs, many inputs)."""
    return jacobian(f, "rev", batched, chunk_size, jit_compile, **kwargs)


def hessian(
    f: Callable[..., Any],
    batched: bool = False,
    chunk_size: int | None = None,
    jit_compile: bool = False,
    *,
    argnums: Argnums = None,
    training: bool = False,
    input_signature: Any = None,
) -> Hessian:
    """Returns a compiled function computing the Hessian of a scalar f.

    ``hessian(f)(*args)`` returns H with ``H[l1][l2] = d^2 f / dx_l1 dx_l2`` of shape
    (*shape(x_l1), *shape(x_l2)), nested like the inputs twice (outer l1, inner l2). Column i
    is the Hessian-vector product H e_i, computed forward-over-reverse (a forward-mode
    derivative of the gradient) and vectorized over i.

    With ``batched=True``, f returns one scalar per example (shape (B,)) and the result is
    every example's Hessian, shape (B, *ex(x_l1), *ex(x_l2)), at the cost of one example's
    width. Other arguments are as for `jacobian`.
    """
    require_supported("pergrad.hessian")
    return Hessian(
        f,
        argnums=argnums,
        batched=batched,
        chunk_size=chunk_size,
        jit_compile=jit_compile,
        training=training,
        input_signature=input_signature,
    )


__all__ = ["Hessian", "Jacobian", "hessian", "jacfwd", "jacobian", "jacrev"]
