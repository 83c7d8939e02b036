"""EinsumDense: ``z = einsum(eq, x, W) + b`` (the projections inside MultiHeadAttention).

Each index letter of ``eq = "x_spec,w_spec->z_spec"`` is one of: the batch letter (first of
``x_spec`` and ``z_spec``), *positions* S (in x and z only), *contracted* C (in x and W), *outputs*
O (in W and z), or *groups* G (in all three). Transposing ``x`` to ``(B, S, G, C)`` and ``dL/dz`` to
``(B, S, G, O)`` gives a ``Factored`` kernel gradient

    dL_i/dW[C, G, O] = sum_S x_i[S, G, C] dL/dz_i[S, G, O],

permuted from ``(C..., G..., O...)`` into ``w_spec`` order. Equations outside this pattern (a
letter only in ``x`` or only in ``W``) take the generic rule.
"""

from __future__ import annotations

import math
import string

import keras
from keras import ops

from pergrad.backend.ops import batch_size, rank
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.forms import Factored, Materialized, positions, unbroadcast


def _expand_ellipsis(equation: str, x_rank: int) -> tuple[str, str, str]:
    inputs, z_spec = equation.split("->")
    x_spec, w_spec = inputs.split(",")
    if "..." in x_spec or "..." in z_spec:
        free = [c for c in string.ascii_letters if c not in equation]
        n = x_rank - (len(x_spec) - 3)
        fill = "".join(free[:n])
        x_spec, z_spec = x_spec.replace("...", fill), z_spec.replace("...", fill)
    return x_spec, w_spec, z_spec


def _classify(x_spec: str, w_spec: str, z_spec: str):
    batch = x_spec[0]
    if z_spec[0] != batch or batch in w_spec or "." in w_spec:
        return None
    s = [c for c in x_spec[1:] if c in z_spec and c not in w_spec]
    g = [c for c in x_spec if c in w_spec and c in z_spec]
    c = [ch for ch in x_spec if ch in w_spec and ch not in z_spec]
    o = [ch for ch in w_spec if ch in z_spec and ch not in x_spec]
    if sorted(s + g + c) != sorted(x_spec[1:]) or sorted(c + g + o) != sorted(w_spec):
        return None
    return batch, s, g, c, o


def _applies(layer) -> bool:
    """A factored rule exists for the equation (else the layer takes the generic rule)."""
    if not plain_weights(layer):
        return False
    if "..." in layer.equation.split("->")[0].split(",")[1]:
        return False
    rank = getattr(layer.input_spec, "ndim", None)
    if rank is None:
        return False
    return _classify(*_expand_ellipsis(layer.equation, rank)) is not None


@register(keras.layers.EinsumDense, splits_activation=True, applies=_applies)
def einsum_dense_rule(layer, call: LayerCall, grad) -> list:
    x = ops.cast(call.args[0], layer.kernel.dtype)
    d = ops.cast(grad, layer.kernel.dtype)
    x_spec, w_spec, z_spec = _expand_ellipsis(layer.equation, rank(x))
    parts = _classify(x_spec, w_spec, z_spec)
    if parts is None:
        raise NotImplementedError(f"EinsumDense equation {layer.equation!r} has no factored rule")
    batch_letter, s, g, c, o = parts
    size = dict(zip(x_spec, x.shape, strict=True)) | dict(zip(w_spec, layer.kernel.shape, strict=True))
    n_batch = batch_size(x)

    def arrange(t, spec, order, last):
        t = ops.transpose(t, [spec.index(ch) for ch in order])
        width = [math.prod(size[ch] for ch in g) or 1, math.prod(size[ch] for ch in last) or 1]
        return ops.reshape(t, [n_batch, positions(size[ch] for ch in s), *width])

    a = arrange(x, x_spec, [batch_letter, *s, *g, *c], c)
    dd = arrange(d, z_spec, [batch_letter, *s, *g, *o], o)
    natural = [*c, *g, *o]
    natural_shape = tuple(int(size[ch]) for ch in natural)
    perm = tuple(natural.index(ch) for ch in w_spec)
    forms = [Factored(layer.kernel, a, dd, natural_shape,
                      None if perm == tuple(range(len(perm))) else perm)]
    if layer.bias is not None:
        forms.append(Materialized(layer.bias, unbroadcast(d, tuple(layer.bias.shape))))
    return forms
