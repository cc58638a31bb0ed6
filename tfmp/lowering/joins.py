"""Concatenation, stacking and unstacking with the joined dimension whole.

DTensor expands `ConcatV2`, `Pack` and `Unpack` shard by shard, which is
right only while the joined (or unstacked) dimension is whole on every
device. Layout propagation still splits it whenever a neighbour asks:

- A row-parallel Dense after `keras.layers.Concatenate` asks in the backward
  pass, where its kernel's gradient (split on rows, like the kernel) is the
  concatenation times the output gradient. With a positive axis DTensor then
  refuses ("Concat op SPMD with concat dimension in sharded dimension is not
  supported"); with a negative one, Keras' default `axis=-1`, its check
  compares -1 with dimension numbers and never fires, and every device
  concatenates its own shards: the model trains on features in the wrong
  order, silently.
- `ops.stack` of rows of a batch-split tensor (a loop over the batch)
  gets the batch's split on its new dimension, and `ops.unstack` of box
  coordinates split over "model" (SAM3) reads shards of the wrong size
  ("SPMD expansion resulted in op output inconsistent with the provided
  layout").

On a mesh, tfmp joins on a non-negative axis and reads the result whole
along it through a slice that drops a leading copy of the first part's
first element: DTensor asks the input of such a slice (one that does not
start at 0) whole on that dimension, and lays out its result any way its
consumers ask, slicing locally (no communication). Stacks join values
given a new dimension of length 1; an unstacked tensor is first read so.
The gradient of each part is its slice of the result's gradient. A matrix
is pinned by a relayout instead (its other dimension as it comes); DTensor's
relayouts name at most one dimension "as it comes", so higher ranks take
the slice. Only floating-point values are pinned: integers and booleans
joined in a step are shapes, indices and masks (a shape vector behind a
relayout is no longer known when traced); they are joined on the
non-negative axis, where DTensor refuses a split one rather than join
shards. (A gather of every position pins the same dimension, but
DTensor's gather refuses a result laid out unlike its input on the other
dimensions, which RoPE's halves with heads split over "model" meet.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.ops import array_ops

from tfmp.forward import forward_mesh
from tfmp.integrations import Patch


def concat_kept_whole_on_axis(concat: Callable) -> Callable:
    """`tf.concat` that, in a forward pass on a mesh, keeps the joined
    dimension whole where the parts are joined. Elsewhere, and for parts of
    unknown rank or an axis computed in the step, TensorFlow's own."""

    @functools.wraps(concat)
    def wrapper(values, axis, name="concat"):
        axis_value = _static_axis(values, axis, extra_dimension=False)
        if axis_value is None:
            return concat(values, axis, name=name)
        parts = [tf.convert_to_tensor(value) for value in values]
        return _joined_on_mesh(parts, axis_value, lambda: concat(parts, axis_value, name=name))

    return wrapper


def stack_kept_whole_on_axis(stack: Callable) -> Callable:
    """`tf.stack` that, in a forward pass on a mesh, keeps the new dimension
    whole where the values are stacked."""

    @functools.wraps(stack)
    def wrapper(values, axis=0, name="stack"):
        axis_value = _static_axis(values, axis, extra_dimension=True)
        if axis_value is None:
            return stack(values, axis, name=name)
        values = [tf.convert_to_tensor(value) for value in values]
        if not _is_float(values[0]):  # shapes: no ops added beside the stack
            return stack(values, axis_value, name=name)
        parts = [tf.expand_dims(value, axis_value) for value in values]
        return _joined_on_mesh(parts, axis_value, lambda: stack(values, axis_value, name=name))

    return wrapper


def unstack_whole_axis(unstack: Callable) -> Callable:
    """`tf.unstack` that, in a forward pass on a mesh, unstacks a tensor
    whole along the unstacked dimension."""

    @functools.wraps(unstack)
    def wrapper(value, num=None, axis=0, name="unstack"):
        rank = getattr(getattr(value, "shape", None), "rank", None)
        if forward_mesh() is None or not rank or not isinstance(axis, int):
            return unstack(value, num, axis, name)
        value, axis = tf.convert_to_tensor(value), axis % rank
        if not _is_float(value):
            return unstack(value, num, axis, name)
        return unstack(read_whole_along(value, axis), num, axis, name)

    return wrapper


def _joined_on_mesh(parts: list[tf.Tensor], axis: int, join: Callable[[], tf.Tensor]) -> tf.Tensor:
    """`parts` joined along `axis` (TensorFlow's own `join()` gives the same
    values), whole along it where floats are joined."""
    if not _is_float(parts[0]):
        return join()
    if parts[0].shape.rank <= 2:
        return read_whole_along(join(), axis)
    joined = joined_whole(parts, axis)
    return join() if joined is None else joined


def read_whole_along(value: tf.Tensor, axis: int) -> tf.Tensor:
    """`value`, laid out whole along `axis` where it is made (see the
    module's docstring). The gradient passes through unchanged."""
    if value.shape.rank <= 2:
        specs = [dtensor.MATCH] * value.shape.rank
        specs[axis] = dtensor.UNSHARDED
        return dtensor.relayout(value, dtensor.Layout(specs, forward_mesh()))
    joined = joined_whole([value], axis)
    return value if joined is None else joined


def joined_whole(parts: list[tf.Tensor], axis: int) -> tf.Tensor | None:
    """The concatenation of `parts` along `axis`, made whole along it; None
    where a part's length along `axis` is not known when traced, or all
    are empty."""
    lengths = [part.shape[axis] for part in parts]
    if None in lengths or not any(lengths):
        return None
    rank = parts[0].shape.rank
    first = next(index for index, length in enumerate(lengths) if length)

    def window(start: int, size: int) -> tuple[list[int], list[int]]:
        begin, sizes = [0] * rank, [-1] * rank
        begin[axis], sizes[axis] = start, size
        return begin, sizes

    @tf.custom_gradient
    def joined(*parts: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        lead = tf.slice(parts[first], *window(0, 1))
        whole = array_ops.concat([lead, *parts], axis)

        def gradient(upstream: tf.Tensor) -> list[tf.Tensor]:
            starts = np.cumsum([0, *lengths[:-1]])
            return [tf.slice(upstream, *window(int(start), length)) for start, length in zip(starts, lengths)]

        return tf.slice(whole, *window(1, -1)), gradient

    return joined(*parts)


def _is_float(value: tf.Tensor) -> bool:
    """Whether `value` is an activation's kind of tensor: integers and
    booleans joined in a step are shapes, indices and masks (a shape pinned
    by a relayout is no longer known when traced), and keep TensorFlow's
    join on the non-negative axis, where DTensor refuses a split one."""
    return value.dtype.is_floating or value.dtype.is_complex


def _static_axis(values: Any, axis: Any, extra_dimension: bool) -> int | None:
    """The non-negative axis to join `values` on in a forward pass on a
    mesh; None where TensorFlow's own join runs (no mesh, fewer than two
    values, unknown rank, an axis computed in the step)."""
    if forward_mesh() is None or not isinstance(values, (list, tuple)) or len(values) < 2:
        return None
    ranks = {getattr(getattr(value, "shape", None), "rank", None) for value in values} - {None}
    axis_value = tf.get_static_value(axis)
    if len(ranks) != 1 or axis_value is None:
        return None
    rank = ranks.pop() + (1 if extra_dimension else 0)
    return int(axis_value) % rank if rank else None


# TensorFlow functions patched with this family's code while a strategy exists.
PATCHES = (
    Patch(
        "tensorflow",
        "concat",
        concat_kept_whole_on_axis,
        "DTensor concatenates shards when layout propagation splits the "
        "joined dimension: wrong values silently for axis=-1 "
        "(keras.layers.Concatenate before a row-parallel Dense).",
        parameters=("values", "axis", "name"),
    ),
    Patch(
        "tensorflow",
        "stack",
        stack_kept_whole_on_axis,
        "DTensor's Pack gives shards of the wrong size when layout "
        "propagation splits the new dimension (a loop over the batch).",
        parameters=("values", "axis", "name"),
    ),
    Patch(
        "tensorflow",
        "unstack",
        unstack_whole_axis,
        "DTensor's Unpack gives shards of the wrong size when the unstacked "
        "dimension is split (SAM3's box coordinates).",
        parameters=("value", "num", "axis", "name"),
    ),
)
