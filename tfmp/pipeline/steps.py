"""The training and evaluation steps of a pipeline model.

A training step splits the batch into micro-batches and emits each stage's
forward and backward passes in its schedule's order. Stages run concurrently
on their own devices; with an ordered schedule (1F1B, or recompute) each
stage's passes are chained by a data tie, since DTensor drops control
dependencies. Each stage's backward pass is its own gradient computation, so
its ops run on its devices and its input's gradient is handed to the
previous stage like an activation. Gradients of the micro-batches are summed
as they arrive, for one optimizer update, and each micro-batch's loss is
weighted so that the sum is the whole batch's loss.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils
from tensorflow.experimental import dtensor

from tfmp.mesh import DeviceMesh
from tfmp.pipeline.layer_group import LayerGroup
from tfmp.pipeline.schedule import Action, emission_order, stage_orders
from tfmp.strategy.placement import replicate
from tfmp.strategy.stages import move_to_stage, scalars_on_stages


def pipeline_groups(model: keras.Model) -> list[LayerGroup]:
    """The model's LayerGroups in stage order, checked against the mesh."""
    num_stages = model.distribute_strategy.stage_meshes.num_stages
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    outside = [layer.name for layer in layers if not isinstance(layer, LayerGroup)]
    if outside:
        raise ValueError(
            f"Pipeline model {model.name!r}: layers {outside} are in no "
            "tfmp.layers.LayerGroup. On a mesh with a 'stage' axis, every layer "
            "belongs to a stage: put them in the LayerGroup of their stage."
        )
    stages = [group.stage for group in layers]
    if stages != list(range(num_stages)):
        raise ValueError(
            f"Pipeline model {model.name!r} has LayerGroups of stages {stages}, but "
            f"the mesh has {num_stages} stages: chain one LayerGroup per stage, "
            f"stages 0 to {num_stages - 1} in order (tfmp.balance suggests a split)."
        )
    if model.losses:
        raise ValueError(
            f"Pipeline model {model.name!r} adds losses of its own (regularizers or "
            "add_loss), which tfmp pipelines do not support yet: move them into "
            "the compiled loss."
        )
    return layers


def train_step(model: keras.Model, data: Any) -> dict[str, Any]:
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    strategy = model.distribute_strategy
    groups = pipeline_groups(model)
    meshes = strategy.stage_meshes.meshes
    num_microbatches = strategy.num_microbatches
    # GPipe's passes run as soon as their inputs are ready, the fastest order.
    # 1F1B's memory bound, and recomputing a stage just before its backward
    # pass, hold only if each stage keeps to its schedule.
    ordered = strategy.schedule == "1f1b" or any(group.recompute for group in groups)
    pipeline = _Pipeline(model, groups, meshes, strategy.batch_axis, ordered)
    microbatch_weight = _microbatch_loss_weight(model, num_microbatches)
    xs = _split(x, num_microbatches, meshes[0], strategy.batch_axis)
    ys = _split(y, num_microbatches, meshes[-1], strategy.batch_axis)
    weights = _split(sample_weight, num_microbatches, meshes[-1], strategy.batch_axis)
    with scalars_on_stages(_optimizer_scalars(model.optimizer, meshes)):
        orders = stage_orders(strategy.schedule, len(groups), num_microbatches)
        for action in emission_order(orders):
            pipeline.run(action, xs, ys, weights, microbatch_weight)
        total_loss = tf.add_n(pipeline.losses)
        batch_size = tf.shape(tf.nest.flatten(y)[0])[0]
        model._loss_tracker.update_state(total_loss, sample_weight=batch_size)  # noqa: SLF001
        model.optimizer.apply_gradients(pipeline.summed_gradients(model.trainable_weights))
    return model.get_metrics_result()


def test_step(model: keras.Model, data: Any) -> dict[str, Any]:
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    pipeline_groups(model)
    y_pred = model(x, training=False)
    loss = model.compute_loss(x=None, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
    batch_size = tf.shape(tf.nest.flatten(y)[0])[0]
    model._loss_tracker.update_state(loss, sample_weight=batch_size)  # noqa: SLF001
    return model.compute_metrics(None, y, y_pred, sample_weight=sample_weight)


class _Pipeline:
    """The tensors of one training step, filled in action by action."""

    def __init__(
        self,
        model: keras.Model,
        groups: list[LayerGroup],
        meshes: list[DeviceMesh],
        batch_axis: str | None,
        ordered: bool,
    ):
        self.model = model
        self.ordered = ordered
        self.groups = groups
        self.meshes = meshes
        self.batch_axis = batch_axis
        self.inputs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.tapes: dict[tuple[int, int], tf.GradientTape] = {}
        self.output_gradients: dict[tuple[int, int], Any] = {}
        self.gradients: dict[int, Any] = {}  # running sums over micro-batches
        self.losses: list[tf.Tensor] = []
        self.scaled_losses: dict[int, tf.Tensor] = {}  # what each last-stage backward starts from
        # With `ordered`, a scalar of each stage's latest pass: the next pass's
        # inputs are tied to it, which makes the stage run its passes in the
        # schedule's order (DTensor drops control dependencies, so the order
        # has to be carried by data).
        self._tokens: list[tf.Tensor | None] = [None] * len(groups)

    def run(self, action: Action, xs: list, ys: list, weights: list, loss_weight: float) -> None:
        stage, i = action.stage, action.microbatch
        last = len(self.groups) - 1
        if action.kind == "forward":
            if stage == 0:
                stage_input = xs[i]
            else:
                stage_input = move_to_stage(
                    self.outputs[stage - 1, i], self.meshes[stage - 1], self.meshes[stage], self.batch_axis
                )
            stage_input = self._after_last_pass(stage, stage_input)
            self.inputs[stage, i] = stage_input
            record = not self.groups[stage].recompute
            outputs, loss, tape = self._forward(stage, i, stage_input, ys[i], weights[i], loss_weight, record)
            if stage == last:
                self.losses.append(loss)
                self.model.compute_metrics(None, ys[i], outputs, sample_weight=weights[i])
                self._tokens[stage] = loss
            else:
                self._tokens[stage] = _element(tf.nest.flatten(outputs)[0], self.meshes[stage])
            self.outputs[stage, i] = outputs
            self.tapes[stage, i] = tape
            return
        tape = self.tapes.pop((stage, i))
        stage_input = self.inputs.pop((stage, i))
        if tape is None:  # recompute: run the stage again, this time recorded
            stage_input = self._after_last_pass(stage, stage_input)
            self.outputs[stage, i], _, tape = self._forward(
                stage, i, stage_input, ys[i], weights[i], loss_weight, True
            )
        if stage == last:
            target = self.scaled_losses.pop(i)
            upstream = tf.ones_like(target)
        else:
            target = self.outputs[stage, i]
            upstream = self.output_gradients.pop((stage, i))
        upstream = self._after_last_pass(stage, upstream)
        self._backward(stage, i, tape, target, upstream, stage_input)
        self.outputs.pop((stage, i), None)

    def _after_last_pass(self, stage: int, structure: Any) -> Any:
        token = self._tokens[stage]
        if token is None or not self.ordered:
            return structure
        return tf.nest.map_structure(lambda t: _tied(t, token), structure)

    def _forward(
        self, stage: int, i: int, stage_input: Any, y: Any, weight: Any, loss_weight: float, record: bool
    ) -> tuple[Any, Any, tf.GradientTape | None]:
        group = self.groups[stage]
        tape = tf.GradientTape() if record else None
        with tape or contextlib.nullcontext():
            if tape is not None and stage > 0:
                tape.watch(stage_input)
            outputs = group(stage_input, training=True, arrived=True)
            loss = None
            if stage == len(self.groups) - 1:
                loss = self.model.compute_loss(
                    x=None, y=y, y_pred=outputs, sample_weight=weight, training=True
                ) * loss_weight
                if tape is not None:
                    self.scaled_losses[i] = self.model.optimizer.scale_loss(loss)
        return outputs, loss, tape

    def _backward(
        self, stage: int, i: int, tape: tf.GradientTape, target: Any, upstream: Any, stage_input: Any
    ) -> None:
        variables = self.groups[stage].trainable_weights
        sources = list(variables) + ([stage_input] if stage > 0 else [])
        gradients = tape.gradient(target, sources, output_gradients=upstream)
        for variable, gradient in zip(variables, gradients):
            self.gradients[id(variable)] = _add(self.gradients.get(id(variable)), gradient)
        if stage > 0:
            self._tokens[stage] = _element(gradients[-1], self.meshes[stage])
            self.output_gradients[stage - 1, i] = move_to_stage(
                gradients[-1], self.meshes[stage], self.meshes[stage - 1], self.batch_axis
            )
        else:
            # The first layer's gradients come last in the backward pass.
            first = next(g for g in gradients if g is not None)
            values = first.values if isinstance(first, tf.IndexedSlices) else first
            self._tokens[stage] = tf.reduce_sum(values)

    def summed_gradients(self, variables: list) -> list[tuple[Any, Any]]:
        return [(self.gradients.get(id(v)), v) for v in variables]


def _element(value: tf.Tensor, mesh: DeviceMesh) -> tf.Tensor:
    """One element of `value`, as a replicated float scalar on `mesh`."""
    value = replicate(value, mesh.dtensor_mesh)
    rank = value.shape.rank
    element = tf.reshape(tf.slice(value, [0] * rank, [1] * rank), []) if rank else value
    return tf.cast(element, tf.float32)


def _tied(value: Any, token: tf.Tensor) -> Any:
    """`value`, computed only once `token` is: adds zero times the token.

    A non-finite token counts as zero, so that it cannot leak into `value`.
    """
    if not isinstance(value, tf.Tensor) or not (value.dtype.is_floating or value.dtype.is_integer):
        return value
    zero = tf.where(tf.math.is_finite(token), token, tf.zeros_like(token)) * 0.0
    return value + tf.cast(zero, value.dtype)


def _add(total: Any, gradient: Any) -> Any:
    """Adds a micro-batch's gradient to the running sum, as it arrives, so that
    one sum per variable is held rather than one gradient per micro-batch."""
    if total is None or gradient is None:
        return gradient if total is None else total
    if isinstance(total, tf.IndexedSlices) and isinstance(gradient, tf.IndexedSlices):
        # Kept sparse: optimizers update only the rows a sparse gradient names.
        return tf.IndexedSlices(
            tf.concat([total.values, gradient.values], axis=0),
            tf.concat([total.indices, gradient.indices], axis=0),
            total.dense_shape,
        )
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(gradient)


def _split(value: Any, num_microbatches: int, mesh: DeviceMesh, batch_axis: str | None) -> list:
    """`value`'s batch cut into `num_microbatches` equal parts, each split over
    the batch axis of `mesh` again."""
    if value is None:
        return [None] * num_microbatches
    parts_per_tensor = []
    for tensor in tf.nest.flatten(value):
        size = tensor.shape[0]
        if size is not None and size % num_microbatches:
            raise ValueError(
                f"A batch of {size} samples does not split into num_microbatches="
                f"{num_microbatches} equal micro-batches. Use a batch size that is a "
                f"multiple of {num_microbatches}, and a data set whose size divides "
                "by it (or drop_remainder=True in tf.data)."
            )
        # DTensor cannot split along a sharded dimension: gather the (small)
        # input batch first; each micro-batch is split over the batch axis again.
        whole = replicate(tensor, mesh.dtensor_mesh)
        step = size // num_microbatches
        rank = tensor.shape.rank
        pieces = [
            replicate(whole[i * step : (i + 1) * step], mesh.dtensor_mesh)
            for i in range(num_microbatches)
        ]
        parts = mesh.axis_size(batch_axis) if batch_axis in mesh.axis_names else 1
        if parts > 1 and size is not None and (size // num_microbatches) % parts == 0:
            layout = dtensor.Layout.batch_sharded(mesh.dtensor_mesh, batch_axis, rank)
        else:
            layout = dtensor.Layout.replicated(mesh.dtensor_mesh, rank)
        parts_per_tensor.append([dtensor.relayout(p, layout) for p in pieces])
    return [
        tf.nest.pack_sequence_as(value, [parts[i] for parts in parts_per_tensor])
        for i in range(num_microbatches)
    ]


def _microbatch_loss_weight(model: keras.Model, num_microbatches: int) -> float:
    """What each micro-batch's loss counts for in the batch's loss."""
    reductions = {
        getattr(loss, "reduction", "sum_over_batch_size")
        for loss in tf.nest.flatten(model.loss)
        if loss is not None
    }
    if reductions <= {"sum_over_batch_size"}:
        return 1.0 / num_microbatches
    if reductions == {"sum"}:
        return 1.0
    raise ValueError(
        f"Pipeline model {model.name!r} has losses with reductions {sorted(reductions)}: "
        "a pipeline sums micro-batch losses, which is exact for "
        "'sum_over_batch_size' (the default) and 'sum'. Use one of those."
    )


def _optimizer_scalars(optimizer: Any, meshes: list[DeviceMesh]) -> list[tuple[Any, list[Any]]]:
    """The optimizer's own variables, copied onto every stage's mesh."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    variables = [optimizer._iterations]  # noqa: SLF001
    if isinstance(optimizer._learning_rate, keras.Variable):  # noqa: SLF001
        variables.append(optimizer._learning_rate)  # noqa: SLF001
    home = meshes[-1]
    copies = []
    for variable in variables:
        value = replicate(variable.value.read_value(), home.dtensor_mesh)
        on_stages = [
            dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh.dtensor_mesh, value.shape.rank))
            for mesh in meshes[:-1]
        ]
        copies.append((variable, on_stages + [variable._value]))  # noqa: SLF001
    return copies
