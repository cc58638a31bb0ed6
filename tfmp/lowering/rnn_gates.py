"""Keras' LSTM and GRU steps gate by gate, each gate's units split over the mesh.

An LSTM's or GRU's kernels are `(inputs, gates * units)`; split on their
columns over a mesh axis (`layout_map="auto"` does), each device holds a
contiguous block of columns, and the blocks straddle the gates. Keras' cell
cuts its projections into gates, and a cut across blocks is gathered: per
time step a GRU gathered both projections whole (every device then computing
every gate) forward and again as the backward loop ran the step again, and
all-reduced both projections' input gradients: six collectives a time step
per layer.

Laid out gate by gate, `(inputs, gates, units)` with the units split, a
device computes its own units of every gate. The kernels and bias are
relaid out so once per training step, before the loop, and the inputs'
projection is taken for every time step at once, also before it. In the
loop a step gathers the previous output for the recurrent product (going
forward, and again in the backward loop) and reduces that product's input
gradient: three collectives a time step, of `units` columns where there
were `3 * units`. The recurrent kernel and bias reach the step as
constants of the recurrence (`tfmp.lowering.rnn_loop`), whose gradient
flows back to the variables, and the outputs and states leave it gathered
whole, as Keras' cells computed them on every device. The step is Keras'
own implementation 2 (`LSTMCell.call`, `GRUCell.call`) with each cut of a
projection taken on the gate dimension: the same products and sums, in the
same order, as on one device.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import keras
import tensorflow as tf
from keras.src import tree
from tensorflow.experimental import dtensor

from tfmp.forward import BACKWARD_SCOPE, batch_spec, compute_specs, forward_mesh, relayout_with_gradient

# Keras' cells that run gate by gate, and their gates.
GATES = {keras.layers.LSTMCell: 4, keras.layers.GRUCell: 3}


def gate_split_axis(cell: Any) -> str | None:
    """The mesh axis that splits `cell`'s gate units, where its step can run
    gate by gate; else None.

    That is a Keras `LSTMCell` or `GRUCell` of implementation 2 (Keras' own
    default; recurrent dropout makes it 1) computing in its variables'
    dtype, whose kernels and bias are split on their columns only, over one
    mesh axis of more than one device whose size divides the units.
    """
    gates = GATES.get(type(cell))
    mesh = forward_mesh()
    if gates is None or mesh is None or cell.implementation != 2 or cell.compute_dtype != cell.variable_dtype:
        return None
    specs = [compute_specs(weight) for weight in _weights(cell)]
    if any(spec is None for spec in specs):
        return None
    axis = specs[0][-1]
    if axis not in mesh.dim_names or any(
        spec[-1] != axis or set(spec[:-1]) - {dtensor.UNSHARDED} for spec in specs
    ):
        return None
    if mesh.dim_size(axis) < 2 or cell.units % mesh.dim_size(axis):
        return None
    return axis


def gate_wise_recurrence(
    step_function: Callable, cell: Any, axis: str, inputs: Any
) -> tuple[Callable, tf.Tensor, list[tf.Tensor]] | None:
    """Keras' RNN step `step_function` over `cell` run gate by gate, with
    its gate units split over `axis`: `(step, projected inputs, constants)`
    for the recurrence, or None where the step's `training` flag cannot be
    read (a step that is not Keras' `RNN.inner_loop`'s) or `inputs` are not
    one tensor `(batch, time, features)`.

    The inputs' projection (their dropout first, and a GRU's input bias)
    is taken for every time step at once, before the loop, as one product:
    in the loop a step then reads its inputs' projection, split over `axis`
    as the gates are, and neither gathers its inputs nor reduces their
    gradient. The step takes the constants after its states: the recurrent
    kernel by gate (a GRU's with the reset gate before the product, in its
    two parts) and the bias the step adds. A part of a weight cut in the
    loop would have its gradient all-reduced over the batch at every step;
    cut before it, the gradient stays a partial sum until the loop ends.
    """
    try:
        cell_kwargs = inspect.getclosurevars(step_function).nonlocals.get("cell_kwargs")
    except (TypeError, ValueError):
        return None
    if not isinstance(cell_kwargs, dict) or not isinstance(inputs, tf.Tensor) or inputs.shape.rank != 3:
        return None
    training = cell_kwargs.get("training", False)
    if not isinstance(training, bool):
        return None
    kernel, recurrent_kernel, *bias = _by_gate_layout(cell, axis)
    if training and 0.0 < cell.dropout < 1.0:
        mask = cell.get_dropout_mask(inputs[:, 0])  # Keras' RNN draws it before the loop
        inputs = inputs * tf.expand_dims(mask, 1)
    projected = tf.einsum("bti,igu->btgu", inputs, kernel)
    if type(cell) is keras.layers.LSTMCell:
        cell_step, constants = _lstm_step, [recurrent_kernel, *bias]
    elif cell.reset_after:
        if bias:
            projected = projected + bias[0][0]
        cell_step, constants = _gru_step, [recurrent_kernel, *[b[1] for b in bias]]
    else:
        if bias:
            projected = projected + bias[0]
        cell_step, constants = _gru_reset_before_step, [recurrent_kernel[:, :2], recurrent_kernel[:, 2]]
    count = len(constants)

    def step(projected_t: tf.Tensor, states_and_constants: tuple) -> tuple[tf.Tensor, list[tf.Tensor]]:
        states, weights = states_and_constants[:-count], states_and_constants[-count:]
        with tf.name_scope(cell.name):
            return cell_step(cell, projected_t, states, *weights)

    return step, projected, constants


def units_whole(value: tf.Tensor, axis: str) -> tf.Tensor:
    """A gate-wise recurrence's output or state (batch first, units last),
    gathered over `axis` as Keras' cell computed it on every device; its
    gradient is cut back to each device's units. Both sides of both
    relayouts are explicit: left to DTensor, a gradient through a later
    gathered op (the reversal in `Bidirectional`) failed its layout
    propagation ("output layout of Relayout op after layout propagation does
    not match")."""
    mesh = forward_mesh()
    specs = [batch_spec(value, mesh, other_axis=axis)] + [dtensor.UNSHARDED] * (value.shape.rank - 2)
    whole = dtensor.Layout([*specs, dtensor.UNSHARDED], mesh)
    split = dtensor.Layout([*specs, axis], mesh)

    @tf.custom_gradient
    def gathered(value: tf.Tensor) -> tf.Tensor:
        def gradient(upstream: tf.Tensor) -> tf.Tensor:
            with tf.name_scope(BACKWARD_SCOPE):
                return dtensor.relayout(dtensor.relayout(upstream, whole), split)

        return dtensor.relayout(dtensor.relayout(value, split), whole), gradient

    return gathered(value)


def _weights(cell: Any) -> list[Any]:
    return [cell.kernel, cell.recurrent_kernel] + ([cell.bias] if cell.use_bias else [])


def _by_gate_layout(cell: Any, axis: str) -> list[tf.Tensor]:
    """`cell`'s kernel, recurrent kernel and bias (where it has one), each
    with its columns as `(gates, units)` and the units split over `axis`.
    Gathered whole, reshaped and cut again (its columns are split over
    `axis` alone), with the gradient's layouts explicit: DTensor's own
    failed where a layer ran twice on its weights ("output layout of
    Relayout op after layout propagation does not match")."""
    mesh = forward_mesh()
    gates = GATES[type(cell)]

    def by_gate(weight: Any) -> tf.Tensor:
        value = tf.convert_to_tensor(weight)
        rank = value.shape.rank
        read = dtensor.Layout(list(compute_specs(weight)), mesh)
        whole = relayout_with_gradient(value, dtensor.Layout.replicated(mesh, rank), read)
        shaped = tf.reshape(whole, [*value.shape[:-1], gates, cell.units])
        split = dtensor.Layout([dtensor.UNSHARDED] * rank + [axis], mesh)
        return relayout_with_gradient(shaped, split, dtensor.Layout.replicated(mesh, rank + 1))

    return [by_gate(weight) for weight in _weights(cell)]


def _recurrent(h: tf.Tensor, recurrent_kernel: tf.Tensor) -> tf.Tensor:
    """`h @ recurrent_kernel` for a kernel `(units, gates, units)`: `(batch, gates, units)`."""
    return tf.einsum("bi,igu->bgu", h, recurrent_kernel)


def _lstm_step(cell: Any, projected: tf.Tensor, states: tuple, recurrent_kernel: tf.Tensor, *bias) -> tuple:
    """`LSTMCell.call`, implementation 2, from the inputs' projection: `z =
    x @ kernel + h @ recurrent_kernel + bias`, added in that order."""
    h_tm1, c_tm1 = states[0], states[1]
    z = projected + _recurrent(h_tm1, recurrent_kernel)
    if bias:
        z = z + bias[0]
    c, o = cell._compute_carry_and_output_fused([z[:, gate] for gate in range(4)], c_tm1)  # noqa: SLF001
    h = o * cell.activation(c)
    return h, [h, c]


def _gru_step(cell: Any, matrix_x: tf.Tensor, states: tuple, recurrent_kernel: tf.Tensor, *bias) -> tuple:
    """`GRUCell.call`, implementation 2, reset gate after the product, from
    the inputs' projection with their bias (`matrix_x`)."""
    h_tm1 = states[0] if tree.is_nested(states) else states
    matrix_inner = _recurrent(h_tm1, recurrent_kernel)
    if bias:
        matrix_inner = matrix_inner + bias[0]
    z = cell.recurrent_activation(matrix_x[:, 0] + matrix_inner[:, 0])
    r = cell.recurrent_activation(matrix_x[:, 1] + matrix_inner[:, 1])
    hh = cell.activation(matrix_x[:, 2] + r * matrix_inner[:, 2])
    h = z * h_tm1 + (1 - z) * hh
    return h, [h]


def _gru_reset_before_step(
    cell: Any, matrix_x: tf.Tensor, states: tuple, update_and_reset: tf.Tensor, candidate: tf.Tensor
) -> tuple:
    """`GRUCell.call`, implementation 2, reset gate before the product
    (`reset_after=False`): `update_and_reset` is the recurrent kernel's
    first two gates, `candidate` its third."""
    h_tm1 = states[0] if tree.is_nested(states) else states
    matrix_inner = _recurrent(h_tm1, update_and_reset)
    z = cell.recurrent_activation(matrix_x[:, 0] + matrix_inner[:, 0])
    r = cell.recurrent_activation(matrix_x[:, 1] + matrix_inner[:, 1])
    hh = cell.activation(matrix_x[:, 2] + tf.einsum("bi,iu->bu", r * h_tm1, candidate))
    h = z * h_tm1 + (1 - z) * hh
    return h, [h]
