"""A recurrence on a mesh as one `tf.while_loop` with its own gradient.

Keras' loop keeps its steps in TensorArrays, and TensorFlow's gradient of any
`tf.while_loop` keeps each step's intermediates in TensorLists; DTensor lays
out neither. This loop keeps the outputs and the states entering each step in
tensors of shape `(time, batch, ...)` (`tfmp.lowering.time_steps`: a step is
read as a slice and written as a scatter of one row, ops DTensor lays out,
in blocks of steps over long sequences; against a one-hot of the time step
where the number of steps is unknown when traced), and its
gradient is a second loop, backwards over time, that runs the step again under
a tape from the stored states and adds up what each step gives to the
weights, the states and the inputs. The graph holds the step twice (forward
and backward), whatever the number of time steps, and takes sequences whose
length is known only when the step runs. Where DTensor would all-reduce a
step's weights gradient in every iteration (Keras' GRU), the weights'
gradient is taken after the backward loop, over all time steps at once.

A step that draws random numbers or changes a variable would draw or change
again in the backward loop, and a step that reads a tensor the tape watches
(other than its inputs, states and constants) would lose that gradient; and
DTensor lays out a loop only with every dimension but time known when
traced. For those, `looped_rnn` returns None and the caller unrolls.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple

import tensorflow as tf
from keras.src import tree
from tensorflow.python.eager import record
from tensorflow.python.framework import func_graph

from tfmp.lowering.time_steps import over_time, read, time_buffer, written

# Ops a step may hold that give the same values when run again.
_REPEATABLE_STATEFUL_OPS = frozenset({"ReadVariableOp", "VarHandleOp", "DTensorLayout", "Relayout"})
_SLICES = frozenset({"StridedSlice", "Slice", "Split", "SplitV", "GatherV2"})
_PASSING_OPS = frozenset({"Identity", "DTensorLayout", "Relayout", "Cast"})


def looped_rnn(
    step_function: Callable,
    inputs: Any,
    initial_states: Any,
    mask: tf.Tensor | None,
    constants: list[tf.Tensor],
    time_major: bool,
    zero_output_for_mask: bool,
    return_all_outputs: bool,
    row_wise_cells: list | None = None,
    devices: int = 1,
    batch_shards: int = 1,
) -> tuple[tf.Tensor, tf.Tensor, Any] | None:
    """Keras' `backend.rnn` (forward in time) as a loop, or None where the
    step cannot be run again in the gradient (see the module's note).

    `row_wise_cells`: the step's cells where each computes every row of a
    batch on its own (Keras' own cells): on a mesh of `devices` > 1, the
    weights' gradient is then taken over all time steps at once, after the
    backward loop. `batch_shards`: the devices the batch is split over."""
    flat_inputs = [_time_major(tf.convert_to_tensor(x), time_major) for x in tree.flatten(inputs)]
    flat_states = [tf.convert_to_tensor(s) for s in tree.flatten(tuple(initial_states))]
    constants = [tf.convert_to_tensor(c) for c in constants]
    if mask is not None:
        mask = tf.cast(mask, tf.bool)
        if mask.shape.rank == 2:
            mask = tf.expand_dims(mask, -1)
        mask = _time_major(mask, time_major)

    def cell(step_inputs, states, previous_output, mask_t, step_constants):
        output, new_states = step_function(
            tree.pack_sequence_as(inputs, step_inputs),
            tuple(tree.pack_sequence_as(tuple(initial_states), states)) + tuple(step_constants),
        )
        new_states = tree.flatten(new_states)
        if mask_t is not None:
            if previous_output is None:
                previous_output = tf.zeros_like(output)
            output = tf.where(_expanded(mask_t, output), output, previous_output)
            new_states = [tf.where(_expanded(mask_t, new), new, old) for new, old in zip(new_states, states)]
        return output, new_states

    if tf.executing_eagerly():
        return None  # a step's captured eager tensors are constants in a trace: unseen
    if not _static_but_time(flat_inputs, flat_states, constants):
        return None
    probed = _probed_step(cell, flat_inputs, flat_states, mask, constants)
    if probed is None:
        return None
    step_variables = probed.variables
    n_in, n_states = len(flat_inputs), len(flat_states)

    @tf.custom_gradient
    def recurrence(*arguments):
        xs = list(arguments[:n_in])
        states0 = list(arguments[n_in : n_in + n_states])
        step_constants = list(arguments[n_in + n_states :])
        steps = xs[0].shape[0] or tf.shape(xs[0])[0]
        mask_at = (lambda t: None) if mask is None else (lambda t: read(mask, t, steps))

        first, states1 = cell([read(x, 0, steps) for x in xs], states0, None, mask_at(0), step_constants)
        outputs = written(time_buffer(steps, first), 0, first, steps)
        entering = [written(time_buffer(steps, s), 0, s, steps) for s in states0]

        def forward(t, carry):
            previous, states = carry
            output, new_states = cell([read(x, t, steps) for x in xs], states, previous, mask_at(t), step_constants)
            return (output, new_states), [output, *states], []

        (last, final_states), (outputs, *entering), _ = over_time(
            1, steps, forward, (first, states1), [outputs, *entering], batch_shards=batch_shards
        )
        results = (outputs, last, *final_states)

        def step_gradients(t, d_output, d_states, variables):
            """What step `t` gives to its inputs, the states and the output
            entering it, its constants and `variables`."""
            first_step = isinstance(t, int)  # the loop's steps have a tensor `t`
            step_inputs = [read(x, t, steps) for x in xs]
            states = [read(buffer, t, steps) for buffer in entering]
            previous = tf.zeros_like(last) if first_step else read(outputs, t - 1, steps)
            watched = step_inputs + states + [previous] + step_constants
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(watched)
                tape.watch(variables)
                output, new_states = cell(
                    step_inputs, states, None if first_step else previous, mask_at(t), step_constants
                )
            grads = tape.gradient(
                [output] + new_states,
                watched + variables,
                output_gradients=[d_output] + d_states,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            d_inputs, grads = grads[:n_in], grads[n_in:]
            d_states, grads = grads[:n_states], grads[n_states:]
            return d_inputs, d_states, grads[0], grads[1 : 1 + len(step_constants)], grads[1 + len(step_constants) :]

        def all_steps_gradients(upstream):
            """The variables' gradient from every time step at once: the steps
            run again as the rows of one batch, under one tape."""
            with _dropout_masks_as_rows(row_wise_cells, steps), tf.GradientTape(
                watch_accessed_variables=False
            ) as tape:
                tape.watch(step_variables)
                output, new_states = cell(
                    [_as_rows(x) for x in xs],
                    [_as_rows(s) for s in entering],
                    None,
                    None if mask is None else _as_rows(mask),
                    step_constants,
                )
            return tape.gradient(
                [output] + new_states,
                step_variables,
                output_gradients=[_as_rows(u) for u in upstream],
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )

        # Each step's gradient with respect to a variable sums over the batch.
        # DTensor carries that sum over a split batch through the loop and
        # all-reduces it once, except where it flows into the gradient of a
        # slice of the variable (a GRU's bias halves): there it all-reduces
        # in every iteration (a GRU on 8x1 stepped 2.9x slower than with the
        # sum taken after the loop). The steps then run again after the
        # loop, as the rows of one batch, for the variables' gradient: a cell
        # must compute each row on its own, and the number of steps be known
        # when traced (DTensor cannot lay out the rows' reshape otherwise).
        # On one device nothing is all-reduced, and running the steps again
        # would only cost time (a GRU's step 1.4x as long).
        all_at_once = (
            devices > 1
            and probed.slices_a_variable
            and isinstance(steps, int)
            and row_wise_cells is not None
        )
        per_step_variables = [] if all_at_once else step_variables

        def backward(d_outputs, d_last, *d_final_states):
            def step(t, carry):
                d_output, d_states = carry
                d_output = d_output + read(d_outputs, t, steps)
                upstream = [d_output, *d_states] if all_at_once else []
                d_inputs, d_states, d_previous, d_step_constants, d_step_variables = step_gradients(
                    t, d_output, d_states, per_step_variables
                )
                return (d_previous, d_states), d_inputs + upstream, d_step_constants + d_step_variables

            buffers = [tf.zeros_like(x) for x in xs]
            if all_at_once:
                buffers += [tf.zeros_like(buffer) for buffer in [outputs, *entering]]
            sums = [tf.zeros_like(c) for c in step_constants] + [tf.zeros_like(v) for v in per_step_variables]
            (d_output, d_states), buffers, sums = over_time(
                1, steps, step, (d_last, list(d_final_states)), buffers, sums, reverse=True, batch_shards=batch_shards
            )
            d_constants, d_variables = sums[: len(step_constants)], sums[len(step_constants) :]
            d_xs, upstream = buffers[:n_in], buffers[n_in:]
            d_output = d_output + read(d_outputs, 0, steps)
            d_inputs, d_states0, _, d_step_constants, d_step_variables = step_gradients(
                0, d_output, d_states, per_step_variables
            )
            d_xs = [written(d, 0, g, steps) for d, g in zip(d_xs, d_inputs)]
            d_constants = [a + b for a, b in zip(d_constants, d_step_constants)]
            if all_at_once:
                upstream = [written(u, 0, g, steps) for u, g in zip(upstream, [d_output, *d_states])]
                d_variables = all_steps_gradients(upstream)
            else:
                d_variables = [a + b for a, b in zip(d_variables, d_step_variables)]
            return d_xs + d_states0 + d_constants + d_variables

        # Traced now, while the step sees what it saw going forward (Keras'
        # RNN clears the dropout masks its cells cache once the layer has run,
        # before the gradient is taken).
        backward = tf.function(backward, autograph=False).get_concrete_function(
            *[tf.TensorSpec.from_tensor(r) for r in results]
        )

        def gradient(*upstream, variables=None):
            upstream = [tf.zeros_like(r) if g is None else g for g, r in zip(upstream, results)]
            grads = backward(*upstream)
            n_arguments = len(arguments)
            by_variable = {id(v): g for v, g in zip(step_variables, grads[n_arguments:])}
            return grads[:n_arguments], [by_variable.get(id(v)) for v in variables or ()]

        return results, gradient

    outputs, last_output, *final_states = recurrence(*flat_inputs, *flat_states, *constants)
    if zero_output_for_mask and mask is not None:
        last_output = tf.where(_expanded(mask[-1], last_output), last_output, tf.zeros_like(last_output))
        outputs = tf.where(_expanded(mask, outputs), outputs, tf.zeros_like(outputs))
    if return_all_outputs:
        outputs = _time_major(outputs, time_major)
    else:
        outputs = tf.expand_dims(last_output, 0 if time_major else 1)
    return last_output, outputs, tree.pack_sequence_as(tuple(initial_states), final_states)


class _ProbedStep(NamedTuple):
    variables: list  # the trainable variables one step reads
    slices_a_variable: bool  # whether it reads a part of one (a GRU's bias halves)


def _probed_step(cell: Callable, inputs: list, states: list, mask: Any, constants: list) -> _ProbedStep | None:
    """One step traced apart (never run), or None where the step cannot run
    again in the gradient: it holds an op that would not repeat its values,
    or reads a tensor a tape watches other than its arguments."""
    probe = func_graph.FuncGraph("tfmp_rnn_step_probe")
    with probe.as_default(), tf.GradientTape() as tape:
        step_inputs = [tf.compat.v1.placeholder(x.dtype, x.shape[1:]) for x in inputs]
        step_states = [tf.compat.v1.placeholder(s.dtype, s.shape) for s in states]
        step_constants = [tf.compat.v1.placeholder(c.dtype, c.shape) for c in constants]
        mask_t = None if mask is None else tf.compat.v1.placeholder(tf.bool, mask.shape[1:])
        cell(step_inputs, step_states, None, mask_t, step_constants)
    for op in probe.get_operations():
        if op._is_stateful and op.type not in _REPEATABLE_STATEFUL_OPS:  # noqa: SLF001
            return None
    captured = [t for t in probe.external_captures if t.dtype != tf.resource and t.dtype.is_floating]
    if captured and record.should_record_backprop(captured):
        return None
    # A slice's value is its first input, `Split`'s its second.
    sliced = any(
        op.type in _SLICES and any(_reads_variable(value.op) for value in op.inputs[:2])
        for op in probe.get_operations()
    )
    return _ProbedStep(list(tape.watched_variables()), sliced)


def _reads_variable(op: tf.Operation) -> bool:
    """Whether `op` reads a variable, through ops that pass values on."""
    while op.type in _PASSING_OPS:
        op = op.inputs[0].op
    return op.type == "ReadVariableOp"


def _static_but_time(inputs: list, states: list, constants: list) -> bool:
    """Whether every dimension but the inputs' time steps is known when
    traced. DTensor lays out a loop's step with the shapes it was traced
    with; inside it, an unknown dimension (the batch of a last, smaller
    batch, which Keras traces with the batch dimension unknown) leaves
    shape arithmetic of the gradient it cannot resolve ("failed to extract
    constant value from tf.BroadcastGradientArgs")."""
    shapes = [x.shape[1:] for x in inputs] + [t.shape for t in states + constants]
    return all(shape.is_fully_defined() for shape in shapes)


def _time_major(x: tf.Tensor, time_major: bool) -> tf.Tensor:
    """`x` with its first two dimensions swapped unless already time-major."""
    if time_major:
        return x
    return tf.transpose(x, [1, 0, *range(2, x.shape.rank)])


def _as_rows(buffer: tf.Tensor) -> tf.Tensor:
    """A time-first buffer `(time, batch, ...)` as rows `(batch * time, ...)`,
    batch first, so that a split of the batch stays a split of the rows."""
    batch_first = tf.transpose(buffer, [1, 0, *range(2, buffer.shape.rank)])
    return tf.reshape(batch_first, [-1, *buffer.shape[2:]])


@contextlib.contextmanager
def _dropout_masks_as_rows(cells: list, steps: int) -> Iterator[None]:
    """Each Keras cell's dropout masks, which it draws once per batch and
    caches (one row per sequence), repeated for every time step of their
    sequence while the steps run as rows (`_as_rows`)."""
    cached = [
        (cell, name, getattr(cell, name))
        for cell in cells
        for name in ("_dropout_mask", "_recurrent_dropout_mask")
        if getattr(cell, name, None) is not None
    ]
    for cell, name, mask in cached:
        setattr(cell, name, tf.nest.map_structure(lambda m: _as_rows(tf.broadcast_to(m, [steps, *m.shape])), mask))
    try:
        yield
    finally:
        for cell, name, mask in cached:
            setattr(cell, name, mask)


def _expanded(mask: tf.Tensor, value: tf.Tensor) -> tf.Tensor:
    """`mask` with trailing dimensions of 1 to broadcast against `value` in
    `tf.where` (Keras' loop tiles it: the same values)."""
    for _ in range(value.shape.rank - mask.shape.rank):
        mask = tf.expand_dims(mask, -1)
    return mask
