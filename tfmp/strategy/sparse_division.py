"""Keras' division of a sparse gradient by an optimizer slot, and what an
optimizer sums of its rows, on a mesh.

RMSprop and Adagrad divide an embedding's `tf.IndexedSlices` gradient by a
table-sized slot: `lr * g / sqrt(v + eps)`. Keras' sparse
division branches in a `tf.cond` on whether the divisor holds a zero or a
NaN (then the result also gets the rows where it does). With the table split,
DTensor lays the two branches out differently (`'tf.IfRegion' op else result
type tensor<?x4xf32> is incompatible with result type tensor<?x8xf32>`; an
`Identity` "inconsistent with the provided layout") and pushes the table's
layout back into them from the update that consumes the result.

While a mesh variable is updated with a sparse gradient
(`sparse_update_on`), the division runs on whole operands: the rows, their
ids and the divisor replicated, and its result pinned replicated, so every
device takes the branch one device takes and computes its rows as one device
does; the update then applies them to its own part of the table.

The quotient has a number of rows known only at run time (the branch that
adds rows). Adadelta, RMSprop with momentum and Adafactor sum such rows by
id into a table-sized tensor (`UnsortedSegmentSum`: Keras making the rows
dense to add them to a slot, or the update's scatter), and DTensor pushes the
table's split back onto the rows, which it cannot cut: split over the
vocabulary, "EmitAllScatter requires slice on input axis 0 which is
dynamic"; split over the features, its `Slice` takes 0 rows (measured:
`size = [0, 2]` for a `?x8` tensor), and the sum then fails with
"data.shape = [0,2] does not start with segment_ids.shape = [64]". So during
a sparse update that divided, a sum of rows of unknown number also runs on
whole operands, and its table-sized result, of known shape, is pinned
replicated: DTensor then cuts the table, not the rows. The quotient keeps the dividend's
`dense_shape` (both branches have it), so that the sum has a known number of
rows too.

Cost: the divisor (as large as the table) is gathered onto every device once
per step and update, and each device holds it whole while dividing; each sum
of rows of unknown number is computed whole on every device, in a
table-sized tensor.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.layout import replicated
from tfmp.tracing import context, scoped


def sparse_update_on(mesh: dtensor.Mesh) -> contextlib.AbstractContextManager:
    """A variable of `mesh` is updated with a sparse gradient in the block."""
    return scoped(sparse_update_mesh=mesh, sparse_divided=False)


def _sparse_update_mesh() -> dtensor.Mesh | None:
    if tf.executing_eagerly():
        return None
    return context.sparse_update_mesh


def _whole(value: tf.Tensor, mesh: dtensor.Mesh) -> tf.Tensor:
    return dtensor.relayout(
        replicated(value, mesh), dtensor.Layout.replicated(mesh, value.shape.rank)
    )


def whole_sparse_division(divide: Callable) -> Callable:
    """Keras' `divide`, on whole operands for a sparse dividend and a dense
    divisor during a sparse update on a mesh."""

    @functools.wraps(divide)
    def wrapper(x1: Any, x2: Any) -> Any:
        mesh = _sparse_update_mesh()
        if mesh is None or not isinstance(x1, tf.IndexedSlices) or not _is_dense(x2):
            return divide(x1, x2)
        quotient = divide(
            tf.IndexedSlices(_whole(x1.values, mesh), _whole(x1.indices, mesh), x1.dense_shape),
            _whole(x2, mesh),
        )
        context.sparse_divided = True
        if isinstance(quotient, tf.IndexedSlices):
            return tf.IndexedSlices(
                _whole(quotient.values, mesh), _whole(quotient.indices, mesh), x1.dense_shape
            )
        return _whole(quotient, mesh)

    return wrapper


def whole_rows_segment_sum(segment_sum: Callable) -> Callable:
    """TensorFlow's `unsorted_segment_sum`, on whole operands for rows of
    unknown number during a sparse update on a mesh that divided whole.

    Only after such a division: its rows are whole already, so making them
    whole moves nothing. Rows of unknown number split by DTensor (tf_keras'
    optimizers merging duplicate ids, then scattering them) would be gathered
    over a dimension DTensor cannot gather (0 rows come back, measured), and
    DTensor lays those sums out itself."""

    @functools.wraps(segment_sum)
    def wrapper(data: Any, segment_ids: Any, num_segments: Any, name: str | None = None) -> Any:
        mesh = _sparse_update_mesh()
        if mesh is None or not context.sparse_divided or not _has_unknown_rows(data):
            return segment_sum(data, segment_ids, num_segments, name=name)
        total = segment_sum(_whole(data, mesh), _whole(segment_ids, mesh), num_segments, name=name)
        return _whole(total, mesh)

    return wrapper


def _is_dense(value: Any) -> bool:
    """A tensor with dimensions: Keras divides by a scalar without a branch."""
    return isinstance(value, tf.Tensor) and bool(value.shape.rank)


def _has_unknown_rows(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and bool(value.shape.rank) and value.shape[0] is None
