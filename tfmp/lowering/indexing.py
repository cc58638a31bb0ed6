"""One-hot encoding, top-k selection and identity matrices written with
elementwise ops.

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
  output layout do not agree on non-axis dim 1". A lookup into a weight
  read split on the looked-up dimension only relayouts its output: the
  first dimension (the batch's) stays as it is, the others whole, as the
  gather makes them.
- `tf.eye` is a `MatrixDiagV3`, which DTensor has no layout rule for
  ("'tf.MatrixDiagV3' op does not implement layout propagation"; Qwen 3.5's
  gated delta net adds `ops.eye(chunk_size)`). `rows + k == columns` is the
  same matrix.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.backend import config
from keras.src.backend.common.variables import standardize_dtype
from tensorflow.experimental import dtensor

from tfmp.forward import forward_mesh
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
    """`keras.ops.take` on a mesh: rows of a weight split on the looked-up
    dimension only (an embedding split on its vocabulary) come out with
    only their first dimension split."""
    original = keras_original(_KERAS_NUMPY, "take")
    specs = _compute_specs(x)
    if (
        forward_mesh() is None
        or axis is None
        or specs is None
        or isinstance(indices, (tf.SparseTensor, tf.RaggedTensor))
    ):
        return original(x, indices, axis)
    axis %= len(specs)
    if all(spec == dtensor.UNSHARDED for spec in specs) and _stored_split_on(x, axis):
        return _replicated_take(original(x, indices, axis), axis, len(specs))
    if specs[axis] == dtensor.UNSHARDED or any(
        spec != dtensor.UNSHARDED for i, spec in enumerate(specs) if i != axis
    ):
        return original(x, indices, axis)
    taken = original(x, indices, axis)
    if not taken.shape.rank:
        return taken
    output = [dtensor.MATCH] + [dtensor.UNSHARDED] * (taken.shape.rank - 1)
    return dtensor.relayout(taken, dtensor.Layout(output, forward_mesh()))


def _stored_split_on(x: Any, axis: int) -> bool:
    """Whether a weight is stored split on dimension `axis` (a
    `gather_on_use` table, read whole)."""
    layout = getattr(getattr(x, "_value", None), "layout", None)
    return layout is not None and layout.sharding_specs[axis] != dtensor.UNSHARDED


def _replicated_take(taken: tf.Tensor, axis: int, table_rank: int) -> tf.Tensor:
    """A lookup into a `gather_on_use` weight stored split on the looked-up
    dimension and read whole (tried on plain replicated tables, the relayout
    broke ViTDet's relative positions: "output layout of Relayout op after
    layout propagation does not match layout specified by Relayout op"):
    the dimensions the table's other dimensions give stay whole, as the
    gather makes them, and so do those of the indices but the first. Without
    the relayout, a consumer that wants them split (T5's relative position
    bias, (buckets, heads), read by attention split over heads) fails with
    "input and output layout do not agree on non-axis dim 1"."""
    rank = taken.shape.rank
    if rank is None:
        return taken
    looked_up = rank - (table_rank - 1)
    if looked_up < 1:
        return taken
    # DTensor allows one MATCH: the first looked-up dimension (the batch's).
    output = (
        [dtensor.UNSHARDED] * axis
        + [dtensor.MATCH]
        + [dtensor.UNSHARDED] * (rank - axis - 1)
    )
    return dtensor.relayout(taken, dtensor.Layout(output, forward_mesh()))


def _compute_specs(x: Any) -> list[str] | None:
    """The sharding specs a weight is read with in a forward pass on a mesh
    (its storage layout, less the axes gathered on use), or None (not a
    variable on a tfmp mesh)."""
    if not isinstance(x, keras.Variable):
        return None
    layout = getattr(getattr(x, "_value", None), "compute_layout", None)
    return None if layout is None else list(layout.sharding_specs)


def eye(N: Any, M: Any = None, k: Any = 0, dtype: Any = None):  # noqa: N803 (Keras' names)
    """`keras.ops.eye` on a mesh: ones where the column is the row plus `k`."""
    dtype = standardize_dtype(dtype or config.floatx())
    M = N if M is None else M  # noqa: N806
    rows = tf.range(N, dtype="int32")[:, None] + tf.cast(k, "int32")
    return tf.cast(tf.equal(rows, tf.range(M, dtype="int32")[None, :]), dtype)


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
    Lowering(
        _KERAS_NUMPY,
        "take",
        "tfmp.lowering.indexing:take",
        "GatherV2's expansion refuses an output split unlike the table",
    ),
    Lowering(
        _KERAS_NUMPY,
        "eye",
        "tfmp.lowering.indexing:eye",
        "tf.eye is a MatrixDiagV3, which DTensor has no layout rule for",
    ),
)
