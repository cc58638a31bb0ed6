"""What a layer running on a mesh may ask of the strategy running it."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor


def batch_spec(inputs: Any, mesh: dtensor.Mesh, other_axis: str) -> str:
    """The mesh axis the batch of `inputs` is split over, or UNSHARDED.

    That is the running strategy's batch axis, unless it is `other_axis` (the
    layer's own), missing from the mesh, or does not divide this batch (which
    the strategy then runs whole on every device).
    """
    batch_axis = getattr(tf.distribute.get_strategy(), "batch_axis", None)
    if batch_axis in (None, other_axis) or batch_axis not in mesh.dim_names:
        return dtensor.UNSHARDED
    size = inputs.shape[0]
    if size is not None and size % mesh.dim_size(batch_axis):
        return dtensor.UNSHARDED
    return batch_axis
