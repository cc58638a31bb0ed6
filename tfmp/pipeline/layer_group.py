"""`LayerGroup`: consecutive layers that run as one pipeline stage."""

from __future__ import annotations

from typing import Any, Sequence

import keras
import tensorflow as tf

from tfmp.forward import forward_mesh, forward_on
from tfmp.integrations.internals import get_keras_mask, set_keras_mask
from tfmp.mesh import DeviceMesh
from tfmp.pipeline.stages import (
    StageMeshes,
    building_stage,
    move_to_stage,
    move_variables_to_stage,
    stage_of,
)


@keras.saving.register_keras_serializable(package="tfmp")
class LayerGroup(keras.layers.Layer):
    """Runs a list of layers (or a Keras model) as pipeline stage `stage`.

    A model whose layers are a chain of `LayerGroup`s with stages 0, 1, ...
    is a pipeline. Under a `tfmp.ModelParallelStrategy` whose mesh has a
    `"stage"` axis, stage `k`'s variables and optimizer slots live only on
    the devices of stage `k` of that axis, where its forward and backward ops
    run; the strategy's `num_microbatches` and `schedule` say how batches
    flow through the stages. Anywhere else the group is a plain sequence of
    its layers.

    Args:
        layers: Unbuilt Keras layers, run in order, or one Keras model.
        stage: The pipeline stage, from 0.
        recompute: Whether the pipeline keeps only the stage's input of each
            micro-batch and recomputes its activations for the backward pass,
            trading one more forward for activation memory.
        **kwargs: Base `keras.layers.Layer` arguments (`name`, ...).

    Examples:
        >>> import keras, tfmp
        >>> model = keras.Sequential([
        ...     keras.Input((16,)),
        ...     tfmp.layers.LayerGroup([keras.layers.Dense(32, activation="relu")], stage=0),
        ...     tfmp.layers.LayerGroup([keras.layers.Dense(8)], stage=1),
        ... ])
        >>> model(keras.ops.ones((4, 16))).shape
        TensorShape([4, 8])
    """

    def __init__(
        self,
        layers: Sequence[keras.layers.Layer] | keras.Model,
        stage: int,
        recompute: bool = False,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        group = [layers] if isinstance(layers, keras.layers.Layer) else list(layers)
        if not group:
            raise ValueError(
                f"LayerGroup(stage={stage}) has no layers: give each stage at least one."
            )
        if not isinstance(stage, int) or stage < 0:
            raise ValueError(f"LayerGroup stage={stage!r}: use an integer from 0.")
        self.group_layers = group
        self.stage = stage
        self.recompute = recompute
        self._stage_meshes: StageMeshes | None = None
        self._batch_axis: str | None = None

    def build(self, input_shape: Any) -> None:
        strategy = tf.distribute.get_strategy()
        self._stage_meshes = getattr(strategy, "stage_meshes", None)
        self._batch_axis = getattr(strategy, "batch_axis", None)
        if self._stage_meshes is not None and self.stage >= self._stage_meshes.num_stages:
            raise ValueError(
                f"LayerGroup {self.name!r} is stage {self.stage}, but the mesh's "
                f"{self._stage_meshes.stage_axis!r} axis has only "
                f"{self._stage_meshes.num_stages} stages."
            )
        with building_stage(self.stage):
            outputs = keras.KerasTensor(input_shape)
            for layer in self.group_layers:
                outputs = layer(outputs)
        for variable in self.variables:
            stage = stage_of(variable)
            if stage is not None and stage != self.stage:
                raise ValueError(
                    f"LayerGroup {self.name!r} (stage {self.stage}) holds weight "
                    f"{variable.path!r} of stage {stage}: a layer can belong to one "
                    "stage only. Give each stage layers of its own."
                )
        if self.recompute and any("seed_generator" in v.path for v in self.variables):
            raise ValueError(
                f"LayerGroup {self.name!r} has recompute=True and random layers "
                "(dropout): recomputing would draw other random numbers than the "
                "forward pass did. Use recompute=False for this stage."
            )
        if self._stage_meshes is not None:
            move_variables_to_stage(strategy, self.variables, self.stage)

    def call(self, inputs: Any, arrived: bool = False) -> Any:
        """Runs the layers; `arrived`: the inputs are on this stage's devices
        already (pipeline schedules move them themselves)."""
        meshes = self._stage_meshes
        if meshes is not None and self.stage > 0 and not arrived:
            inputs = move_with_masks(
                inputs, meshes.meshes[self.stage - 1], meshes.meshes[self.stage], self._batch_axis
            )
        outputs = inputs
        stage_mesh = None if meshes is None else meshes.meshes[self.stage].dtensor_mesh
        with forward_on(stage_mesh or forward_mesh()):
            for layer in self.group_layers:
                outputs = layer(outputs)
        return outputs

    def compute_mask(self, inputs: Any, previous_mask: Any = None) -> None:
        """No mask of the group's own: its layers read the input's Keras mask
        and set their outputs' as they run (an output without one has none)."""
        return None

    def compute_output_shape(self, input_shape: Any) -> Any:
        shape = input_shape
        for layer in self.group_layers:
            shape = layer.compute_output_shape(shape)
        return shape

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        # Built by this group, on its stage's devices: loading must not build them first.
        layers = []
        for layer in self.group_layers:
            serialized = keras.saving.serialize_keras_object(layer)
            serialized.pop("build_config", None)
            layers.append(serialized)
        return {**config, "layers": layers, "stage": self.stage, "recompute": self.recompute}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LayerGroup":
        config = dict(config)
        config["layers"] = [keras.saving.deserialize_keras_object(c) for c in config["layers"]]
        return cls(**config)


def move_with_masks(
    value: Any, source: DeviceMesh, target: DeviceMesh, batch_axis: str | None
) -> Any:
    """Moves each tensor of `value` from the `source` stage's mesh to the
    `target` one, with its Keras mask: the moved tensor is a new one, and the
    next stage's layers (and the loss) read the mask from it."""

    def move(tensor: tf.Tensor) -> tf.Tensor:
        moved = move_to_stage(tensor, source, target, batch_axis)
        mask = get_keras_mask(tensor)
        if mask is not None:
            set_keras_mask(moved, move_to_stage(mask, source, target, batch_axis))
        return moved

    return tf.nest.map_structure(move, value)
