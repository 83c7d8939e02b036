"""Reusable compiled Jacobians, JVPs, VJPs and Hessians for TensorFlow 2 / Keras 3.

``jacobian(f)`` returns a callable that is traced once per input signature and reused:

    jac = jacobian(model, batched=True)   # mode="auto": reverse or forward mode by size
    J = jac(x)                            # (B, *out_shape, *in_shape)

Independent of the rest of pergrad. See docs/jacobian.md.
"""

from pergrad.jacobian._api import Hessian, Jacobian, hessian, jacfwd, jacobian, jacrev
from pergrad.jacobian._compile import trace_counts
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
