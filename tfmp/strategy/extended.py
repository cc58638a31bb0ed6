"""The strategy's internals: variable creation, running steps, updates, input."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp import integrations
from tfmp.auto_layout import auto_layout, has_weights
from tfmp.integrations.internals import distribute_lib
from tfmp.layout import LayoutMap, declared_layout, explicit_layout, replicated
from tfmp.layout_decision import decide_layout
from tfmp.mesh import DeviceMesh
from tfmp.state import ModelState, known_state, state_of
from tfmp.strategy import agreement
from tfmp.strategy.graph_capture import FirstStepGraphs, first_step_graphs_of
from tfmp.strategy.idle_axes import idle_axes, warn_idle_axes
from tfmp.strategy.input import ClientMeshDataset, MeshDataset
from tfmp.strategy.placement import BatchPlacer, input_pipelines, replicate, to_host, to_layout
from tfmp.strategy.replica_context import GlobalReplicaContext
from tfmp.strategy.small_batch_values import restored
from tfmp.strategy.sparse_division import sparse_update_on
from tfmp.strategy.stage_hooks import StageHooks
from tfmp.strategy.undivided import UndividedDimensions
from tfmp.strategy.variable import MeshVariable
from tfmp.strategy.variable_layout import (
    gathered_axes,
    keras_variable_being_created,
    mesh_axes,
    slot_of,
    storage_layout,
)
from tfmp.strategy.watchdog import watch_custom_loop_steps
from tfmp.tracing import scoped

# Keyword arguments of tf.Variable creation that a DVariable does not take.
_DROPPED_VARIABLE_KWARGS = ("use_resource", "expected_shape", "caching_device")


def _optimizers_of(model: Any) -> list[Any]:
    """The model's compiled optimizer and those a `compile` of its own keeps
    as attributes (a GAN's `d_optimizer` and `g_optimizer`), once each."""
    found = [getattr(model, "optimizer", None), *vars(model).values()]
    optimizers = []
    for value in found:
        if isinstance(value, keras.optimizers.Optimizer) and not any(value is o for o in optimizers):
            optimizers.append(value)
    return optimizers


class ModelParallelExtended(distribute_lib.StrategyExtendedV2):
    """`strategy.extended` of `ModelParallelStrategy`."""

    def __init__(
        self,
        container_strategy: tf.distribute.Strategy,
        mesh: DeviceMesh,
        layout_map: LayoutMap,
        batch_axis: str | None,
        stages: StageHooks,
        auto_axis: str | None = None,
        fully_shard: bool = False,
    ):
        super().__init__(container_strategy)
        self.mesh = mesh
        self.layout_map = layout_map
        self.auto_axis = auto_axis
        # Which mesh holds each variable, and what a pipeline changes (tfmp.pipeline).
        self.stages = stages
        # Where everything outside a pipeline stage lives, and outputs leave from.
        self.home_mesh = stages.home_mesh
        self.placer = BatchPlacer(
            self.home_mesh.dtensor_mesh,
            batch_axis,
            input_mesh=stages.input_mesh.dtensor_mesh,
            check_rows=self._check_host_batch,
            on_batch_read=self._note_batch_order,
        )
        # The training batches read, while `tfmp.callbacks.InputOrderCheck`
        # checks their order; else None.
        self.batch_order: agreement.BatchOrder | None = None
        # Whether the batches placed now feed training steps (see `feeding`).
        self._batches_train = True
        self.fully_shard_axis = batch_axis if fully_shard else None
        self.first_step_graphs = FirstStepGraphs()
        self._checked_layout_map = False
        # The dimensions layouts split that the mesh cannot, till the next step.
        self.undivided = UndividedDimensions()
        # The variables that optimizers have made slots for.
        self._with_slots: set[Any] = set()
        # The variables `layout_map="auto"` has laid out.
        self._planned_values: set[Any] = set()
        # The Keras models made in the strategy's scope (`made_in_scope`).
        # In the order they were made: every client lists them alike.
        self.models: "weakref.WeakKeyDictionary[Any, None]" = weakref.WeakKeyDictionary()
        # How many Keras fit/evaluate/predict/*_on_batch calls run now: Keras
        # sees one replica (see `_num_replicas_in_sync`).
        self._keras_methods = 0
        # The rows of the batch a step last received: the outputs with as
        # many rows hold one row per example (see `is_per_example`).
        self._step_rows = None

    # Variables -------------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        del next_creator  # the strategy's variables are never plain variables
        for key in _DROPPED_VARIABLE_KWARGS:
            kwargs.pop(key, None)
        colocate_with = kwargs.pop("colocate_with", None)
        initial_value = kwargs.pop("initial_value")
        dtype = kwargs.get("dtype")
        keras_variable = keras_variable_being_created()
        path = (
            scoped_name(kwargs.get("name"))
            if keras_variable is None
            else keras_variable.path
        )
        stage = self.stages.stage_of_new_variable(keras_variable, colocate_with)
        mesh = self.stages.mesh_of(stage)
        known = dict(
            slot_of=slot_of(colocate_with),
            # Keras hands an optimizer slot its variable's `layout=` too, which
            # need not fit a slot of another shape (a factored second moment):
            # slots are laid out by their variable (or the rules) instead.
            explicit=explicit_layout(keras_variable) if colocate_with is None else None,
            declared=declared_layout(path, keras_variable),
            rule=self.layout_map.match(path),
            fully_shard_axis=self.fully_shard_axis,
        )

        def initial_value_on_mesh():
            # Computed on the host so that each device only ever holds its shard.
            with tf.device("CPU:0"):
                value = initial_value() if callable(initial_value) else initial_value
                value = tf.convert_to_tensor(value, dtype=dtype)
            decision = decide_layout(path, value.shape, value.dtype, mesh_axes(mesh), **known)
            layout = storage_layout(decision, mesh)
            if colocate_with is None:
                self.undivided.note_variable(path, value, layout, list(decision.undivided))
            return to_layout(value, layout), decision

        if colocate_with is not None:
            self._with_slots.add(colocate_with.ref())
        # Made in a trace (an optimizer's slots at its first `apply_gradients`
        # inside a tf.function, a model built by its first call in the step):
        # lifted out of it, as TensorFlow lifts a variable's initializer, since
        # DTensor lays out values only eagerly (`DVariable` would run
        # `initial_value_on_mesh` in the graph).
        with tf.init_scope(), dtensor.default_mesh(mesh.dtensor_mesh):
            value, decision = initial_value_on_mesh()
            return MeshVariable(
                value,
                path=path,
                placer=self.placer,
                stage=stage,
                gathered_axes=gathered_axes(self.placer.batch_axis, decision),
                **kwargs,
            )

    def prepare(self, model: Any) -> None:
        """Called as `model` starts fit, evaluate, predict or `*_on_batch`.

        Lays out its variables with `layout_map="auto"`, and makes the graphs
        of the batches fed next that model's.
        """
        self.apply_auto_layouts(model)
        self.adopt_training_state(model)
        self.check_clients_agree([model])
        self.first_step_graphs = first_step_graphs_of(model)

    def check_clients_agree(self, models: list[Any]) -> None:
        """In a multi-client run: refuses, on every client, models whose
        variables (not compared yet) or plan differ between clients, before
        they run a step (`tfmp.strategy.agreement`). Nothing in one client."""
        if dtensor.num_clients() == 1:
            return
        found: dict[int, MeshVariable] = {}
        for model in models:
            # A tf_keras model's variables are the strategy's own; it has no
            # `metrics_variables`, and its optimizer is no Keras 3 one (a
            # legacy one's `variables` is a method).
            variables = [*model.variables, *getattr(model, "metrics_variables", ())]
            for optimizer in _optimizers_of(model) or [getattr(model, "optimizer", None)]:
                slots = getattr(optimizer, "variables", ())
                variables += slots() if callable(slots) else slots
            for variable in variables:
                value = variable if isinstance(variable, MeshVariable) else getattr(variable, "value", None)
                if isinstance(value, MeshVariable) and not value.agreed:
                    found.setdefault(id(value), value)
        agreement.check_model(list(found.values()), self.plan())

    def plan(self) -> dict[str, str]:
        """What decides every variable's layout and every step's collectives,
        as text each client can compare with another's."""
        strategy = self._container_strategy()
        mesh = self.mesh
        return {
            "mesh": f"{dict(zip(mesh.axis_names, mesh.shape))} over {list(mesh.devices.flat)}",
            "layout rules": repr(dict(self.layout_map.items())),
            "strategy settings": repr({
                "batch_axis": self.placer.batch_axis,
                "fully_shard": self.fully_shard_axis is not None,
                "num_microbatches": strategy.num_microbatches,
                "schedule": strategy.schedule,
                "whole_path": self.layout_map.whole_path,
            }),
        }

    def adopt_training_state(self, model: Any) -> None:
        """Brings onto the mesh what `compile` and the optimizer made outside
        this strategy's scope.

        Keras makes the loss tracker and compiled metrics' variables in
        `compile`, and the optimizer its step counter and learning rate when
        it is made: outside the scope, these are host variables, which the
        mesh's step does not update reliably (a 2x4 MLP's losses and weights
        came out wrong, differing from run to run). They move to the mesh,
        replicated, before the model runs. The optimizer also keeps the
        strategy current when it was made, to make its slots and run its
        updates under; it is handed this one, which it can take only before
        it has slots. A `compile` of the model's own may keep more optimizers
        as attributes (a GAN's `d_optimizer` and `g_optimizer`): each is
        brought over alike. Done once per compiled optimizer and metrics: the
        `*_on_batch` methods come here every step.
        """
        optimizers = _optimizers_of(model)
        compiled = (*optimizers, *model.metrics)
        state = state_of(model, ModelState)
        if len(state.adopted) == len(compiled) and all(
            kept() is part for kept, part in zip(state.adopted, compiled)
        ):
            return
        strategy = self._container_strategy()
        parts = [*optimizers, *(getattr(o, "inner_optimizer", None) for o in optimizers)]
        for part in parts:
            if getattr(part, "_distribution_strategy", strategy) is strategy:
                continue
            if part.built:
                raise ValueError(
                    f"model {model.name!r}'s optimizer {type(part).__name__} made its "
                    "variables outside this strategy, so they are not on its mesh. "
                    "Make the optimizer in `with strategy.scope():`, or give "
                    "`compile` a new one before the model trains."
                )
            part._distribution_strategy = strategy  # noqa: SLF001
        made_outside = [variable for optimizer in optimizers for variable in optimizer.variables]
        made_outside += model.metrics_variables
        mesh = self.home_mesh.dtensor_mesh
        for variable in made_outside:
            if not isinstance(variable.value, MeshVariable):
                self.move_variable(
                    variable, dtensor.Layout.replicated(mesh, len(variable.shape)), gathered=()
                )
        state.adopted = tuple(map(weakref.ref, compiled))

    @contextlib.contextmanager
    def feeding(self, trains: bool) -> Iterator[None]:
        """The block runs one of Keras' own methods: whether its batches
        feed training steps (fit, `train_on_batch`) or not (evaluate,
        predict), which the stage hooks' batch check is told, and Keras sees
        one replica in it. Outside any such block batches count as training."""
        previous, self._batches_train = self._batches_train, trains
        self._keras_methods += 1
        try:
            yield
        finally:
            self._keras_methods -= 1
            self._batches_train = previous

    def _note_batch_order(self, batch: Any, local_rows: bool) -> None:
        if self.batch_order is not None and self._batches_train:
            # Clients reading their own rows compare with those of their part.
            self.batch_order.record(batch, self._input_pipelines()[1] if local_rows else 0)

    def _check_host_batch(self, rows: int) -> None:
        self.stages.check_host_batch(rows, trains=self._batches_train)

    def apply_auto_layouts(self, model: Any) -> None:
        """With `layout_map="auto"`: plans the model's layouts and moves its
        variables to them, once, before its optimizer has slots."""
        if self.auto_axis is None or self._is_planned(model):
            return
        if not has_weights(model) or self._has_slots(model):
            raise ValueError(
                f"layout_map='auto' lays out model {model.name!r} before it first "
                "trains or predicts, so the model must be built (give it a "
                "keras.Input, or call model.build(input_shape) in the strategy's "
                "scope) and no optimizer may have made its variables yet (build "
                "or load it in `with strategy.scope():`)."
            )
        state_of(model, ModelState).auto_planned = True
        plan = auto_layout(model, self.mesh, self.auto_axis)
        for variable in model.variables:
            planned = plan.match(variable.path)
            if planned is None:
                continue
            mesh = self.stages.mesh_of(variable.value.stage)
            decision = decide_layout(
                variable.path,
                variable.shape,
                variable.dtype,
                mesh_axes(mesh),
                explicit=explicit_layout(variable),
                planned=planned,
                fully_shard_axis=self.fully_shard_axis,
            )
            if decision.source == "explicit":
                continue  # laid out as it was made
            layout = storage_layout(decision, mesh)
            self.undivided.note_variable(variable.path, variable.value, layout, list(decision.undivided))
            self.move_variable(
                variable, layout, gathered=gathered_axes(self.placer.batch_axis, decision)
            )
        self.layout_map = plan
        self._planned_values.update(v.value.ref() for v in model.variables)

    def move_variable(
        self,
        variable: Any,
        layout: dtensor.Layout,
        stage: int | None = None,
        gathered: tuple[str, ...] | None = None,
    ) -> None:
        """Gives a Keras variable a new value with `layout`, held by `stage`
        (by default the stage that holds it now) and gathered on use over the
        axes `gathered` (by default those it is gathered over now): for a
        planned layout, a pipeline stage's variable made before its stage
        was known, or a host variable made outside the strategy's scope."""
        value = variable.value
        with dtensor.default_mesh(layout.mesh):
            variable._value = MeshVariable(  # noqa: SLF001
                to_layout(value.read_value(), layout),
                path=getattr(value, "path", variable.path),
                placer=self.placer,
                stage=getattr(value, "stage", None) if stage is None else stage,
                gathered_axes=value.gathered_axes if gathered is None else gathered,
                name=value.name.split(":")[0],
                trainable=value.trainable,
                dtype=value.dtype,
            )

    def _validate_colocate_with_variable(self, colocate_with_variable: Any) -> None:
        pass

    # Running steps ---------------------------------------------------------

    @property
    def _num_replicas_in_sync(self) -> int:
        """As many replicas as the batch axis has devices, as MirroredStrategy
        on that many devices, so that a custom loop's global batch size is
        the same; but 1 in the replica context, where the step sees the
        global batch, and in Keras' own methods, which divide the loss by
        this number (docs/custom-loops.md)."""
        if self._keras_methods or self._in_replica_context():
            return 1
        return self.placer.batch_parts

    def _in_replica_context(self) -> bool:
        context = tf.distribute.get_replica_context()
        return (
            isinstance(context, GlobalReplicaContext)
            and context.strategy is self._container_strategy()
        )

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return tuple(self.mesh.dtensor_mesh.local_devices())

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return self.worker_devices

    def _in_multi_worker_mode(self) -> bool:
        return dtensor.num_clients() > 1

    @property
    def should_checkpoint(self) -> bool:
        """Every client saves: each writes its own shards of a DTensor
        checkpoint, all to the same (shared) directory."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Only the chief writes summaries, so one file holds each value."""
        return dtensor.client_id() == 0

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group

    def _use_merge_call(self) -> bool:
        return False

    def call_for_each_replica(self, fn, args=(), kwargs=None):
        distribute_lib._require_cross_replica_or_default_context_extended(self)  # noqa: SLF001
        args, kwargs = restored((args, kwargs or {}))
        # A library tfmp changes (KerasHub) may be imported after the strategy was made.
        integrations.install()
        self.apply_custom_loop_auto_layouts()
        if not self._keras_methods:
            with tf.init_scope():  # a custom loop's step: before it runs
                self.check_clients_agree(list(self.models))
            watch_custom_loop_steps()
        if tf.executing_eagerly():
            args, kwargs = self.placer.place((args, kwargs))
        self.note_step_rows((args, kwargs))
        sequence_axis = self._container_strategy().context_parallel_axis
        with GlobalReplicaContext(self._container_strategy()), scoped(
            step_on_mesh=True, step_sequence_axis=sequence_axis
        ):
            outputs = fn(*args, **kwargs)
        # After the step: a model built by its first call in the step exists now.
        self.warn_about_layout_rules()
        # Outputs leave the step replicated so that callers can read them.
        return tf.nest.map_structure(self._replicated_output, outputs)

    def note_step_rows(self, batch: Any) -> None:
        """Remembers the rows of the batch a step receives (its first tensor's
        leading dimension, if known)."""
        for value in tf.nest.flatten(batch):
            if isinstance(value, tf.Tensor) and value.shape.rank:
                self._step_rows = value.shape[0]
                return

    def is_per_example(self, value: Any) -> bool:
        """Whether a step's output holds one row per example of its batch: a
        per-replica value, whose replicas' parts are its blocks of rows.
        Any other output (a loss, a metric, a gradient) is already reduced
        over the global batch. Never in Keras' own methods."""
        return (
            not self._keras_methods
            and self._step_rows is not None
            and isinstance(value, tf.Tensor)
            and bool(value.shape.rank)
            and value.shape[0] == self._step_rows
        )

    def replica_blocks(self, value: tf.Tensor) -> list[tf.Tensor]:
        """A per-example output cut into each replica's rows, in replica
        order; a batch that does not divide gives the first replicas one row
        more, as `numpy.array_split`."""
        replicas = self.placer.batch_parts
        rows = int(value.shape[0])
        sizes = [rows // replicas + (i < rows % replicas) for i in range(replicas)]
        return tf.split(_off_mesh_if_eager(value), sizes, axis=0)

    def apply_custom_loop_auto_layouts(self) -> None:
        """With `layout_map="auto"`, at a custom loop's first `strategy.run`
        (Keras' own methods lay out their model in `prepare`): plans the
        models made in the scope that are no part of another, before the
        step reads their variables (moved out of a trace being made)."""
        for model in self._unplanned_models():
            if not model.built or self._has_slots(model):
                raise ValueError(
                    f"layout_map='auto' lays out model {model.name!r} at the first "
                    "strategy.run, so by then the model must be built (give it a "
                    "keras.Input, or call model.build(input_shape) in the strategy's "
                    "scope) and no optimizer may have made its variables yet; else "
                    "the step would train it replicated. Build the model before the "
                    "loop, or pass a LayoutMap."
                )
            with tf.init_scope():
                self.apply_auto_layouts(model)

    def _is_planned(self, model: Any) -> bool:
        """Whether `layout_map="auto"` has laid out `model`, or all its
        variables as another model's (a Sequential's inner functional model)."""
        state = known_state(model, ModelState)
        return (state is not None and state.auto_planned) or (
            bool(model.variables) and all(v.value.ref() in self._planned_values for v in model.variables)
        )

    def _has_slots(self, model: Any) -> bool:
        """Whether an optimizer has made variables for one of `model`'s."""
        return any(v.value.ref() in self._with_slots for v in model.variables)

    def _unplanned_models(self) -> list[Any]:
        """With `layout_map="auto"` in a custom loop: the models made in the
        scope, not yet laid out, that are no part of another such model."""
        if self.auto_axis is None or self._keras_methods:
            return []
        models = [model for model in self.models if not self._is_planned(model)]
        inner = {
            id(layer) for model in models for layer in model._flatten_layers(include_self=False)  # noqa: SLF001
        }
        return [model for model in models if id(model) not in inner]

    def apply_auto_layouts_before_slots(self, variables: list[Any]) -> None:
        """With `layout_map="auto"`, as an optimizer starts making its slots
        for `variables` outside Keras' methods (`optimizer.build` to restore a
        checkpoint into before a custom loop, `load_model` of a model with its
        optimizer): lays out the built models holding them first, so that the
        slots take the planned layouts and the optimizer knows the variables
        as they are then."""
        held = {id(variable) for variable in variables}
        for model in self._unplanned_models():
            if model.built and any(id(v) in held for v in model.variables):
                with tf.init_scope():
                    self.apply_auto_layouts(model)

    def _replicated_output(self, value: Any) -> Any:
        if isinstance(value, tf.Tensor):
            sequence_axis = self._container_strategy().context_parallel_axis
            return replicate(value, self.home_mesh.dtensor_mesh, sequence_axis)
        return value

    def _reduce_to(self, reduce_op, value, destinations, options):
        """Per-example outputs reduce over their replicas' blocks of rows, as
        MirroredStrategy reduces its replicas' values; every other output
        was computed over the global batch, which is already reduced."""
        del destinations, options
        if not self.is_per_example(value):
            return value
        replicas = self.placer.batch_parts
        if int(value.shape[0]) % replicas:
            raise ValueError(
                f"strategy.reduce(..., axis=None) of a value with {value.shape[0]} "
                f"rows, one per example of the step's batch: its {replicas} "
                "replicas' parts would have different shapes, which cannot be "
                "added up element by element (MirroredStrategy refuses them too). "
                "Pass axis=0 to reduce over every example, or use a batch size "
                f"that divides by {replicas}."
            )
        blocks = tf.reshape(_off_mesh_if_eager(value), [replicas, -1, *value.shape[1:]])
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            return tf.reduce_mean(blocks, axis=0)
        return tf.reduce_sum(blocks, axis=0)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return [
            self._reduce_to(reduce_op, value, destinations, options)
            for value, destinations in value_destination_pairs
        ]

    def _gather_to_implementation(self, value, destinations, axis, options):
        return value

    def _local_results(self, value):
        if self.is_per_example(value):
            return tuple(self.replica_blocks(value))
        return (value,)

    def value_container(self, value):
        return value

    def _update(self, var, fn, args, kwargs, group):
        if args:
            args = (_gradient_for(var, args[0]),) + tuple(args[1:])
        fn = self.stages.update_on_stage(var, fn)  # a pipeline stage's weight: on its mesh
        sparse = bool(args) and isinstance(args[0], tf.IndexedSlices)
        if sparse and isinstance(var, MeshVariable):
            updating = sparse_update_on(var.layout.mesh)
        else:
            updating = contextlib.nullcontext()
        with updating:
            return self._update_non_slot(var, fn, (var,) + tuple(args), kwargs, group)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        del colocate_with
        result = fn(*args, **kwargs)
        return result if group else tf.nest.map_structure(lambda value: (value,), result)

    # Input -----------------------------------------------------------------

    def _experimental_distribute_dataset(self, dataset, options):
        del options
        self.warn_about_layout_rules()
        _install_host_fed_loops()
        return MeshDataset(
            dataset, self.placer, self.first_step_graphs, on_batch=self.note_step_rows
        )

    def _distribute_datasets_from_function(self, dataset_fn, options):
        """Each client reads its own part of every batch: `dataset_fn` gets an
        `InputContext` whose pipelines are the clients' parts of the batch
        axis, and returns batches of this client's rows only."""
        del options
        self.warn_about_layout_rules()
        _install_host_fed_loops()
        pipelines, pipeline_id = self._input_pipelines()
        context = tf.distribute.InputContext(
            num_input_pipelines=pipelines, input_pipeline_id=pipeline_id, num_replicas_in_sync=1
        )
        return ClientMeshDataset(
            dataset_fn(context),
            self.placer,
            self.first_step_graphs,
            local_rows=pipelines > 1,
            on_batch=self.note_step_rows,
        )

    def _input_pipelines(self) -> tuple[int, int]:
        """How many parts the clients read of a batch, and this client's part."""
        if self.placer.batch_axis is None:
            return 1, 0
        return input_pipelines(
            self.stages.input_mesh.client_positions(self.placer.batch_axis),
            dtensor.client_id(),
            self.placer.batch_axis,
        )

    def _experimental_distribute_values_from_function(self, value_fn):
        return self.placer.place(
            value_fn(tf.distribute.experimental.ValueContext(0, 1))
        )

    def warn_about_layout_rules(self) -> None:
        """Checks once, at the first step whose model has variables, the
        LayoutMap rules against them (`LayoutMap.check_matched`), and warns
        at each step about the dimensions kept whole since the last one, in
        one message (`UndividedDimensions`)."""
        if not self._checked_layout_map:
            self._checked_layout_map = self.layout_map.check_matched()
            if self._checked_layout_map:
                self._warn_idle_axes()
        self.undivided.warn(list(self.models))

    def _warn_idle_axes(self) -> None:
        strategy = self._container_strategy()
        used = (
            self.placer.batch_axis,
            strategy.context_parallel_axis,
            strategy.sequence_parallel_axis,
            self.stages.stage_axis,
            *self.layout_map.axes_named(),
        )
        models = [model for model in self.models if model.weights]
        idle = idle_axes(self.mesh, used, models)
        if idle:
            warn_idle_axes(self.mesh, idle, [model.name for model in models])


def _off_mesh_if_eager(value: tf.Tensor) -> tf.Tensor:
    """`value` whole on the host, where eager ops may cut it up (eager DTensor
    refuses the host constants they take); a DTensor in a function."""
    return to_host(value) if tf.executing_eagerly() else value


def _gradient_for(var: Any, gradient: Any) -> Any:
    """The gradient an optimizer applies to `var`, laid out like `var`.

    tf_keras' legacy optimizers write with fused kernels (`ResourceApplyAdam`,
    ...) straight into the variable's handle; DTensor does not relayout their
    inputs, and a gradient laid out unlike its variable crashed the process.
    A no-op when the gradient has the layout already. A sparse gradient gets
    its rows on every device (`_rows_on_every_device`).
    """
    if not isinstance(var, MeshVariable) or tf.executing_eagerly():
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        return _rows_on_every_device(var, gradient)
    if isinstance(gradient, tf.Tensor) and gradient.shape == var.shape:
        return dtensor.relayout(gradient, var.layout)
    return gradient


def _rows_on_every_device(var: MeshVariable, gradient: tf.IndexedSlices) -> tf.IndexedSlices:
    """`gradient` (rows of `var`, an embedding's) with every row on every
    device, its other dimensions split as `var`'s.

    Keras' optimizers sum a sparse gradient's rows by index into a table-sized
    tensor (Adam twice: the rows, then their squares). The rows come split
    over the batch axis like the batch, so each device would sum its own and
    DTensor all-reduce the whole table at every sum. With the rows gathered
    first, each device sums all of them, in one device's order, straight into
    its part of the table: one gather of the rows, no table-sized reduction.
    Kept as is when the gradient has as many rows as the table or more, where
    reducing the table moves fewer bytes. Rows of unknown number (the step
    Keras traces again for a partial last batch; every step of tf_keras'
    `fit`) are gathered only for a table whose features are split in storage
    and gathered for the lookup (`gather_on_use`, a fully sharded
    `("model", "batch")`): kept as they came, they took the table's split
    from the sums, and DTensor pushed it back onto the lookup's output, which
    the layers above cannot take ("requires dimension 1 to be divisible", a
    concatenation of 30 features over 4 devices; "output layout of Relayout
    op after layout propagation does not match" in `RelayoutLike`). A table
    looked up split keeps them: its rows come split like its features, and
    gathering rows of unknown number made DTensor expand them to none (a
    tf_keras BERT encoder: `DTensorAllScatter` "computed output shape 0").

    The rows are made replicated first: DTensor also propagates a
    relayout's layout back into the ops that made its input, and pushed
    back there, a split layout made it mis-expand a `Tile` (an embedding
    stored `("model", "batch")` under a pooling layer) or a `ConcatV2` (a
    pipeline's sum of micro-batches' rows).
    """
    rows = gradient.values.shape[0]
    if gradient.values.shape.rank != var.shape.rank:
        return gradient
    if rows is None:
        if not set(var.layout.sharding_specs[1:]) & set(var.gathered_axes):
            return gradient
    elif rows >= var.shape[0]:
        return gradient
    mesh = var.layout.mesh
    values = replicated(gradient.values, mesh)
    values_layout = dtensor.Layout([dtensor.UNSHARDED, *var.layout.sharding_specs[1:]], mesh)
    return tf.IndexedSlices(
        dtensor.relayout(values, values_layout),
        dtensor.relayout(gradient.indices, dtensor.Layout.replicated(mesh, 1)),
        gradient.dense_shape,
    )


def made_in_scope(initialize: Callable) -> Callable:
    """Keras' trainer notes the strategy whose scope a model is made in: a
    tfmp strategy also keeps the model (`apply_custom_loop_auto_layouts`)."""

    @functools.wraps(initialize)
    def wrapper(self, *args, **kwargs):
        initialize(self, *args, **kwargs)
        extended = extended_of(self._distribute_strategy)  # noqa: SLF001
        if extended is not None:
            extended.models[self] = None

    return wrapper


def extended_of(strategy: Any) -> ModelParallelExtended | None:
    """`strategy.extended` if `strategy` is a tfmp strategy, else None."""
    extended = getattr(strategy, "extended", None)
    return extended if isinstance(extended, ModelParallelExtended) else None


def _install_host_fed_loops() -> None:
    """tf_keras and Orbit distribute their data before they make their step
    functions (both read batches inside them, which tfmp's cannot be), and
    may have been imported after the strategy was made."""
    integrations.install()


def scoped_name(name: str | None) -> str:
    """The path of a variable created outside Keras: name scope + name."""
    name = (name or "Variable").split(":")[0]
    parent = tf.get_current_name_scope().rstrip("/")
    return f"{parent}/{name}" if parent else name
