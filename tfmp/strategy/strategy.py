"""`ModelParallelStrategy`: a `tf.distribute.Strategy` backed by DTensor."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfmp import integrations
from tfmp.layout import LayoutMap, as_layout_map
from tfmp.mesh import DeviceMesh, as_device_mesh
from tfmp.strategy.extended import ModelParallelExtended
from tfmp.strategy.stage_hooks import stage_hooks_for

_DEFAULT_BATCH_AXIS = "batch"
_TENSOR_AXIS = "model"
_CONTEXT_AXIS = "sequence"


class ModelParallelStrategy(tf.distribute.Strategy):
    """Trains a Keras model split over a device mesh, with `model.fit`.

    Variables created in the strategy's scope are DTensor variables laid out by
    the `layout_map` (replicated where no rule matches); optimizer slots take
    their variable's layout; each input batch is split over `batch_axis`. The
    training step runs once on the global batch and DTensor's SPMD expansion
    inserts the collectives between devices, so training gives the same
    numbers as one device. A custom training loop written for
    `tf.distribute.MirroredStrategy` runs unchanged: `num_replicas_in_sync`
    is the batch axis' size outside the step (1 inside it and in Keras'
    own methods), as docs/custom-loops.md explains.

    Args:
        mesh: A `tfmp.DeviceMesh` or `keras.distribution.DeviceMesh`.
        layout_map: A `tfmp.LayoutMap`, `keras.distribution.LayoutMap` or dict
            of regex -> axes; None replicates every variable (data parallelism);
            `"auto"` plans Megatron layouts with `tfmp.auto_layout` over the
            mesh axis `"model"` when the model first trains or predicts.
        batch_axis: The mesh axis that splits the batch. By default `"batch"`;
            a mesh without a `"batch"` axis whose axes are all `"model"` and
            `"stage"` (or of size 1) then gives every device the whole batch,
            and any other axis is an error that asks for `batch_axis=`: an axis
            that neither splits the batch nor appears in a rule would leave its
            devices computing copies. Any other name must be a mesh axis.
            None: batches are not split.
        num_microbatches: For a pipeline (a mesh with a `"stage"` axis and a
            model of `tfmp.layers.LayerGroup`s), how many micro-batches each
            batch is split into as it flows through the stages.
        schedule: The order in which each stage runs its micro-batches'
            forward and backward passes: `"gpipe"` (all forwards, then all
            backwards) or `"1f1b"` (one forward, one backward, which keeps at
            most as many micro-batches' activations as there are stages).
        fully_shard: Also split every floating-point variable (weights and
            optimizer slots) over `batch_axis`, on its largest dimension that
            the layout map leaves whole: fully sharded data parallelism
            (ZeRO-3). With tensor parallelism on `"model"`, each device of a
            2x4 mesh then holds about 1/8 of the parameters and optimizer
            state. A layer gathers the batch axis of its weights as it reads
            them, and gradients are reduced back to the stored shards.
        sequence_parallel: Megatron-LM's sequence parallelism, over mesh axis
            `"model"` (True) or the axis named: the `(batch, sequence,
            features)` outputs of norm and dropout layers are split over the
            sequence, so each device of the axis keeps 1/N of the activations
            between tensor-parallel blocks (`tfmp.strategy.sequence_parallel`).
            A `"<layer path>/output"` rule of the layout map wins over it.
            Not with a pipeline (a `"stage"` axis) yet.
        context_parallel: Context parallelism, over mesh axis `"sequence"`
            (True) or the axis named; by default (None) on with
            `layout_map="auto"` on a mesh with a `"sequence"` axis and no
            `"stage"` axis, else off (not with a pipeline yet).
            The sequence is split over the axis
            through the whole model (norms', dropouts' and attention layers'
            `(batch, sequence, features)` outputs), and each attention layer
            gathers its keys and values whole over the axis while its
            queries are split, so every device computes the
            scores of its part of the sequence against all of it
            (`tfmp.strategy.sequence_parallel`), a block of keys at a time
            where attention runs `keras.ops.dot_product_attention`
            (`tfmp.lowering.attention`). Weights are replicated over
            the axis and their gradients summed over it. Cannot be combined
            with `sequence_parallel`, which splits the same dimension.

    Examples:
        >>> import keras, tfmp
        >>> tfmp.simulate_devices(8)
        ['/device:CPU:0', ..., '/device:CPU:7']
        >>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
        >>> layout_map = tfmp.LayoutMap(mesh)
        >>> layout_map["dense/kernel"] = (None, "model")
        >>> layout_map["dense_1/kernel"] = ("model", None)
        >>> strategy = tfmp.ModelParallelStrategy(mesh, layout_map)
        >>> with strategy.scope():
        ...     model = keras.Sequential([
        ...         keras.Input((16,)),
        ...         keras.layers.Dense(64, activation="relu", name="dense"),
        ...         keras.layers.Dense(4, name="dense_1"),
        ...     ])
        ...     model.compile(optimizer="adam", loss="mse")
        >>> history = model.fit(x, y, batch_size=32, verbose=0)
    """

    def __init__(
        self,
        mesh: Any,
        layout_map: Any = None,
        batch_axis: str | None = _DEFAULT_BATCH_AXIS,
        num_microbatches: int = 1,
        schedule: str = "gpipe",
        fully_shard: bool = False,
        sequence_parallel: bool | str = False,
        context_parallel: bool | str | None = None,
    ):
        mesh = as_device_mesh(mesh)
        if not isinstance(fully_shard, bool):
            raise TypeError(
                f"fully_shard must be True or False, got {fully_shard!r} "
                f"({type(fully_shard).__name__}): a string such as 'no' would count as True."
            )
        stages = stage_hooks_for(mesh, num_microbatches, schedule)
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        batch_axis = _resolve_batch_axis(mesh, batch_axis, stages.stage_axis)
        if fully_shard and batch_axis is None:
            raise ValueError(
                f"fully_shard=True shards weights over the batch axis, but this "
                f"strategy has none (mesh axes {mesh.axis_names}). Give the mesh a "
                "'batch' axis or name one with batch_axis=..."
            )
        self.sequence_parallel_axis = _sequence_axis(
            mesh, sequence_parallel, batch_axis, "sequence_parallel", "model"
        )
        if context_parallel is None:
            context_parallel = _context_parallel_by_default(
                mesh, layout_map, batch_axis, sequence_parallel, stages.stage_axis
            )
        self.context_parallel_axis = _sequence_axis(
            mesh, context_parallel, batch_axis, "context_parallel", _CONTEXT_AXIS
        )
        for option, axis in (
            ("sequence_parallel", self.sequence_parallel_axis),
            ("context_parallel", self.context_parallel_axis),
        ):
            if axis is not None and stages.stage_axis is not None:
                raise ValueError(
                    f"{option} splits sequences over mesh axis {axis!r}, and this mesh has the "
                    f"pipeline axis {stages.stage_axis!r}: tfmp does not split sequences inside "
                    f"pipeline stages yet (DTensor fails the training step). Pass {option}=False "
                    "for the pipeline, or split the sequence on a mesh without a stage axis."
                )
        if self.sequence_parallel_axis and self.context_parallel_axis:
            raise ValueError(
                f"sequence_parallel={sequence_parallel!r} and context_parallel="
                f"{context_parallel!r} both split the sequence, and DTensor splits a "
                "dimension over one mesh axis: choose one (context_parallel also "
                "splits the sequence inside attention and the MLP)."
            )
        auto_axis = None
        if isinstance(layout_map, str):
            if layout_map != "auto":
                raise ValueError(
                    f"layout_map={layout_map!r}: pass a LayoutMap, a dict, None or 'auto'."
                )
            mesh.check_axis("model", what="layout_map='auto' splits over mesh axis")
            auto_axis, layout_map = "model", None
        super().__init__(
            ModelParallelExtended(
                self,
                mesh,
                as_layout_map(layout_map, mesh),
                batch_axis,
                stages,
                auto_axis,
                fully_shard=fully_shard,
            )
        )
        # The patches stay in while a strategy exists.
        integrations.install(self)

    @classmethod
    def from_keras(cls, distribution: Any, **kwargs: Any) -> "ModelParallelStrategy":
        """Returns the strategy equivalent to a `keras.distribution` distribution.

        The TensorFlow backend of Keras ignores `keras.distribution` (its
        variables stay plain and unsplit); this runs the same distribution
        with tfmp. A `keras.distribution.ModelParallel` gives its device mesh,
        layout map and batch dimension name; a `keras.distribution.DataParallel`
        gives its device mesh and batch dimension name (its first mesh axis),
        with every variable replicated. The rules of a Keras `LayoutMap` match
        variable paths as the installed Keras matches them (tfmp asks its
        `LayoutMap`'s own lookup; Keras 3.15 matches the whole path).

        With tfmp imported, `keras.distribution.set_distribution(distribution)`
        makes this strategy current (see the guide's "Code written for
        keras.distribution").

        Args:
            distribution: A `keras.distribution.ModelParallel` or
                `keras.distribution.DataParallel`.
            **kwargs: Other arguments of `ModelParallelStrategy`
                (`num_microbatches`, `schedule`), and `require_match=False`
                to train a model that no rule of the layout map matches
                (see `tfmp.LayoutMap`).

        Returns:
            A `ModelParallelStrategy` over the distribution's mesh.

        Raises:
            TypeError: If `distribution` is neither of these.
            ValueError: If it overrides `get_variable_layout` or
                `get_data_layout`: tfmp lays variables and batches out from
                the layout map and batch dimension, and would not honour them.

        Examples:
            >>> import keras, keras_hub, tfmp
            >>> mesh = keras.distribution.DeviceMesh(
            ...     (2, 4), ("batch", "model"), keras.distribution.list_devices())
            >>> layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
            >>> distribution = keras.distribution.ModelParallel(
            ...     layout_map=layout_map, batch_dim_name="batch")
            >>> strategy = tfmp.ModelParallelStrategy.from_keras(distribution)
            >>> with strategy.scope():
            ...     backbone = keras_hub.models.GemmaBackbone(
            ...         vocabulary_size=64, num_layers=1, num_query_heads=4,
            ...         num_key_value_heads=4, hidden_dim=16, intermediate_dim=64,
            ...         head_dim=4)
        """
        require_match = kwargs.pop("require_match", True)
        if isinstance(distribution, keras.distribution.ModelParallel):
            # Keras has no public getter for a ModelParallel's layout map.
            layout_map = distribution._layout_map  # noqa: SLF001
            kind = keras.distribution.ModelParallel
        elif isinstance(distribution, keras.distribution.DataParallel):
            layout_map = None
            kind = keras.distribution.DataParallel
        else:
            raise TypeError(
                "ModelParallelStrategy.from_keras takes a "
                "keras.distribution.ModelParallel or keras.distribution.DataParallel, "
                f"got {type(distribution).__name__}: {distribution!r}. For a mesh and "
                "layout map of your own, call ModelParallelStrategy(mesh, layout_map)."
            )
        overridden = [
            name
            for name in ("get_variable_layout", "get_data_layout")
            if getattr(type(distribution), name) is not getattr(kind, name)
        ]
        if overridden:
            raise ValueError(
                f"{type(distribution).__name__} overrides {overridden} of "
                f"keras.distribution.{kind.__name__}; tfmp lays out variables by the "
                "layout map and batches over batch_dim_name, and would not honour "
                "them. Express the layouts as LayoutMap rules instead."
            )
        strategy = cls(
            distribution.device_mesh,
            layout_map,
            batch_axis=distribution.batch_dim_name,
            **kwargs,
        )
        strategy.layout_map.require_match = require_match
        return strategy

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh the strategy places variables and batches on."""
        return self.extended.mesh

    @property
    def stage_meshes(self) -> Any:
        """Each pipeline stage's mesh (a `tfmp.pipeline.stages.StageMeshes`),
        if the mesh has a `"stage"` axis; else None."""
        return self.extended.stages.stage_meshes

    @property
    def layout_map(self) -> LayoutMap:
        """The rules that give variables their layouts."""
        return self.extended.layout_map

    @property
    def batch_axis(self) -> str | None:
        """The mesh axis that splits each batch, or None."""
        return self.extended.placer.batch_axis

    def __repr__(self) -> str:
        return (
            f"ModelParallelStrategy({self.mesh!r}, layout_map with "
            f"{len(self.layout_map)} rules, batch_axis={self.batch_axis!r})"
        )


def _context_parallel_by_default(
    mesh: DeviceMesh,
    layout_map: Any,
    batch_axis: str | None,
    sequence_parallel: bool | str,
    stage_axis: str | None,
) -> bool:
    """Whether context parallelism is on when not asked about: with
    `layout_map="auto"` on a mesh with a `"sequence"` axis longer than 1 (the
    axis it would use, which nothing else splits), sequence parallelism off
    and no pipeline."""
    return (
        stage_axis is None
        and isinstance(layout_map, str)
        and layout_map == "auto"
        and _CONTEXT_AXIS in mesh.axis_names
        and mesh.axis_size(_CONTEXT_AXIS) > 1
        and batch_axis != _CONTEXT_AXIS
        and sequence_parallel is False
    )


def _sequence_axis(
    mesh: DeviceMesh, value: bool | str, batch_axis: str | None, option: str, default_axis: str
) -> str | None:
    """The mesh axis that `option` (`sequence_parallel` or `context_parallel`,
    given `value`) splits sequences over, or None."""
    if value is False:
        return None
    axis = default_axis if value is True else value
    if not isinstance(axis, str):
        raise TypeError(
            f"{option} must be True, False or a mesh axis name, got {value!r} "
            f"({type(value).__name__})."
        )
    mesh.check_axis(axis, what=f"{option} splits sequences over mesh axis")
    if axis == batch_axis:
        raise ValueError(
            f"{option}={value!r} names the batch axis {axis!r}; sequences are split "
            f"over another axis (usually {default_axis!r})."
        )
    return axis


def _resolve_batch_axis(
    mesh: DeviceMesh, batch_axis: str | None, stage_axis: str | None
) -> str | None:
    """The mesh axis that splits batches, or None; refuses a default that would
    leave an axis of the mesh computing copies of the same batch (the stage
    axis computes no copies: its devices hold different stages)."""
    if batch_axis is None or batch_axis in mesh.axis_names:
        return batch_axis
    if batch_axis != _DEFAULT_BATCH_AXIS:
        mesh.check_axis(batch_axis, what="batch_axis")
    idle = [
        name
        for name in mesh.axis_names
        if name not in (_TENSOR_AXIS, stage_axis) and mesh.axis_size(name) > 1
    ]
    if idle:
        raise ValueError(
            f"The mesh has axes {mesh.axis_names} and no {_DEFAULT_BATCH_AXIS!r} "
            f"axis, so batch_axis (default {_DEFAULT_BATCH_AXIS!r}) splits no batch "
            f"and the devices along {idle} would each compute the whole batch. Pass "
            f"batch_axis={idle[0]!r} to split batches over it (data parallelism), or "
            "batch_axis=None if your layout rules split weights over it."
        )
    return None
