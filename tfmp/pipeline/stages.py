"""Pipeline stages: one sub-mesh per stage, and moving activations between them.

A mesh with a stage axis, e.g. `("stage", "batch", "model")` of shape
`(2, 1, 4)`, is cut along that axis into one sub-mesh per stage (here two
`("batch", "model")` meshes of 1x4 devices). A stage's variables live only on
its sub-mesh. DTensor moves a value between meshes only when it is replicated
(a sharded value fails inside DTensor's all-scatter), so an activation leaves
its stage replicated, is copied to the next stage's mesh and split over that
stage's batch axis again there, which needs no communication.

A Keras variable records the stage it belongs to (`stage_of`), which a
`LayerGroup` checks: a layer shared by two stages is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.layout import replicated
from tfmp.mesh import DeviceMesh
from tfmp.state import VariableState, known_state, state_of
from tfmp.tracing import context, scoped


class StageMeshes:
    """The sub-mesh of each pipeline stage of a mesh with a stage axis.

    Args:
        mesh: The whole mesh.
        stage_axis: Name of the axis that numbers the stages.
    """

    def __init__(self, mesh: DeviceMesh, stage_axis: str = "stage"):
        mesh.check_axis(stage_axis, what="stage axis")
        position = mesh.axis_names.index(stage_axis)
        names = tuple(n for n in mesh.axis_names if n != stage_axis) or ("batch",)
        self.stage_axis = stage_axis
        self.meshes = []
        for stage in range(mesh.shape[position]):
            devices = mesh.devices.take(stage, axis=position)
            shape = devices.shape or (1,)
            self.meshes.append(DeviceMesh(shape, names, devices.reshape(shape)))

    @property
    def num_stages(self) -> int:
        return len(self.meshes)

    @property
    def last(self) -> DeviceMesh:
        """The last stage's mesh: where outputs, losses and metrics live."""
        return self.meshes[-1]


def building_stage(stage: int) -> contextlib.AbstractContextManager:
    """Variables created in the block belong to pipeline stage `stage`."""
    return scoped(building_stage=stage)


def current_stage() -> int | None:
    """The stage whose variables are being created, if any."""
    return context.building_stage


def stage_of(keras_variable: Any) -> int | None:
    """The stage recorded on a Keras variable, if any."""
    state = known_state(keras_variable, VariableState)
    return None if state is None else state.stage


def record_stage(keras_variable: Any, stage: int) -> None:
    state_of(keras_variable, VariableState).stage = stage


def move_variables_to_stage(strategy: tf.distribute.Strategy, variables: Any, stage: int) -> None:
    """Moves Keras variables of a pipeline stage that were made before its
    layers were built (a dropout's seed state) to that stage's mesh."""
    mesh = strategy.stage_meshes.meshes[stage]
    for variable in variables:
        record_stage(variable, stage)
        if variable.value.stage != stage:
            layout = dtensor.Layout(variable.value.layout.sharding_specs, mesh.dtensor_mesh)
            strategy.extended.move_variable(variable, layout, stage)


def move_to_stage(value: tf.Tensor, source: DeviceMesh, target: DeviceMesh, batch_axis: str | None) -> tf.Tensor:
    """Moves an activation from the `source` stage's mesh to the `target` one.

    Inside a function (where DTensor lays values out as it expands it) the
    value must live on `source`; eagerly its layout says where it is.
    """
    rank = value.shape.rank
    whole = replicated(value, source.dtensor_mesh)
    moved = dtensor.copy_to_mesh(whole, dtensor.Layout.replicated(target.dtensor_mesh, rank))
    parts = target.axis_size(batch_axis) if batch_axis in target.axis_names else 1
    if parts == 1 or rank == 0 or value.shape[0] is None or value.shape[0] % parts:
        return moved
    return dtensor.relayout(moved, dtensor.Layout.batch_sharded(target.dtensor_mesh, batch_axis, rank))


def scalars_on_stages(copies: list[tuple[Any, list[tf.Tensor]]]) -> contextlib.AbstractContextManager:
    """Within the block, `stage_scalars(k)` swaps in stage k's copies.

    Optimizers read a few variables of their own (the step count, the
    learning rate) while updating each weight. Those live on the last stage's
    mesh, and DTensor does not mix meshes in one op, so a weight of another
    stage reads a copy of them on its own mesh, made once per step.

    Args:
        copies: (Keras variable, its value on each stage's mesh) pairs.
    """
    return scoped(stage_scalar_copies=copies)


@contextlib.contextmanager
def stage_scalars(stage: int) -> Iterator[None]:
    """Makes the Keras variables given to `scalars_on_stages` read on `stage`."""
    copies = context.stage_scalar_copies
    saved = [(variable, variable._value) for variable, _ in copies]  # noqa: SLF001
    try:
        for variable, values in copies:
            variable._value = values[stage]  # noqa: SLF001
        yield
    finally:
        for variable, value in saved:
            variable._value = value  # noqa: SLF001
