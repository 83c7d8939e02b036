"""Reusable compiled Jacobians, JVPs, VJPs and Hessians for Keras 3 on TensorFlow, JAX and
PyTorch.

``jacobian(f)`` returns a callable that is traced once per input signature and reused
(``tf.function`` on TensorFlow; ``jax.jit`` over the Keras variables' values on JAX; on
PyTorch, which runs eagerly, ``torch.func`` transforms built once and run at every call;
`_functional` holds what JAX and PyTorch share):

    jac = jacobian(model, batched=True)   # mode="auto": reverse or forward mode by size
    J = jac(x)                            # (B, *out_shape, *in_shape)

It uses nothing of the rest of pergrad but `pergrad.backend` and, on JAX and PyTorch, the
engine's stateless helpers. See docs/jacobian.md.
"""

import sys
import types

from pergrad.jacobian._api import Hessian, Jacobian, hessian, jacfwd, jacobian, jacrev
from pergrad.jacobian._cache import trace_counts
from pergrad.jacobian._transforms import hvp, jvp, vjp

__all__ = [
    "Hessian",
    "Jacobian",
    "hessian",
    "hvp",
    "jacfwd",
    "jacobian",
    "jacrev",
    "jvp",
    "trace_counts",
    "vjp",
]


class _CallableModule(types.ModuleType):
    """``pergrad.jacobian`` is this module *and* the function: ``pergrad.jacobian(f)`` calls
    :func:`jacobian`, while ``pergrad.jacobian.jvp`` and ``from pergrad.jacobian import jvp`` work
    as for any module, in whichever order they are first used."""

    def __call__(self, *args, **kwargs):
        return jacobian(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
