"""Recurrent layers as one loop with its own gradient, sequence reversal as a gather.

Keras' TensorFlow backend runs a recurrence as a `tf.while_loop` over
TensorArrays, whose TensorList ops (and those of while_v2's gradient) DTensor
cannot lay out; on a GPU its LSTM and GRU call cuDNN kernels DTensor cannot
expand; and DTensor's `Split` refuses the gate dimension of an LSTM or GRU
whose kernel columns are split over the mesh. On a mesh, tfmp runs the
recurrence as one `tf.while_loop` over tensors, with a backward loop as its
gradient (`tfmp.lowering.rnn_loop`): the graph holds one step whatever the
sequence's length, which may be known only at run time. Where the step
cannot run again in the gradient (it draws random numbers, changes a
variable, reads a tensor whose gradient is taken) or a dimension other than
time is unknown when traced, tfmp unrolls it over its static time steps
(Keras' own `unroll=True` path: unstack, Python loop, stack). LSTM and GRU
stay on that generic path; where their gate units are split over the mesh,
their step runs gate by gate (`tfmp.lowering.rnn_gates`). A sequence run
backwards is reversed with a gather of reversed indices (`ReverseV2` has no
layout rule), and splits are slices. A TensorArray a layer fills in a
Python loop is a list of tensors on a mesh.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, NoReturn

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.ops import tensor_array_ops
from keras.src import tree
from keras.src.backend.common.name_scope import current_path
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.backend.tensorflow.core import convert_to_tensor

from tfmp.forward import batch_spec, forward_mesh
from tfmp.integrations import Patch
from tfmp.lowering.registry import Lowering, keras_original
from tfmp.lowering.rnn_gates import gate_split_axis, gate_wise_recurrence, units_whole
from tfmp.lowering.rnn_loop import looped_rnn

_BACKEND = "keras.src.backend"
# Keras' cells whose step computes each row of a batch on its own.
_ROW_WISE_CELLS = (keras.layers.LSTMCell, keras.layers.GRUCell, keras.layers.SimpleRNNCell)
_KERAS_RNN = "keras.src.backend.tensorflow.rnn"
_NUMPY = "keras.src.backend.tensorflow.numpy"


def rnn(
    step_function: Callable,
    inputs: Any,
    initial_states: Any,
    go_backwards: bool = False,
    mask: tf.Tensor | None = None,
    constants: list[tf.Tensor] | None = None,
    unroll: bool = False,
    input_length: int | None = None,
    time_major: bool = False,
    zero_output_for_mask: bool = False,
    return_all_outputs: bool = True,
) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
    """Keras' `backend.rnn` as one loop, else unrolled over the static time steps.

    Takes and returns what Keras' `keras.src.backend.tensorflow.rnn.rnn` does;
    `unroll` is ignored. The loop is `tfmp.lowering.rnn_loop.looped_rnn`.
    Keras' unrolled path slices the time steps with `Unpack`, masks with
    `Select` and joins them with `Pack`, all of which DTensor lays out; its
    graph grows with the number of steps.

    Raises:
        ValueError: If the recurrence cannot loop and the number of time
            steps is not known when tracing.
    """
    time_axis = 0 if time_major else 1
    first_input = tree.flatten(inputs)[0]
    time_steps = first_input.shape[time_axis]
    symbolic = in_symbolic_scope()
    if time_steps is None and symbolic:
        # Keras only infers output shapes here: the graph never runs.
        return keras_original(_KERAS_RNN, "rnn")(
            step_function,
            inputs,
            initial_states,
            go_backwards=go_backwards,
            mask=mask,
            constants=constants,
            unroll=unroll,
            input_length=input_length,
            time_major=time_major,
            zero_output_for_mask=zero_output_for_mask,
            return_all_outputs=return_all_outputs,
        )
    if go_backwards:
        # Keras' unrolled path zeroes masked outputs (zero_output_for_mask)
        # with the mask in forward order while its outputs are in backward
        # order; running forward over reversed inputs and mask avoids that.
        inputs = tree.map_structure(lambda t: _reversed(convert_to_tensor(t), time_axis), inputs)
        mask = None if mask is None else _reversed(convert_to_tensor(mask), time_axis)
    cells = _row_wise_cells(step_function)
    looped_step, looped_inputs, by_gate = step_function, inputs, []
    # Gate by gate where the number of time steps is known when traced: over
    # an unknown number, DTensor failed the gradient of the kernels' relayout
    # ("output layout of Relayout op after layout propagation does not match").
    by_gates = cells and len(cells) == 1 and not (symbolic or time_major) and time_steps is not None
    axis = gate_split_axis(cells[0]) if by_gates else None
    gate_wise = None if axis is None else gate_wise_recurrence(step_function, cells[0], axis, inputs)
    if gate_wise is not None:
        looped_step, looped_inputs, by_gate = gate_wise
    looped = None if symbolic else looped_rnn(
        looped_step,
        looped_inputs,
        initial_states,
        mask,
        list(constants or []) + by_gate,
        time_major,
        zero_output_for_mask,
        return_all_outputs,
        row_wise_cells=cells,
        devices=getattr(forward_mesh(), "size", 1),
        batch_shards=_batch_shards(first_input.shape[1 if time_major else 0]),
    )
    if looped is not None and gate_wise is not None:
        last_output, outputs, states = looped
        whole = functools.partial(units_whole, axis=axis)
        return whole(last_output), whole(outputs), tree.map_structure(whole, states)
    if looped is not None:
        return looped
    if time_steps is None:
        raise ValueError(
            f"Layer '{current_path() or 'rnn'}' runs a recurrence over input of shape "
            f"{first_input.shape}, whose number of time steps (axis {time_axis}) is "
            "unknown when traced. On a tfmp mesh a recurrence runs as one loop over "
            "any number of time steps only when every other dimension is known (a "
            "last batch smaller than the others is traced with an unknown batch: "
            "batch with drop_remainder=True, e.g. padded_batch(8, drop_remainder=True)) "
            "and its step can run again in the gradient (it draws no random numbers, "
            "changes no variable and reads no tensor whose gradient is taken other than "
            "its inputs, states and constants: draw such noise once per sequence, before "
            "the layer). Otherwise it is unrolled over a static number of time steps: "
            "give the model's Input a fixed sequence length, e.g. keras.Input((timesteps, "
            "features)), and pad shorter sequences to it (with Masking or "
            "Embedding(mask_zero=True) to skip the padding)."
        )
    last_output, outputs, states = keras_original(_KERAS_RNN, "rnn")(
        step_function,
        inputs,
        initial_states,
        mask=mask,
        constants=constants,
        unroll=True,
        time_major=time_major,
        zero_output_for_mask=zero_output_for_mask,
        return_all_outputs=return_all_outputs,
        input_length=time_steps,
    )
    if not return_all_outputs:
        # Keras' unrolled path broadcasts this one step against the whole mask
        # when it zeroes masked outputs; the loop's answer is the last output.
        outputs = tf.expand_dims(last_output, time_axis)
    return last_output, outputs, states


def _row_wise_cells(step_function: Callable) -> list | None:
    """The cells of Keras' RNN step `step_function` (the `step` its
    `RNN.inner_loop` passes, which holds the layer as `self`) when each is one
    of Keras' own cells, which compute every row of a batch on its own; else
    None (a cell of the user's own may mix rows)."""
    try:
        layer = inspect.getclosurevars(step_function).nonlocals.get("self")
    except (TypeError, ValueError):  # not a Python function; a closure cell still empty
        return None
    cell = getattr(layer, "cell", None) if isinstance(layer, keras.layers.RNN) else None
    cells = cell.cells if isinstance(cell, keras.layers.StackedRNNCells) else [cell]
    if all(type(c) in _ROW_WISE_CELLS for c in cells):
        return cells
    return None


def generic_recurrence(*args: Any, **kwargs: Any) -> NoReturn:
    """Keras' fused (cuDNN) `backend.lstm`/`backend.gru` on a mesh: declines.

    Raising `NotImplementedError` is Keras' signal to fall back to the layer's
    generic loop over its cell (`backend.rnn`, unrolled on a mesh), which is
    what it does on a CPU anyway.

    Raises:
        NotImplementedError: Always.
    """
    raise NotImplementedError("cuDNN kernels do not run on a DTensor mesh")


def split(x: Any, indices_or_sections: int | list[int], axis: int = 0) -> list[tf.Tensor]:
    """Keras' `numpy.split` as slices, which DTensor lays out on any dimension.

    DTensor's `Split` refuses a dimension split over the mesh; an LSTM or GRU
    cell splits its gate pre-activations into gates, and with the kernel's
    columns (the gate units) on "model" that dimension is split. DTensor
    gathers a sliced dimension: the all-gather that follows a column-parallel
    matmul. Where the cuts are not known when tracing (a dimension of unknown
    length, symbolic indices), and for a length that does not divide evenly
    (which Keras rejects), this is Keras' own.

    Args:
        x: A tensor.
        indices_or_sections: The number of equal parts, or the indices to cut at.
        axis: The axis to cut.

    Returns:
        The parts, as Keras' `split` returns them.
    """
    x = convert_to_tensor(x)
    cuts = _static_cuts(x.shape[axis], indices_or_sections)
    if cuts is None:
        return keras_original(_NUMPY, "split")(x, indices_or_sections, axis=axis)
    index = [slice(None)] * x.shape.rank
    parts = []
    for start, stop in zip([0, *cuts], [*cuts, x.shape[axis]]):
        index[axis] = slice(start, stop)
        parts.append(x[tuple(index)])
    return parts


def _static_cuts(length: int | None, indices_or_sections: Any) -> list[int] | None:
    """Where `split` cuts, or None where that is not known when tracing."""
    if length is None:
        return None
    if isinstance(indices_or_sections, int):
        sections = indices_or_sections
        if sections < 1 or length % sections:
            return None  # Keras raises its own error
        return [length * i // sections for i in range(1, sections)]
    try:
        return [int(i) for i in indices_or_sections]
    except TypeError:  # symbolic indices
        return None


def _batch_shards(batch: int | None) -> int:
    """The devices a recurrence's batch of `batch` rows is split over."""
    mesh = forward_mesh()
    axis = None if mesh is None else batch_spec(tf.TensorSpec([batch]), mesh, None)
    return 1 if axis in (None, dtensor.UNSHARDED) else mesh.dim_size(axis)


def _reversed(x: tf.Tensor, axis: int) -> tf.Tensor:
    """`x` with the entries along `axis` in reverse order, as a gather of
    reversed indices (`ReverseV2` has no layout rule; the gather keeps the
    other dimensions' splits)."""
    length = x.shape[axis]
    if length is None:
        length = tf.shape(x)[axis]
    return tf.gather(x, tf.range(length - 1, -1, -1), axis=axis)


def list_backed_tensor_arrays(init: Callable) -> Callable:
    """`tf.TensorArray(...)` made in a forward pass on a mesh, with a static
    size: a Python list of tensors (TensorFlow's own eager TensorArray), so
    writes at Python indices and `stack()` are ordinary ops DTensor lays out.

    A layer that fills a TensorArray in a Python loop (RWKV-7's time mix)
    otherwise runs TensorList ops, which DTensor cannot lay out
    ("'tf.TensorListStack' op does not implement layout propagation"). A
    TensorArray with a size known only in the step, or made from a handle
    or flow (a `tf.while_loop`'s), stays TensorFlow's graph TensorArray.
    """

    @functools.wraps(init)
    def wrapper(self, dtype, size=None, dynamic_size=None, *args, **kwargs):
        static_size = None if size is None else tf.get_static_value(size)
        graph_array = (
            forward_mesh() is None
            or static_size is None
            or dynamic_size
            or kwargs.get("handle") is not None
            or kwargs.get("flow") is not None
        )
        if graph_array:
            return init(self, dtype, size, dynamic_size, *args, **kwargs)
        for unused in ("handle", "flow", "tensor_array_name", "name"):
            kwargs.pop(unused, None)
        self._implementation = tensor_array_ops._EagerTensorArray(  # noqa: SLF001
            dtype, size=int(static_size), *args, **kwargs
        )
        self._implementation.parent = weakref.ref(self)

    return wrapper


LOWERINGS: tuple[Lowering, ...] = (
    Lowering(
        _NUMPY,
        "split",
        split,
        "Split refuses a dimension split over the mesh (an LSTM/GRU's gates on \"model\")",
    ),
    Lowering(
        _BACKEND,
        "rnn",
        rnn,
        "tf.while_loop over TensorArrays: TensorList ops have no DTensor layout propagation",
    ),
    Lowering(_BACKEND, "lstm", generic_recurrence, "cuDNN's CudnnRNNV3 on a GPU"),
    Lowering(_BACKEND, "gru", generic_recurrence, "cuDNN's CudnnRNNV3 on a GPU"),
)

# TensorFlow functions patched with this family's code while a strategy exists.
PATCHES = (
    Patch(
        "tensorflow.python.ops.tensor_array_ops:TensorArray",
        "__init__",
        list_backed_tensor_arrays,
        "A TensorArray filled in a Python loop (RWKV-7) runs TensorList ops, "
        "which DTensor cannot lay out.",
        parameters=("dtype", "size", "dynamic_size", "handle", "flow"),
    ),
)
