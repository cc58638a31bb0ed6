"""Rolls, sorts and transposes written with ops DTensor lays out.

- `roll` is `tf.roll`, which DTensor has no layout rule for. Run replicated
  by DTensor's switch (`tfmp._env.REPLICATED_OPS`), it fails on a tensor
  split over two mesh axes: DTensor gathers both axes in one relayout,
  which its gather lowering (`LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2`,
  set by tfmp) cannot do ("'tf.Reshape' op requires 'output' number of
  elements to match"). On a mesh it is a gather of the rolled positions
  along each axis.
- `sort` and `argsort` run `TopKV2`, whose outputs DTensor refuses split
  on the sorted dimension ("The last dimensions of TopKV2Op outputs should
  be UNSHARDED"), which layout propagation asks for when a split tensor is
  sorted along its split dimension; its gradient scatters by global
  positions into a split input. On a mesh the order is read whole along the
  sorted dimension, and `sort` takes the values in that order
  (`take_along_axis`, whose gradient DTensor lays out).
- DTensor's `Transpose` requires its result laid out as its input,
  permuted, and refuses anything else ("TransposeOp SPMD needs communication
  is not supported yet"): CLIP's (batch, batch) logits, split on rows,
  transposed, then asked for split on rows again. On a mesh a transpose of
  a float tensor is a one-operand einsum, which DTensor relayouts as its
  consumers ask (no communication where the layouts already agree).
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow.core import convert_to_tensor

from tfmp.lowering.joins import read_whole_along
from tfmp.lowering.registry import Lowering, keras_original

_KERAS_NUMPY = "keras.src.backend.tensorflow.numpy"


def _length(x: tf.Tensor, dim: int) -> Any:
    """`x`'s length along `dim`: static where known, else read in the step."""
    return x.shape[dim] if x.shape[dim] is not None else tf.shape(x)[dim]


def roll(x: Any, shift: Any, axis: Any = None) -> tf.Tensor:
    """`keras.ops.roll` as a gather of `(position - shift) mod length` along
    each axis. A shift or axis computed in the step is Keras' own."""
    x = convert_to_tensor(x)
    shifts, axes = tf.get_static_value(shift), tf.get_static_value(axis)
    if shifts is None or (axis is not None and axes is None):
        return keras_original(_KERAS_NUMPY, "roll")(x, shift, axis)
    if axis is None:
        flat = tf.reshape(x, [-1])
        return tf.reshape(roll(flat, shift, 0), tf.shape(x))
    shifts, axes = np.reshape(shifts, [-1]).tolist(), np.reshape(axes, [-1]).tolist()
    if len(shifts) == 1:
        shifts = shifts * len(axes)
    for dim, amount in zip(axes, shifts):
        length = _length(x, dim)
        x = tf.gather(x, (tf.range(length) - amount) % length, axis=dim)
    return x


def argsort(x: Any, axis: int | None = -1) -> tf.Tensor:
    """`keras.ops.argsort`, its result whole along the sorted dimension."""
    order = keras_original(_KERAS_NUMPY, "argsort")(x, axis)
    if order.shape.rank in (None, 0):
        return order
    return read_whole_along(order, -1 if axis is None else axis % order.shape.rank)


def sort(x: Any, axis: int | None = -1) -> tf.Tensor:
    """`keras.ops.sort`: `x` taken in the order `argsort` gives."""
    x = convert_to_tensor(x)
    if axis is None:
        x, axis = tf.reshape(x, [-1]), 0
    if x.dtype == tf.bool or x.shape.rank in (None, 0):
        return keras_original(_KERAS_NUMPY, "sort")(x, axis)
    order = argsort(tf.stop_gradient(x), axis)
    return keras_original(_KERAS_NUMPY, "take_along_axis")(x, order, axis)


def transpose(x: Any, axes: Any = None) -> tf.Tensor:
    """`keras.ops.transpose` of a float tensor as an einsum; other tensors
    (integers, booleans, sparse) Keras' own."""
    original = keras_original(_KERAS_NUMPY, "transpose")
    if isinstance(x, tf.SparseTensor):
        return original(x, axes)
    x = convert_to_tensor(x)
    rank = x.shape.rank
    dtype = tf.as_dtype(x.dtype)
    if rank is None or rank > len(string.ascii_lowercase) or not (dtype.is_floating or dtype.is_complex):
        return original(x, axes)
    order = list(reversed(range(rank))) if axes is None else [int(axis) % rank for axis in axes]
    if sorted(order) != list(range(rank)):
        return original(x, axes)  # Keras' error for a bad permutation
    letters = string.ascii_lowercase[:rank]
    return tf.einsum(f"{letters}->{''.join(letters[axis] for axis in order)}", x)


LOWERINGS = (
    Lowering(
        _KERAS_NUMPY,
        "roll",
        f"{__name__}:roll",
        "Roll has no layout rule, and DTensor's replicated default for it gathers two "
        "mesh axes at once, which its collective gather lowering refuses",
    ),
    Lowering(
        _KERAS_NUMPY,
        "transpose",
        f"{__name__}:transpose",
        "Transpose refuses a result laid out other than its input, permuted",
    ),
    Lowering(
        _KERAS_NUMPY,
        "argsort",
        f"{__name__}:argsort",
        "TopKV2 refuses outputs split on the sorted dimension",
    ),
    Lowering(
        _KERAS_NUMPY,
        "sort",
        f"{__name__}:sort",
        "TopKV2 refuses outputs split on the sorted dimension; its gradient "
        "scatters by global positions",
    ),
)
