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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import keras
import tensorflow as tf

from pergrad.backend import is_tensorflow
from pergrad.rules import LayerCall, register
from pergrad.rules.forms import Factored, Materialized

# step(X_t, states) -> (output, new states, extras): extras are the per-step tensors the rule
# needs besides h_{t-1} (GRU's reset gate r_t).
Step = Callable[[tf.Tensor, tuple], tuple[tf.Tensor, tuple, tuple]]


class Saved(NamedTuple):
    """What the forward keeps for the rule, batch-major and in the input's time order."""

    inputs: tf.Tensor  # x, (B, T, F)
    previous: tf.Tensor  # h_{t-1}, (B, T, units)
    reset: tf.Tensor | None  # GRU's r_t, (B, T, units); None for the other cells


def _activate(fn, t: tf.Tensor) -> tf.Tensor:
    return t if fn is None else fn(t)


def _simple_rnn_step(cell) -> tuple[Step, int]:
    """``h_t = act(X_t + h_{t-1} U)``."""
    u = cell.recurrent_kernel.value

    def step(x, states):
        h = _activate(cell.activation, x + tf.matmul(states[0], u))
        return h, (h,), ()

    return step, 0


def _lstm_step(cell) -> tuple[Step, int]:
    """``(i, f, c~, o) = (s(z_i), s(z_f), act(z_c), s(z_o))`` for ``z = X_t + h_{t-1} U``;
    ``c_t = f c_{t-1} + i c~``, ``h_t = o act(c_t)``."""
    u = cell.recurrent_kernel.value

    def step(x, states):
        h_prev, c_prev = states
        z_i, z_f, z_c, z_o = tf.split(x + tf.matmul(h_prev, u), 4, axis=-1)
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

    def step(x, states):
        h_prev = states[0]
        x_z, x_r, x_h = tf.split(x, 3, axis=-1)
        if cell.reset_after:
            inner = tf.matmul(h_prev, u)
            if recurrent_bias is not None:
                inner = inner + recurrent_bias
        else:
            inner = tf.matmul(h_prev, u[:, :2 * units])
        z = cell.recurrent_activation(x_z + inner[:, :units])
        r = cell.recurrent_activation(x_r + inner[:, units:2 * units])
        if cell.reset_after:
            candidate = r * inner[:, 2 * units:]
        else:
            candidate = tf.matmul(r * h_prev, u[:, 2 * units:])
        h = z * h_prev + (1 - z) * cell.activation(x_h + candidate)
        return h, (h,), (r,)

    return step, 1


_CELLS = {
    keras.layers.SimpleRNN: (keras.layers.SimpleRNNCell, _simple_rnn_step),
    keras.layers.GRU: (keras.layers.GRUCell, _gru_step),
    keras.layers.LSTM: (keras.layers.LSTMCell, _lstm_step),
}


def _input_projection(cell, x: tf.Tensor) -> tf.Tensor:
    """``X = x W + b_in``, ``(B, T, gates * units)``: the tapped tensor."""
    projected = tf.einsum("btf,fg->btg", x, cell.kernel.value)
    if cell.use_bias:
        bias = cell.bias.value
        projected = projected + (bias[0] if bias.shape.rank == 2 else bias)
    return projected


def _arguments(sequences, initial_state=None, mask=None, training=False):
    """The arguments of ``RNN.call``, however they were passed."""
    del training  # without dropout the recurrence does not depend on it
    return sequences, initial_state, mask


def _initial_states(layer, sequences: tf.Tensor, initial_state) -> tuple:
    """The states entering step 0, in the cell's compute dtype, as ``RNN.call`` builds them."""
    dtype = layer.cell.compute_dtype
    if initial_state is None:
        batch = tf.shape(sequences)[0]
        return tuple(tf.zeros([batch, size], dtype) for size in layer.state_size)
    if not tf.nest.is_nested(initial_state):
        initial_state = [initial_state]
    return tuple(tf.cast(s, dtype) for s in initial_state)


def _recur(step: Step, extras: int, inputs: tf.Tensor, mask: tf.Tensor | None, states: tuple,
           zero_output_for_mask: bool) -> tuple:
    """Run ``step`` over time-major ``inputs`` ``(T, B, G)`` as Keras's ``backend.rnn`` does.

    Where ``mask[t]`` is false the states stay as they were and the output is the previous
    step's (zeros before the first, or always zeros with ``zero_output_for_mask``). Returns the
    time-major outputs, the final states, ``h_{t-1}`` and the step extras, all stacked over ``t``.
    """
    def body(carry, elems):
        previous_output, previous_states = carry[0], carry[1]
        output, new_states, step_extras = step(elems[0], previous_states)
        if mask is not None:
            keep = elems[1][:, None]
            held = tf.zeros_like(output) if zero_output_for_mask else previous_output
            output = tf.where(keep, output, held)
            new_states = tuple(tf.where(keep, new, old)
                               for new, old in zip(new_states, previous_states, strict=True))
        return output, tuple(new_states), previous_states[0], tuple(step_extras)

    zero = tf.zeros_like(states[0])
    initializer = (zero, states, zero, tuple(zero for _ in range(extras)))
    elems = (inputs,) if mask is None else (inputs, mask)
    outputs, state_steps, previous, extra_steps = tf.scan(body, elems, initializer=initializer)
    return outputs, tuple(s[-1] for s in state_steps), previous, extra_steps


def _batch_major(t: tf.Tensor, backwards: bool) -> tf.Tensor:
    """Time-major ``(T, B, n)`` in processing order to ``(B, T, n)`` in the input's order."""
    t = tf.transpose(t, [1, 0, 2])
    return tf.reverse(t, [1]) if backwards else t


def _time_major(projected: tf.Tensor, mask, backwards: bool) -> tuple:
    """``X`` ``(T, B, G)`` and the mask ``(T, B)`` (or ``None``) in processing order."""
    if tf.nest.is_nested(mask):
        mask = tf.nest.flatten(mask)[0]
    inputs = tf.transpose(projected, [1, 0, 2])
    mask = None if mask is None else tf.transpose(tf.cast(mask, tf.bool))
    if backwards:
        inputs = tf.reverse(inputs, [0])
        mask = None if mask is None else tf.reverse(mask, [0])
    return inputs, mask


def recurrent_forward(layer, args: tuple, kwargs: dict) -> tuple:
    """``RNN.call`` recomputed with the input projection ``X`` exposed: ``(outputs, X, Saved)``."""
    sequences, initial_state, mask = _arguments(*args, **kwargs)
    cell, backwards = layer.cell, layer.go_backwards
    x = tf.cast(sequences, cell.kernel.value.dtype)
    projected = _input_projection(cell, x)
    step, extras = _CELLS[_registered_class(layer)][1](cell)  # the cell's math, see above
    inputs, mask = _time_major(projected, mask, backwards)
    outputs, states, previous, extra_steps = _recur(
        step, extras, inputs, mask, _initial_states(layer, sequences, initial_state),
        layer.zero_output_for_mask)
    output = _batch_major(outputs, False) if layer.return_sequences else outputs[-1]
    output = tf.cast(output, layer.compute_dtype)
    states = [tf.cast(s, layer.compute_dtype) for s in states]
    saved = Saved(x, _batch_major(previous, backwards),
                  _batch_major(extra_steps[0], backwards) if extras else None)
    return ((output, *states) if layer.return_state else output), projected, saved


def _outer(variable, a: tf.Tensor, d: tf.Tensor) -> Factored:
    """``sum_t a_t^T d_t`` for ``a`` ``(B, T, I)`` and ``d`` ``(B, T, O)``: one group."""
    return Factored(variable, a[:, :, None, :], d[:, :, None, :], tuple(variable.shape))


def _gates(t: tf.Tensor, count: int) -> tf.Tensor:
    """``(B, T, count * n)`` to ``(B, T, count, n)``: one group per gate."""
    steps = t.shape[1] if t.shape[1] is not None else -1
    return tf.reshape(t, [tf.shape(t)[0], steps, count, t.shape[-1] // count])


def _gru_forms(cell, h: tf.Tensor, r: tf.Tensor, d: tf.Tensor) -> list:
    """The recurrent kernel's form, and the bias's (see the module docstring)."""
    u = cell.recurrent_kernel
    if not cell.reset_after:
        a = tf.stack([h, h, r * h], axis=2)  # (B, T, 3, units): what each gate's U multiplies
        forms = [Factored(u, a, _gates(d, 3), (cell.units, 3, cell.units))]
        return forms + ([Materialized(cell.bias, tf.reduce_sum(d, 1))] if cell.use_bias else [])
    d_z, d_r, d_h = tf.split(d, 3, axis=-1)
    d_rec = tf.concat([d_z, d_r, r * d_h], axis=-1)
    forms = [_outer(u, h, d_rec)]
    if cell.use_bias:
        forms.append(Materialized(cell.bias, tf.stack(
            [tf.reduce_sum(d, 1), tf.reduce_sum(d_rec, 1)], axis=1)))
    return forms


def recurrent_rule(layer, call: LayerCall, grad: tf.Tensor) -> list:
    cell = layer.cell
    dtype = cell.kernel.dtype
    x, h, r = (None if t is None else tf.cast(t, dtype) for t in call.saved)
    d = tf.cast(grad, dtype)  # (B, T, gates * units)
    forms = [_outer(cell.kernel, x, d)]
    if isinstance(cell, keras.layers.GRUCell):
        return forms + _gru_forms(cell, h, r, d)
    forms.append(_outer(cell.recurrent_kernel, h, d))
    if cell.use_bias:
        forms.append(Materialized(cell.bias, tf.reduce_sum(d, 1)))
    return forms


def _registered_class(layer) -> type:
    return next(cls for cls in type(layer).__mro__ if cls in _CELLS)


def _exact(layer) -> bool:
    """The recomputed recurrence is the layer's own: see the module docstring. The recurrence
    is written with ``tf.scan``: on the JAX backend these layers take the generic rule
    (``jax.vmap`` of the layer's own VJP, exact)."""
    if not is_tensorflow():
        return False
    layer_class = _registered_class(layer)
    cell = layer.cell
    return (type(cell) is _CELLS[layer_class][0]
            and type(layer).inner_loop is layer_class.inner_loop
            and not cell.dropout and not cell.recurrent_dropout
            and not layer.stateful and not layer.unroll
            and cell.kernel.trainable)


register(*_CELLS, applies=_exact, forward=recurrent_forward)(recurrent_rule)
