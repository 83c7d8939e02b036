"""One-shot products: `jvp`, `vjp`, `hvp`, compiled once per f.

These are plain functions (JAX style) rather than factories. Each compiles its computation
(``tf.function(reduce_retracing=True)`` on TensorFlow, ``jax.jit`` on JAX, torch.func
transforms built once on PyTorch: the backend's ``jvp_product``, ``vjp_product`` and
``hvp_product``) the first time it meets a given f (and `training` flag) and caches it, weakly
keyed by f, so calling them in a loop with the same f and
same-shaped arguments traces once. Pass the *same* f object every time: a new lambda per
iteration is a new cache entry and a new trace. `trace_counts(f)` reports the traces.

Primals follow JAX's convention with one Keras-friendly exception: a tuple is the tuple of
positional arguments of f; anything else (a tensor, a list, a dict) is f's single argument.
Primals may be Keras variables or `tf.Variable`s (e.g. ``model.trainable_variables``); f is
called with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pergrad import backend
from pergrad.backend import require_supported
from pergrad.jacobian._call import make_caller


def jvp(
    f: Callable[..., Any], primals: Any, tangents: Any, *, training: bool = False
) -> tuple[Any, Any]:
    """Forward mode: returns ``(f(x), J(x) t)``, the outputs and the Jacobian-vector product.

    ``J(x) t = d/de f(x + e t) at e = 0``, computed in one forward pass with
    `tf.autodiff.ForwardAccumulator` (``jvp`` on JAX and PyTorch). Compiled once per f; see
    the module notes.

    Args:
      f: a Keras model or layer, or a function of the backend's ops.
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
      tangents: the direction t, structured like primals (same dtypes and shapes).
      training: passed to Keras layers and models.

    Returns:
      (outputs, jvp_out), both nested like f's outputs.
    """
    require_supported("pergrad.jacobian.jvp")
    make_caller(f, training, "jvp")  # validates f and `training` now, not at trace time
    return backend.part("jacobian").jvp_product(f, primals, tangents, training=training)



def vjp(
    f: Callable[..., Any], primals: Any, *, training: bool = False
) -> tuple[Any, Callable[[Any], Any]]:
    """Reverse mode: returns ``(f(x), vjp_fn)`` with ``vjp_fn(u) = u^T J(x)``.

    ``vjp_fn(u)`` is the gradient of ``<u, f(x)>`` with respect to the primals, structured
    like primals (a tuple when primals was a tuple). It is compiled once per f and reused.
    TensorFlow cannot hand a tape from one compiled call to the next, so there each ``vjp_fn``
    call recomputes the forward pass together with the backward pass (one forward + one
    backward); with ``training=True`` and random layers (dropout) that recomputation draws a
    fresh mask. On JAX and PyTorch ``vjp_fn`` holds the pullback and runs only the backward
    pass, with the weights of the call that made it.

    Args:
      f: a Keras model or layer, or a function of the backend's ops.
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
        Variable leaves (Keras variables, `tf.Variable`s) are allowed.
      training: passed to Keras layers and models.
    """
    require_supported("pergrad.jacobian.vjp")
    make_caller(f, training, "vjp")
    return backend.part("jacobian").vjp_product(f, primals, training=training)



def hvp(f: Callable[..., Any], primals: Any, vectors: Any, *, training: bool = False) -> Any:
    """Hessian-vector product ``H(x) v`` of a scalar f, forward-over-reverse.

    ``H(x) v = d/de grad f(x + e v) at e = 0``: the forward-mode derivative of the reverse-mode
    gradient along v, one forward and one backward pass (plus tangents), never forming H.

    Args:
      f: a function returning a scalar (for example a loss).
      primals: a tuple of f's positional arguments, or (anything else) its single argument.
        Variable leaves are allowed: ``hvp(loss_fn, model.trainable_variables, v)`` with
        ``loss_fn(weights)`` using the model gives the Hessian of the loss in its weights.
      vectors: v, structured like primals.
      training: passed to Keras layers and models.

    Returns:
      H v, structured like primals (a tuple when primals was a tuple).
    """
    require_supported("pergrad.jacobian.hvp")
    make_caller(f, training, "hvp")
    return backend.part("jacobian").hvp_product(f, primals, vectors, training=training)
