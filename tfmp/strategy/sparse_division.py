"""Keras' division of a sparse gradient by an optimizer slot, on a mesh.

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

Cost: the divisor (as large as the table) is gathered onto every device once
per step and update, and each device holds it whole while dividing.

Adadelta and RMSprop with momentum then add the rows of the division (a
number known only at run time) into a split slot, which DTensor cannot lay
out: a known limit (docs/guide.md).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.layout import replicated

_update = threading.local()


@contextlib.contextmanager
def sparse_update_on(mesh: dtensor.Mesh) -> Iterator[None]:
    """A variable of `mesh` is updated with a sparse gradient in the block."""
    previous = getattr(_update, "mesh", None)
    _update.mesh = mesh
    try:
        yield
    finally:
        _update.mesh = previous


def _sparse_update_mesh() -> dtensor.Mesh | None:
    if tf.executing_eagerly():
        return None
    return getattr(_update, "mesh", None)


def whole_sparse_division(divide: Callable) -> Callable:
    """Keras' `divide`, on whole operands for a sparse dividend and a dense
    divisor during a sparse update on a mesh."""

    @functools.wraps(divide)
    def wrapper(x1: Any, x2: Any) -> Any:
        mesh = _sparse_update_mesh()
        if mesh is None or not isinstance(x1, tf.IndexedSlices) or not _is_dense(x2):
            return divide(x1, x2)

        def whole(value: tf.Tensor) -> tf.Tensor:
            return dtensor.relayout(
                replicated(value, mesh), dtensor.Layout.replicated(mesh, value.shape.rank)
            )

        quotient = divide(
            tf.IndexedSlices(whole(x1.values), whole(x1.indices), x1.dense_shape), whole(x2)
        )
        if isinstance(quotient, tf.IndexedSlices):
            return tf.IndexedSlices(
                whole(quotient.values), whole(quotient.indices), quotient.dense_shape
            )
        return whole(quotient)

    return wrapper


def _is_dense(value: Any) -> bool:
    """A tensor with dimensions: Keras divides by a scalar without a branch."""
    return isinstance(value, tf.Tensor) and bool(value.shape.rank)
