"""SimpleRNN, GRU and LSTM, through a recomputed recurrence that exposes the gates.

Every cell computes its gate pre-activations at step ``t`` as ``X_t + (recurrent part)`` with
``X_t = x_t W + b`` (``b`` the input bias). The rule's forward hook (:func:`recurrent_forward`)
runs the recurrence itself, exactly as Keras does, with ``X`` computed for all steps at once
outside the loop: ``X`` is the tapped tensor, so ``D_t = dL/dX_t`` is the gradient at the gates'
pre-activations, row ``i`` belonging to example ``i`` alone. With ``h_{t-1}`` the state entering
step ``t``,

    dL_i/dW = sum_t x_t^T D_t            dL_i/db = sum_t D_t          (``Factored``, ``A = x``)

and for the recurrent kernel ``U`` (gates in Keras's order; GRU ``z, r, h~``):

* SimpleRNN, LSTM (``X_t + h_{t-1} U``):  ``dL_i/dU = sum_t h_{t-1}^T D_t``.
* GRU, ``reset_after=False`` (candidate ``X_h + (r_t * h_{t-1}) U_h``): one group per gate,
  ``dL_i/dU_g = sum_t A_g^T D_{t,g}`` with ``A = (h_{t-1}, h_{t-1}, r_t * h_{t-1})``.
* GRU, ``reset_after=True`` (``R_t = h_{t-1} U + b_rec``, candidate ``X_h + r_t * R_h``):
  ``D^rec_t = dL/dR_t = (D_z, D_r, r_t * D_h)``; ``dL_i/dU = sum_t h_{t-1}^T D^rec_t`` and
  ``dL_i/db_rec = sum_t D^rec_t`` (the bias is ``(2, 3 units)``: input row, recurrent row).

A masked step (``Embedding(mask_zero=True)``, ``Masking``) carries the states and the previous
output through unchanged, as Keras does, so its ``D_t`` is zero. ``go_backwards`` runs the loop
over the reversed sequence; the sums over ``t`` do not depend on the order.

Left to the generic rule (``applies``): dropout or recurrent dropout (random masks), ``stateful``
(the call updates state variables), ``unroll`` (Keras's unrolled loop zeroes masked outputs by
the unreversed mask under ``go_backwards``: another function), subclasses that change the loop or
the cell, and an input kernel that is not trainable (the tap reaches the tape through it).

Written with ``keras.ops`` (the recurrence is ``keras.ops.scan``), so the same rule runs on every
backend: on TensorFlow the tape reaches ``X``; on JAX and PyTorch the forward hook adds the
engine's zero perturbation to ``X`` (its ``tap``) before the recurrence reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
from keras import ops

from pergrad.backend import native
from pergrad.backend.ops import batch_size
from pergrad.rules import LayerCall, register
from pergrad.rules.forms import Factored, Materialized

Tensor = Any
# step(X_t, states) -> (output, new states, extras): extras are the per-step tensors the rule
# needs besides h_{t-1} (GRU's reset gate r_t).
Step = Callable[[Tensor, tuple], tuple[Tensor, tuple, tuple]]


class Saved(NamedTuple):
    """What the forward keeps for the rule, batch-major and in the input's time order."""

    inputs: Tensor  # x, (B, T, F)
    previous: Tensor  # h_{t-1}, (B, T, units)
    reset: Tensor | None  # GRU's r_t, (B, T, units); None for the other cells


def _activate(fn, t: Tensor) -> Tensor:
    return t if fn is None else fn(t)


def _simple_rnn_step(cell) -> tuple[Step, int]:
    """``h_t = act(X_t + h_{t-1} U)``."""
    u = cell.recurrent_kernel.value

    def step(x, states):
        h = _activate(cell.activation, x + ops.matmul(states[0], u))
        return h, (h,), ()

    return step, 0


def _lstm_step(cell) -> tuple[Step, int]:
    """``(i, f, c~, o) = (s(z_i), s(z_f), act(z_c), s(z_o))`` for ``z = X_t + h_{t-1} U``;
    ``c_t = f c_{t-1} + i c~``, ``h_t = o act(c_t)``."""
    u = cell.recurrent_kernel.value

    def step(x, states):
        h_prev, c_prev = states
        z_i, z_f, z_c, z_o = ops.split(x + ops.matmul(h_prev, u), 4, axis=-1)
        gate = cell.recurrent_activation
        c = gate(z_f) * c_prev + gate(z_i) * cell.activation(z_c)
        h = gate(z_o) * cell.activation(c)
        return h, (h, c), ()

    return step, 0


def _gru_step(cell) -> tuple[Step, int]:
    """``z = s(X_z + h U_z)``, ``r = s(X_r + h U_r)``, ``h~ = act(X_h + r (h U_h + b_h))``
    (``reset_after``) or ``act(X_h + (r h) U_h)``; ``h_t = z h_{t-1} + (1 - z) h~``."""
    u, units = cell.recurrent_kernel.value, cell.units
    recurrent_bias = cell.bias.value[1] if cell.use_bias and cell.reset_after else None
    # The kernel's gate columns cut once, outside the loop; inside it the gates are cut with
    # split, whose gradient is one concatenation. Slices had one StridedSliceGrad per gate and
    # step, each a zero tensor of the whole width, and an AddN of the three (measured:
    # docs/benchmarks.md, "Route measurements").
    u_gates, u_h = (None, None) if cell.reset_after else ops.split(u, [2 * units], axis=-1)

    def step(x, states):
        h_prev = states[0]
        x_z, x_r, x_h = ops.split(x, 3, axis=-1)
        if cell.reset_after:
            inner = ops.matmul(h_prev, u)
            if recurrent_bias is not None:
                inner = inner + recurrent_bias
            inner_z, inner_r, inner_h = ops.split(inner, 3, axis=-1)
        else:
            inner_z, inner_r = ops.split(ops.matmul(h_prev, u_gates), 2, axis=-1)
        z = cell.recurrent_activation(x_z + inner_z)
        r = cell.recurrent_activation(x_r + inner_r)
        candidate = r * inner_h if cell.reset_after else ops.matmul(r * h_prev, u_h)
        h = z * h_prev + (1 - z) * cell.activation(x_h + candidate)
        return h, (h,), (r,)

    return step, 1


_CELLS = {
    keras.layers.SimpleRNN: (keras.layers.SimpleRNNCell, _simple_rnn_step),
    keras.layers.GRU: (keras.layers.GRUCell, _gru_step),
    keras.layers.LSTM: (keras.layers.LSTMCell, _lstm_step),
}


def _input_projection(cell, x: Tensor) -> Tensor:
    """``X = x W + b_in``, ``(B, T, gates * units)``: the tapped tensor."""
    projected = ops.einsum("btf,fg->btg", x, cell.kernel.value)
    if cell.use_bias:
        bias = cell.bias.value
        projected = projected + (bias[0] if len(bias.shape) == 2 else bias)
    return projected


def _arguments(sequences, initial_state=None, mask=None, training=False):
    """The arguments of ``RNN.call``, however they were passed."""
    del training  # without dropout the recurrence does not depend on it
    return sequences, initial_state, mask


def _initial_states(layer, sequences: Tensor, initial_state) -> tuple:
    """The states entering step 0, in the cell's compute dtype, as ``RNN.call`` builds them."""
    dtype = layer.cell.compute_dtype
    if initial_state is None:
        batch = batch_size(sequences)
        return tuple(ops.zeros([batch, size], dtype) for size in layer.state_size)
    if not keras.tree.is_nested(initial_state):
        initial_state = [initial_state]
    return tuple(ops.cast(s, dtype) for s in initial_state)


def _recur(step: Step, extras: int, inputs: Tensor, mask: Tensor | None, states: tuple,
           zero_output_for_mask: bool, sequences: bool = True) -> tuple:
    """Run ``step`` over time-major ``inputs`` ``(T, B, G)`` as Keras's ``backend.rnn`` does.

    Where ``mask[t]`` is false the states stay as they were and the output is the previous
    step's (zeros before the first, or always zeros with ``zero_output_for_mask``). Returns the
    time-major outputs stacked over ``t`` (``None`` unless ``sequences``), the last output, the
    final states, ``h_{t-1}`` and the step extras, the last two stacked over ``t``.
    """
    def body(carry, elems):
        previous_output, previous_states = carry
        output, new_states, step_extras = step(elems[0], previous_states)
        # The carry keeps its dtypes (lax.scan requires it): Keras's JAX backend can return an
        # activation in float32 for float64 inputs.
        output = ops.cast(output, previous_output.dtype)
        new_states = tuple(ops.cast(new, old.dtype)
                           for new, old in zip(new_states, previous_states, strict=True))
        step_extras = tuple(ops.cast(e, previous_output.dtype) for e in step_extras)
        if mask is not None:
            keep = elems[1][:, None]
            if zero_output_for_mask:
                held = ops.zeros_like(output)
            elif native().RNN_MASK_HOLDS_STATE:  # Keras's JAX loop holds h_{t-1} (h_0 first)
                held = previous_states[0]
            else:  # TensorFlow's and PyTorch's hold the previous output (zeros before it)
                held = previous_output
            output = ops.where(keep, output, held)
            new_states = tuple(ops.where(keep, new, old)
                               for new, old in zip(new_states, previous_states, strict=True))
        return (output, tuple(new_states)), (output, previous_states[0], tuple(step_extras))

    elems = (inputs,) if mask is None else (inputs, mask)
    zero = ops.zeros_like(states[0])
    return native().recurrence(body, extras, elems, zero, tuple(states), sequences)


def _batch_major(t: Tensor, backwards: bool) -> Tensor:
    """Time-major ``(T, B, n)`` in processing order to ``(B, T, n)`` in the input's order."""
    t = ops.transpose(t, [1, 0, 2])
    return ops.flip(t, axis=1) if backwards else t


def _time_major(projected: Tensor, mask, backwards: bool) -> tuple:
    """``X`` ``(T, B, G)`` and the mask ``(T, B)`` (or ``None``) in processing order."""
    if keras.tree.is_nested(mask):
        mask = keras.tree.flatten(mask)[0]
    inputs = ops.transpose(projected, [1, 0, 2])
    mask = None if mask is None else ops.transpose(ops.cast(mask, "bool"))
    if backwards:
        inputs = ops.flip(inputs, axis=0)
        mask = None if mask is None else ops.flip(mask, axis=0)
    return inputs, mask


def recurrent_forward(layer, args: tuple, kwargs: dict,
                      tap: Callable[[Tensor], Tensor] | None = None) -> tuple:
    """``RNN.call`` recomputed with the input projection ``X`` exposed: ``(outputs, X, Saved)``.

    ``tap``, when given (JAX, PyTorch), is applied to ``X`` before the recurrence reads it."""
    sequences, initial_state, mask = _arguments(*args, **kwargs)
    cell, backwards = layer.cell, layer.go_backwards
    x = ops.cast(sequences, cell.kernel.value.dtype)
    projected = _input_projection(cell, x)
    if tap is not None:
        projected = tap(projected)
    step, extras = _CELLS[_registered_class(layer)][1](cell)  # the cell's math, see above
    inputs, mask = _time_major(projected, mask, backwards)
    outputs, last, states, previous, extra_steps = _recur(
        step, extras, inputs, mask, _initial_states(layer, sequences, initial_state),
        layer.zero_output_for_mask, layer.return_sequences)
    output = _batch_major(outputs, False) if layer.return_sequences else last
    output = ops.cast(output, layer.compute_dtype)
    states = [ops.cast(s, layer.compute_dtype) for s in states]
    saved = Saved(x, _batch_major(previous, backwards),
                  _batch_major(extra_steps[0], backwards) if extras else None)
    return ((output, *states) if layer.return_state else output), projected, saved


def _outer(variable, a: Tensor, d: Tensor) -> Factored:
    """``sum_t a_t^T d_t`` for ``a`` ``(B, T, I)`` and ``d`` ``(B, T, O)``: one group."""
    return Factored(variable, a[:, :, None, :], d[:, :, None, :], tuple(variable.shape))


def _gates(t: Tensor, count: int) -> Tensor:
    """``(B, T, count * n)`` to ``(B, T, count, n)``: one group per gate."""
    steps = t.shape[1] if t.shape[1] is not None else -1
    return ops.reshape(t, [batch_size(t), steps, count, t.shape[-1] // count])


def _gru_forms(cell, h: Tensor, r: Tensor, d: Tensor) -> list:
    """The recurrent kernel's form, and the bias's (see the module docstring)."""
    u = cell.recurrent_kernel
    if not cell.reset_after:
        a = ops.stack([h, h, r * h], axis=2)  # (B, T, 3, units): what each gate's U multiplies
        forms = [Factored(u, a, _gates(d, 3), (cell.units, 3, cell.units))]
        return forms + ([Materialized(cell.bias, ops.sum(d, 1))] if cell.use_bias else [])
    d_z, d_r, d_h = ops.split(d, 3, axis=-1)
    d_rec = ops.concatenate([d_z, d_r, r * d_h], axis=-1)
    forms = [_outer(u, h, d_rec)]
    if cell.use_bias:
        forms.append(Materialized(cell.bias, ops.stack(
            [ops.sum(d, 1), ops.sum(d_rec, 1)], axis=1)))
    return forms


def recurrent_rule(layer, call: LayerCall, grad: Tensor) -> list:
    cell = layer.cell
    dtype = cell.kernel.dtype
    x, h, r = (None if t is None else ops.cast(t, dtype) for t in call.saved)
    d = ops.cast(grad, dtype)  # (B, T, gates * units)
    forms = [_outer(cell.kernel, x, d)]
    if isinstance(cell, keras.layers.GRUCell):
        return forms + _gru_forms(cell, h, r, d)
    forms.append(_outer(cell.recurrent_kernel, h, d))
    if cell.use_bias:
        forms.append(Materialized(cell.bias, ops.sum(d, 1)))
    return forms


def _registered_class(layer) -> type:
    return next(cls for cls in type(layer).__mro__ if cls in _CELLS)


def _exact(layer) -> bool:
    """The recomputed recurrence is the layer's own: see the module docstring (and, on JAX,
    not ``go_backwards``)."""
    layer_class = _registered_class(layer)
    cell = layer.cell
    return (type(cell) is _CELLS[layer_class][0]
            and type(layer).inner_loop is layer_class.inner_loop
            and not cell.dropout and not cell.recurrent_dropout
            and not layer.stateful and not layer.unroll
            and cell.kernel.trainable
            # Keras's JAX loop returns go_backwards sequences in the input's order (and the
            # last output of that order): another function, left to the generic rule.
            and not (native().RNN_BACKWARDS_IN_INPUT_ORDER and layer.go_backwards))


register(*_CELLS, applies=_exact, forward=recurrent_forward)(recurrent_rule)
