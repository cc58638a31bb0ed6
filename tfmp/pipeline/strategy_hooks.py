"""The pipeline's answers to the strategy's `StageHooks`.

`tfmp.pipeline` registers `make_stage_hooks` with the strategy when it is
imported (see `tfmp.strategy.stage_hooks` for why a registration). A
strategy whose mesh has a `"stage"` axis then gets a `PipelineStages`: stage
`k`'s variables live on stage `k`'s sub-mesh, everything else on the last
stage's, and every training batch must split into `num_microbatches` equal
micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.mesh import DeviceMesh
from tfmp.pipeline.schedule import SCHEDULES
from tfmp.pipeline.stages import StageMeshes, current_stage, record_stage, stage_of, stage_scalars
from tfmp.strategy.placement import replicate
from tfmp.strategy.stage_hooks import StageHooks, WholeMesh

STAGE_AXIS = "stage"


def make_stage_hooks(mesh: DeviceMesh, num_microbatches: Any, schedule: Any) -> StageHooks:
    """A strategy's hooks: a pipeline's if `mesh` has a `"stage"` axis.

    Raises:
        ValueError: If `num_microbatches` or `schedule` is not a valid value,
            or does not fit the mesh.
    """
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}: use an integer >= 1.")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}.")
    if STAGE_AXIS not in mesh.axis_names:
        if num_microbatches > 1:
            raise ValueError(
                f"num_microbatches={num_microbatches} needs a pipeline: give the mesh "
                f"a {STAGE_AXIS!r} axis, e.g. tfmp.DeviceMesh((2, 4), "
                f"('{STAGE_AXIS}', 'model')), and build the model from "
                "tfmp.layers.LayerGroup stages."
            )
        return WholeMesh(mesh)
    stage_meshes = StageMeshes(mesh, STAGE_AXIS)
    if schedule == "1f1b" and num_microbatches < stage_meshes.num_stages:
        raise ValueError(
            f"schedule='1f1b' with num_microbatches={num_microbatches} and "
            f"{stage_meshes.num_stages} stages: 1F1B needs at least one micro-batch "
            f"per stage. Use num_microbatches >= {stage_meshes.num_stages}, or "
            "schedule='gpipe'."
        )
    return PipelineStages(stage_meshes, num_microbatches)


class PipelineStages:
    """The `StageHooks` of a strategy whose mesh has a `"stage"` axis.

    Args:
        stage_meshes: Each stage's sub-mesh.
        num_microbatches: How many micro-batches a training batch splits into.
    """

    stage_axis = STAGE_AXIS

    def __init__(self, stage_meshes: StageMeshes, num_microbatches: int):
        self.stage_meshes = stage_meshes
        self.num_microbatches = num_microbatches
        # Outputs, losses and metrics are computed where the last stage ends.
        self.home_mesh = stage_meshes.last
        self.input_mesh = stage_meshes.meshes[0]

    def mesh_of(self, stage: int | None) -> DeviceMesh:
        return self.home_mesh if stage is None else self.stage_meshes.meshes[stage]

    def stage_of_new_variable(self, keras_variable: Any, colocate_with: Any) -> int | None:
        """An optimizer slot's stage is its variable's; a Keras variable's is
        the one recorded on it, else the stage whose layers are being built."""
        stage = getattr(colocate_with, "stage", None)
        if stage is None:
            stage = stage_of(keras_variable)
        if stage is None:
            stage = current_stage()
        if keras_variable is not None and stage is not None:
            record_stage(keras_variable, stage)
        return stage

    def update_on_stage(self, variable: Any, update: Callable) -> Callable:
        """A stage's weight is updated on its own mesh: its update reads the
        optimizer's learning rate and step count as copies there, since
        DTensor runs no op on values of two meshes."""
        stage = getattr(variable, "stage", None)
        if stage is None:
            return update
        mesh = self.mesh_of(stage)

        def update_on_own_mesh(var: Any, *args: Any, **kwargs: Any) -> Any:
            # Keras passes (gradient, learning rate): the gradient is already there.
            args = args[:1] + tuple(self._home_value_to(value, mesh) for value in args[1:])
            with stage_scalars(stage):
                return update(var, *args, **kwargs)

        return update_on_own_mesh

    def _home_value_to(self, value: Any, mesh: DeviceMesh) -> Any:
        """A replicated scalar of the home mesh, copied onto `mesh`."""
        if not isinstance(value, tf.Tensor) or value.shape.rank != 0 or mesh == self.home_mesh:
            return value
        return dtensor.copy_to_mesh(
            replicate(value, self.home_mesh.dtensor_mesh),
            dtensor.Layout.replicated(mesh.dtensor_mesh, 0),
        )

    def check_host_batch(self, rows: int, trains: bool) -> None:
        """A training batch must split into equal micro-batches; evaluate and
        predict run whole batches through the stages.

        Checked on the host, where the rows are known: inside a step traced
        for batches of unknown size, DTensor would report the failure only
        as the step's outputs are read (and `fit(verbose=0)` not at all).
        """
        if trains and rows % self.num_microbatches:
            raise ValueError(indivisible_batch(rows, self.num_microbatches))


def indivisible_batch(size: int | None, num_microbatches: int) -> str:
    """The error for a batch of `size` samples (None: unknown while tracing)
    that does not split into `num_microbatches` equal micro-batches."""
    samples = "this step's samples" if size is None else f"{size} samples"
    return (
        f"A batch of {samples} does not split into num_microbatches="
        f"{num_microbatches} equal micro-batches. Use a batch size that is a "
        f"multiple of {num_microbatches}, and a data set whose size divides "
        "by it (or drop_remainder=True in tf.data)."
    )
