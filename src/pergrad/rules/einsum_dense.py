"""EinsumDense: ``z = einsum(eq, x, W) + b`` (the projections inside MultiHeadAttention).

Each index letter of ``eq = "x_spec,w_spec->z_spec"`` is one of: the batch letter (first of
``x_spec`` and ``z_spec``), *positions* S (in x and z only), *contracted* C (in x and W), *outputs*
O (in W and z), or *groups* G (in all three). Transposing ``x`` to ``(B, S, G, C)`` and ``dL/dz`` to
``(B, S, G, O)`` gives a ``Factored`` kernel gradient

    dL_i/dW[C, G, O] = sum_S x_i[S, G, C] dL/dz_i[S, G, O],

permuted from ``(C..., G..., O...)`` into ``w_spec`` order. Equations outside this pattern (a
letter only in ``x`` or only in ``W``) take the generic rule.

With LoRA on (``layer.enable_lora(rank)``) the kernel is ``W + s A B`` with ``W`` frozen,
``s = lora_alpha / lora_rank``, ``A`` of ``W``'s shape with its last axis ``L`` replaced by the
rank ``r`` and ``B`` of shape ``(r, L)``. When ``L`` is an output letter (every projection of
MultiHeadAttention and of KerasHub's transformers), with ``O = (O', L)``:

    dL_i/dA[C, G, O', r] = s sum_S x_i[S, G, C] (dL/dz_i[S, G, O', :] B^T)[r]
    dL_i/dB[r, L]        = s sum_{S, G, O'} U_i[S, G, O', r] dL/dz_i[S, G, O', L],
                           U_i[S, G, O', r] = sum_C x_i[S, G, C] A[C, G, O', r]

(:mod:`pergrad.rules.lora`), two ``Factored`` forms; a LoRA kernel whose last letter is
contracted or a group letter takes the generic rule.
"""

from __future__ import annotations

import math
import string

import keras
from keras import ops

from pergrad.backend.ops import batch_size, rank
from pergrad.rules import LayerCall, register
from pergrad.rules.forms import Factored, Materialized, positions, unbroadcast
from pergrad.rules.lora import base_kernel, lora_forms, lora_on, unquantized


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
    if not unquantized(layer):
        return False
    if "..." in layer.equation.split("->")[0].split(",")[1]:
        return False
    rank = getattr(layer.input_spec, "ndim", None)
    if rank is None:
        return False
    parts = _classify(*_expand_ellipsis(layer.equation, rank))
    if parts is None:
        return False
    # LoRA factors the kernel along its last letter: exact here when that is an output letter.
    w_spec = layer.equation.split("->")[0].split(",")[1]
    return not lora_on(layer) or w_spec[-1] in parts[4]


@register(keras.layers.EinsumDense, splits_activation=True, applies=_applies)
def einsum_dense_rule(layer, call: LayerCall, grad) -> list:
    kernel = base_kernel(layer)
    x, d = call.args[0], grad
    x_spec, w_spec, z_spec = _expand_ellipsis(layer.equation, rank(x))
    parts = _classify(x_spec, w_spec, z_spec)
    if parts is None:
        raise NotImplementedError(f"EinsumDense equation {layer.equation!r} has no factored rule")
    batch_letter, s, g, c, o = parts
    size = dict(zip(x_spec, x.shape, strict=True)) | dict(zip(w_spec, kernel.shape, strict=True))
    n_batch = batch_size(x)

    def width(letters):
        return math.prod(size[ch] for ch in letters) or 1

    def arrange(t, spec, order, last):
        t = ops.transpose(t, [spec.index(ch) for ch in order])
        return ops.reshape(t, [n_batch, positions(size[ch] for ch in s), width(g), *last])

    forms = []
    if kernel.trainable:
        a = arrange(ops.cast(x, kernel.dtype), x_spec, [batch_letter, *s, *g, *c], [width(c)])
        dd = arrange(ops.cast(d, kernel.dtype), z_spec, [batch_letter, *s, *g, *o], [width(o)])
        natural = [*c, *g, *o]
        natural_shape = tuple(int(size[ch]) for ch in natural)
        perm = tuple(natural.index(ch) for ch in w_spec)
        forms.append(Factored(kernel, a, dd, natural_shape,
                              None if perm == tuple(range(len(perm))) else perm))
    if lora_on(layer):
        # ``_applies``: the kernel's last letter is the last output letter (``o`` is in
        # ``w_spec`` order); ``A``'s letters are ``w_spec`` with it replaced by the rank.
        r_letter = next(ch for ch in string.ascii_letters if ch not in x_spec + w_spec + z_spec)
        a_spec = w_spec[:-1] + r_letter
        size[r_letter] = int(layer.lora_kernel_a.shape[-1])
        a_natural = [*c, *g, *o[:-1], r_letter]
        a_perm = tuple(a_natural.index(ch) for ch in a_spec)
        a_weights = ops.transpose(layer.lora_kernel_a.value,
                                  [a_spec.index(ch) for ch in [*g, *c, *o[:-1], r_letter]])
        forms += lora_forms(
            layer,
            arrange(x, x_spec, [batch_letter, *s, *g, *c], [width(c)]),
            arrange(d, z_spec, [batch_letter, *s, *g, *o], [width(o[:-1]), size[o[-1]]]),
            ops.reshape(a_weights, [width(g), width(c), width(o[:-1]), size[r_letter]]),
            tuple(int(size[ch]) for ch in a_natural),
            None if a_perm == tuple(range(len(a_perm))) else a_perm)
    if layer.bias is not None and layer.bias.trainable:
        forms.append(Materialized(layer.bias, unbroadcast(ops.cast(d, layer.bias.dtype),
                                                          tuple(layer.bias.shape))))
    return forms
