"""One-hot encoding and top-k selection written with elementwise ops.

- DTensor's `OneHot` expansion breaks when layout propagation splits the new
  class dimension (a mixture of experts' routing mask, whose experts are split
  over "model"): "SPMD expansion resulted in op output inconsistent with the
  provided layout". `x[..., None] == range(num_classes)` is elementwise, and
  DTensor lays it out any way its consumers ask.
- TensorFlow's `TopKV2` gradient scatters into the flattened input by global
  positions, which a split input does not have ("indices[63] = [124] does not
  index into shape [64]"). Here the indices come from `top_k` of the input
  with its gradient stopped, and the values are selected by a one-hot mask,
  whose gradient is elementwise.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfmp.lowering.registry import Lowering, keras_original

_KERAS_NN = "keras.src.backend.tensorflow.nn"
_KERAS_MATH = "keras.src.backend.tensorflow.math"


def one_hot(x: Any, num_classes: int, axis: int = -1, dtype: Any = None, sparse: bool = False):
    """`keras.ops.one_hot` on a mesh; a negative index gives a row of zeros."""
    if sparse:
        return keras_original(_KERAS_NN, "one_hot")(x, num_classes, axis, dtype, sparse)
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_integer:
        x = tf.cast(x, "int64")
    axis = axis if axis >= 0 else x.shape.rank + 1 + axis
    classes = tf.reshape(
        tf.range(num_classes, dtype=x.dtype), [num_classes] + [1] * (x.shape.rank - axis)
    )
    return tf.cast(tf.equal(tf.expand_dims(x, axis), classes), dtype or "float32")


def top_k(x: Any, k: int, sorted: bool = True):  # noqa: A002 (Keras' argument name)
    """`keras.ops.top_k` on a mesh: the same values and indices."""
    x = tf.convert_to_tensor(x)
    indices = tf.math.top_k(tf.stop_gradient(x), k, sorted=sorted).indices
    chosen = one_hot(indices, x.shape[-1], dtype="bool")  # (..., k, n)
    values = tf.reduce_sum(
        tf.where(chosen, tf.expand_dims(x, -2), tf.zeros([], x.dtype)), axis=-1
    )
    return values, indices


LOWERINGS = (
    Lowering(
        _KERAS_NN,
        "one_hot",
        "tfmp.lowering.indexing:one_hot",
        "DTensor's OneHot expansion fails when the class dimension is split",
    ),
    Lowering(
        _KERAS_MATH,
        "top_k",
        "tfmp.lowering.indexing:top_k",
        "TopKV2's gradient scatters by global positions into a split input",
    ),
)
