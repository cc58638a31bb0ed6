"""Which layout a new variable gets: the hook that tells the strategy which
Keras variable is being created, and the DTensor layout of what
`tfmp.layout_decision.decide_layout` decides for it."""

from __future__ import annotations

import contextlib
from typing import Any

from tensorflow.experimental import dtensor

from tfmp.layout import layout_axes
from tfmp.layout_decision import LayoutDecision
from tfmp.mesh import DeviceMesh
from tfmp.tracing import context, scoped


def creating(keras_variable: Any) -> contextlib.AbstractContextManager:
    """The backing `tf.Variable` of `keras_variable` is created in the block.

    Keras 3's TensorFlow `Variable._initialize` runs in this block (installed
    by tfmp), so the strategy's variable creator knows the Keras variable,
    its path and its layer's declaration, also when Keras deferred the
    creation past the layer's name scope.
    """
    return scoped(creating_variable=keras_variable)


def keras_variable_being_created() -> Any:
    """The Keras variable whose `tf.Variable` is being created, or None."""
    return context.creating_variable


def mesh_axes(mesh: DeviceMesh) -> dict[str, int]:
    """The mesh's axis names and sizes, in order: what `decide_layout` knows
    of a mesh."""
    return dict(zip(mesh.axis_names, mesh.shape))


def slot_of(colocated: Any) -> tuple[str, tuple[int, ...], tuple[str | None, ...]] | None:
    """What `decide_layout` knows of the variable an optimizer slot is made
    for (`colocate_with`): its path, shape and storage axes; None for no
    variable, or one not on a mesh."""
    layout = getattr(colocated, "layout", None)
    if layout is None:
        return None
    path = getattr(colocated, "path", colocated.name)
    return path, tuple(int(size) for size in colocated.shape), layout_axes(layout)


def storage_layout(decision: LayoutDecision, mesh: DeviceMesh) -> dtensor.Layout:
    """The DTensor layout of `decision` on `mesh`."""
    return dtensor.Layout([axis or dtensor.UNSHARDED for axis in decision.axes], mesh.dtensor_mesh)


def gathered_axes(batch_axis: str | None, decision: LayoutDecision) -> tuple[str, ...]:
    """The mesh axes a variable is gathered over when its layer reads it.

    The batch axis (the activations a weight meets are split over it, so a
    weight split over it is fully sharded) unless its layout is a
    `tfmp.split_on_use` one that names it, and every axis of its layout if
    that is a `tfmp.gather_on_use` layout.
    """
    gathered = [batch_axis] if batch_axis and batch_axis not in decision.split_on_use else []
    return (*gathered, *(axis for axis in decision.gathered_on_use if axis not in gathered))
