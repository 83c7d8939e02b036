"""LoRA adapters on Dense and EinsumDense (``layer.enable_lora(rank)``, Keras's own API).

With LoRA on, Keras computes the layer with the kernel ``W + s A B``, ``s = lora_alpha /
lora_rank``, where ``A = lora_kernel_a`` has the kernel's shape with its *last* axis ``L``
replaced by the rank ``r`` and ``B = lora_kernel_b`` is ``(r, L)``; ``enable_lora`` freezes
``W``. Writing ``G_i = sum_t X_i[t]^T D_i[t]`` for the per-example gradient at the merged kernel
(the Dense/EinsumDense rule's ``Factored`` form, ``X`` the layer input and ``D`` the gradient
at its pre-activation output), the chain rule through ``W + s A B`` gives

    dl_i/dA = s G_i B^T = s sum_t X_i[t]^T (D_i[t] B^T)          (I x r)
    dl_i/dB = s A^T G_i = s sum_t (X_i[t] A)^T D_i[t]            (r x L)

Each is again a sum over positions of outer products of two thin factors, so both are
``Factored`` forms, with factors ``(X, s D B^T)`` and ``(X A, s D)``: norms by the Gram (ghost)
trick or per-example matrices as the cost model chooses, weighted sums as one matmul, nothing
``B x P``. For an EinsumDense kernel with output axes ``O' L`` (``L`` last in the kernel and an
output axis of the equation), groups ``G`` and positions ``S``, ``X A`` is
``U_i[S, G, O', r] = sum_C X_i[S, G, C] A[C, G, O', r]`` and, ``B`` being shared by every
``(G, O')``, those axes join the positions of ``dl_i/dB``'s form:
``dl_i/dB = s sum_{S, G, O'} U_i[S, G, O']^T D_i[S, G, O']``. Kernels whose last axis is
contracted or a group axis take the generic rule (``pergrad.rules.einsum_dense``).
"""

from __future__ import annotations

from keras import ops

from pergrad.backend.ops import batch_size
from pergrad.rules.forms import Factored


def unquantized(layer) -> bool:
    """The layer's kernel is a plain variable, LoRA adapters or not (a quantized kernel takes
    the generic rule)."""
    return not getattr(layer, "quantization_mode", None)


def lora_on(layer) -> bool:
    return bool(getattr(layer, "lora_enabled", False))


def base_kernel(layer):
    """The kernel variable ``W`` itself (with LoRA on, ``layer.kernel`` is the merged tensor
    ``W + s A B``, computed anew at every read)."""
    kernel = getattr(layer, "_kernel", None)
    return layer.kernel if kernel is None else kernel


def lora_forms(layer, x, d, a_weights, natural_shape, perm) -> list:
    """The ``Factored`` forms of the trainable ones among ``lora_kernel_a`` and
    ``lora_kernel_b`` (module docstring).

    ``x``: the input arranged ``(B, S, G, C)``; ``d``: the output gradient arranged
    ``(B, S, G, Q, L)`` with ``Q`` the product of the output axes ``O'`` other than ``L``;
    ``a_weights``: ``lora_kernel_a``'s value arranged ``(G, C, Q, r)``; ``natural_shape`` and
    ``perm``: ``lora_kernel_a``'s ``Factored`` layout (its axes ordered ``(C..., G..., O'...,
    r)``, and the permutation into the variable's order).
    """
    a_var, b_var = layer.lora_kernel_a, layer.lora_kernel_b
    dtype = a_var.dtype
    scale = layer.lora_alpha / layer.lora_rank
    rank = int(b_var.shape[0])
    n, g, c = batch_size(x), x.shape[2], x.shape[3]
    t = -1 if x.shape[1] is None else int(x.shape[1])  # unknown positions: -1 in reshapes
    q, width = d.shape[3], d.shape[4]
    x, d = ops.cast(x, dtype), ops.cast(d, dtype)
    forms = []
    if a_var.trainable:
        # s D B^T: (B, S, G, Q, r), the gradient at X A's output.
        d_a = ops.matmul(d, ops.transpose(ops.cast(b_var.value, dtype)) * scale)
        forms.append(Factored(a_var, x, ops.reshape(d_a, [n, t, g, q * rank]),
                              natural_shape, perm))
    if b_var.trainable:
        a_scaled = ops.cast(a_weights, dtype) * scale  # s A: (G, C, Q, r)
        if g == 1:  # one matmul over every (example, position) row
            u = ops.matmul(ops.reshape(x, [-1, c]), ops.reshape(a_scaled, [c, q * rank]))
        else:
            u = ops.einsum("bsgc,gcq->bsgq", x, ops.reshape(a_scaled, [g, c, q * rank]))
        rows = -1 if t == -1 else t * g * q
        forms.append(Factored(b_var, ops.reshape(u, [n, rows, 1, rank]),
                              ops.reshape(d, [n, rows, 1, width]), (rank, width)))
    return forms
