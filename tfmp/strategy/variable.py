"""The variable class of the strategy: a DTensor variable that takes host values."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.forward import GATHER_SCOPE, forward_mesh
from tfmp.integrations.internals import gen_math_ops
from tfmp.layout import replicated
from tfmp.strategy.placement import to_layout


class MeshVariable(dtensor.DVariable):
    """A `DVariable` whose shards live on the mesh devices its layout names.

    Assigning a host value (numpy, a regular tensor, a checkpoint value, or a
    DTensor of another layout or mesh) moves it to the variable's layout, so
    `set_weights`, `load_weights` and loading onto a different mesh work. Reading
    it to numpy gathers the shards.

    In a layer's forward pass it is read in its compute layout: gathered over
    the mesh axes in `gathered_axes` (the batch axis, with fully sharded
    weights; the axes of a `tfmp.gather_on_use` layout), one axis per
    relayout, as `tfmp.layout.replicated` explains.

    (Not named `ShardedVariable`: tf_keras takes any class of that name for
    TF's parameter-server variable and would track each row as a weight.)
    """

    # Whether the clients of a multi-client run compared their copies of it
    # (`tfmp.strategy.agreement.check_model`).
    agreed = False

    def __init__(
        self,
        initial_value: Any,
        *args,
        path: str = "",
        placer: Any = None,
        stage: int | None = None,
        gathered_axes: tuple[str, ...] = (),
        **kwargs,
    ):
        super().__init__(initial_value, *args, **kwargs)
        self.path = path or self.name
        self.placer = placer  # packs host batches for models using this variable
        self.stage = stage  # the pipeline stage whose mesh holds it, if any
        self.gathered_axes = gathered_axes
        self._gathers = gather_steps(self.layout, gathered_axes)
        self.compute_layout = self._gathers[-1] if self._gathers else self.layout

    def _read_variable_op(self, no_copy=False):
        value = super()._read_variable_op(no_copy=no_copy)
        if self._gathers and forward_mesh() is not None:
            with tf.name_scope(GATHER_SCOPE):
                for layout in self._gathers:
                    value = dtensor.relayout(value, layout)
        return value

    def _on_mesh(self, value: Any) -> Any:
        if tf.executing_eagerly():
            return to_layout(tf.convert_to_tensor(value, dtype=self.dtype), self.layout)
        return value

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return super().assign(self._on_mesh(value), use_locking, name, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return super().assign_add(self._on_mesh(delta), use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return super().assign_sub(self._on_mesh(delta), use_locking, name, read_value)

    # DTensor has no layout propagation for ResourceScatterAdd/Sub ("op does
    # not implement layout propagation"), which Keras' optimizers run for a
    # sparse gradient (an Embedding's, under SGD). Applied dense, the update
    # is the same: duplicate indices add up, as in a scatter.
    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self.assign_add(self._dense(sparse_delta), use_locking, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self.assign_sub(self._dense(sparse_delta), use_locking, name)

    def _dense(self, sparse_delta: tf.IndexedSlices) -> tf.Tensor:
        return dense_rows(sparse_delta, self.shape[0], self.dtype)

    def numpy(self) -> np.ndarray:
        value = self.read_value()
        return replicated(value, dtensor.fetch_layout(value).mesh).numpy()

    def __array__(self, dtype=None, copy=None):
        del copy  # numpy() already returns a fresh host copy
        return np.asarray(self.numpy(), dtype=dtype)


def gather_steps(layout: dtensor.Layout, axes: tuple[str, ...]) -> list[dtensor.Layout]:
    """The layouts that gather `layout` over each of `axes` it uses, one axis
    at a time (the last is the compute layout); empty if it uses none."""
    specs, steps = list(layout.sharding_specs), []
    for dim, spec in enumerate(specs):
        if spec in axes:
            specs[dim] = dtensor.UNSHARDED
            steps.append(dtensor.Layout(specs, layout.mesh))
    return steps


def sparse_passing_relayout_gradient(relayout_gradient: Any) -> Any:
    """DTensor's gradient of `Relayout`, letting a sparse gradient through.

    A weight read in its compute layout (an embedding table) gets a sparse
    gradient; DTensor's own Relayout gradient makes it dense, and Keras'
    optimizers treat a sparse gradient's rows one by one (Adam squares each
    row before summing rows of the same id: a repeated id adds its squares,
    not the square of its sum), so single-device numbers need it kept sparse.
    The gradient of a relayout is the identity, whatever its layout.
    """

    def gradient(op: Any, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            return grad
        return relayout_gradient(op, grad)

    return gradient


def dense_rows(sparse: tf.IndexedSlices, rows: int, dtype: tf.DType | None = None) -> tf.Tensor:
    """`sparse` as a dense tensor of `rows` rows; duplicate indices add up.

    `rows` comes from the variable: under DTensor a gradient's `dense_shape`
    can be a shard's.
    """
    values = sparse.values if dtype is None else tf.cast(sparse.values, dtype)
    # Looked up as it is called, like TensorFlow's own densifying of an
    # IndexedSlices: during a sparse update tfmp sums rows of unknown number
    # whole (`tfmp.strategy.sparse_division.whole_rows_segment_sum`).
    return gen_math_ops.unsorted_segment_sum(values, sparse.indices, rows)
