"""One-hot encoding, top-k selection and gathers, written with ops DTensor
lays out and TensorFlow runs.

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
- DTensor's `GatherV2` expansion requires the output to be split like the
  table on the table's other dimensions, and layout propagation may ask
  otherwise: an embedding split on the vocabulary, read by a layer that
  wants its features split over "model" (Gemma 3n), fails with "input and
  output layout do not agree on non-axis dim 1"; so does T5's relative
  position table, stored split on its buckets and gathered on use, read by
  attention split over heads. A lookup into a weight stored split on the
  looked-up dimension only relayouts its output: the indices' first
  dimension (the batch's) stays as it is, the others whole, as the gather
  makes them. (On plain replicated tables the relayout broke ViTDet's
  relative positions, so they keep TensorFlow's own gather.)
  User code's `tf.one_hot` is the same comparison on a mesh.
- `tf.gather_nd` with indices of rank 7 (SAM3's ROI align, called on
  TensorFlow directly) crashes the process in the step's backward pass, the
  `ScatterNd` into a 6-D gradient; ranks up to 6 run. On a mesh the indices
  are gathered as a list (rank 2) and the result reshaped: the same values.
- `tf.gather` with a negative `batch_dims` (counted from the indices' last
  dimension) crashes the process when DTensor expands the step. TensorFlow
  counts it as `batch_dims + rank(indices)`; on a mesh tfmp passes that count.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.forward import forward_mesh
from tfmp.integrations import Patch
from tfmp.lowering.registry import Lowering, keras_original

_KERAS_NN = "keras.src.backend.tensorflow.nn"
_KERAS_MATH = "keras.src.backend.tensorflow.math"
_KERAS_NUMPY = "keras.src.backend.tensorflow.numpy"


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


def take(x: Any, indices: Any, axis: Any = None):
    """`keras.ops.take` on a mesh: a lookup into a weight stored split on the
    looked-up dimension only (an embedding split on its vocabulary, read so
    or gathered on use) comes out split as its indices are, on their first
    dimension, and whole on the others."""
    original = keras_original(_KERAS_NUMPY, "take")
    if (
        forward_mesh() is None
        or axis is None
        or not isinstance(x, keras.Variable)
        or isinstance(indices, (tf.SparseTensor, tf.RaggedTensor))
    ):
        return original(x, indices, axis)
    variable = getattr(x, "_value", None)
    stored = getattr(variable, "layout", None)
    read = getattr(variable, "compute_layout", None)
    if stored is None or read is None:
        return original(x, indices, axis)
    axis %= len(stored.sharding_specs)
    split_elsewhere = any(
        spec != dtensor.UNSHARDED for dim, spec in enumerate(read.sharding_specs) if dim != axis
    )
    taken = original(x, indices, axis)
    if stored.sharding_specs[axis] == dtensor.UNSHARDED or split_elsewhere or not taken.shape.rank:
        return taken
    if taken.shape.rank < len(stored.sharding_specs):
        return taken  # a scalar index: no dimension of the indices to keep
    # DTensor allows one MATCH: the indices' first dimension (the batch's).
    output = [dtensor.UNSHARDED] * taken.shape.rank
    output[axis] = dtensor.MATCH
    return dtensor.relayout(taken, dtensor.Layout(output, forward_mesh()))


LOWERINGS = (
    Lowering(
        _KERAS_NN,
        "one_hot",
        one_hot,
        "DTensor's OneHot expansion fails when the class dimension is split",
    ),
    Lowering(
        _KERAS_MATH,
        "top_k",
        top_k,
        "TopKV2's gradient scatters by global positions into a split input",
    ),
    Lowering(
        _KERAS_NUMPY,
        "take",
        take,
        "GatherV2's expansion refuses an output split unlike the table",
    ),
)


def one_hot_by_comparison(tf_one_hot: Callable) -> Callable:
    """`tf.one_hot` that, in a forward pass on a mesh, is `keras.ops.one_hot`'s
    comparison with the class range (see the module's docstring), with
    TensorFlow's on and off values and dtype. A depth computed in the step is
    TensorFlow's own."""

    @functools.wraps(tf_one_hot)
    def wrapper(indices, depth, on_value=None, off_value=None, axis=None, dtype=None, name=None):
        if forward_mesh() is None or not isinstance(depth, int):
            return tf_one_hot(indices, depth, on_value, off_value, axis, dtype, name)
        if dtype is None:  # TensorFlow's rule: the on value's, the off value's, float32
            given = on_value if on_value is not None else off_value
            dtype = tf.float32 if given is None else tf.convert_to_tensor(given).dtype
        hot = one_hot(indices, depth, axis=-1 if axis is None else axis, dtype="bool")
        on = tf.cast(1 if on_value is None else on_value, dtype)
        off = tf.cast(0 if off_value is None else off_value, dtype)
        return tf.where(hot, on, off, name=name)

    return wrapper


def gather_nd_on_index_lists(gather_nd: Callable) -> Callable:
    """`tf.gather_nd` that, in a forward pass on a mesh, looks up indices of
    rank 3 or more as one list of indices and reshapes the result (see the
    module's docstring). Batched gathers and indices of unknown rank or depth
    are TensorFlow's own."""

    @functools.wraps(gather_nd)
    def wrapper(params, indices, batch_dims=0, name=None):
        shape = getattr(indices, "shape", None)
        if (
            forward_mesh() is None
            or batch_dims
            or shape is None
            or shape.rank is None
            or shape.rank < 3
            or shape[-1] is None
        ):
            return gather_nd(params, indices, batch_dims=batch_dims, name=name)
        indices = tf.convert_to_tensor(indices)
        found = gather_nd(params, tf.reshape(indices, [-1, shape[-1]]), name=name)
        target = shape[:-1].concatenate(found.shape[1:])
        if target.is_fully_defined():
            return tf.reshape(found, target)
        return tf.reshape(found, tf.concat([tf.shape(indices)[:-1], tf.shape(found)[1:]], 0))

    return wrapper


def gather_with_batch_dims_from_the_front(gather: Callable) -> Callable:
    """`tf.gather` that, in a forward pass on a mesh, passes a negative
    `batch_dims` as the non-negative count TensorFlow means by it (see the
    module's docstring). Indices of unknown rank are TensorFlow's own."""

    @functools.wraps(gather)
    def wrapper(params, indices, validate_indices=None, axis=None, batch_dims=0, name=None):
        if batch_dims < 0 and forward_mesh() is not None:
            rank = getattr(getattr(indices, "shape", None), "rank", None)
            if rank is not None:
                batch_dims += rank
        return gather(
            params, indices, validate_indices=validate_indices, axis=axis,
            batch_dims=batch_dims, name=name,
        )

    return wrapper


# TensorFlow functions patched with this family's code while a strategy exists.
PATCHES = (
    Patch(
        "tensorflow",
        "gather_nd",
        gather_nd_on_index_lists,
        "Indices of rank 7 (SAM3's ROI align) crash the process in the "
        "gradient of the step's gather on a mesh.",
        parameters=("params", "indices", "batch_dims", "name"),
    ),
    Patch(
        "tensorflow",
        "gather",
        gather_with_batch_dims_from_the_front,
        "A negative batch_dims crashes the process when DTensor expands "
        "the step's gather.",
        parameters=("params", "indices", "validate_indices", "axis", "batch_dims", "name"),
    ),
    Patch(
        "tensorflow",
        "one_hot",
        one_hot_by_comparison,
        "DTensor's OneHot expansion fails when layout propagation splits the "
        "class dimension (a one-hot mask multiplied with a split activation).",
        parameters=("indices", "depth", "on_value", "off_value", "axis", "dtype", "name"),
    ),
)
