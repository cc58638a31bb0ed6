"""The training and evaluation steps of a pipeline model.

A training step splits the batch into micro-batches and emits each stage's
forward and backward passes in its schedule's order. Stages run concurrently
on their own devices, and each stage's passes are chained by a data tie, in
its schedule's order, since DTensor drops control dependencies. Each stage's
backward pass is its own gradient computation, so its ops run on its
devices and its input's gradient is handed to the previous stage like an
activation. Gradients of the micro-batches are summed as they arrive, for
one optimizer update, and each micro-batch's loss is weighted so that the
sum is the whole batch's loss.

Keras masks cross stages with their activations. A loss that averages
(`sum_over_batch_size`) over masked values divides by the unmasked count,
which differs between micro-batches: each micro-batch's loss is weighted by
its share of unmasked values, and the summed loss and gradients are divided
by the batch's mean share once every micro-batch is done.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.forward import MicrobatchedStep
from tfmp.integrations.internals import data_adapter_utils, get_keras_mask, set_keras_mask
from tfmp.mesh import DeviceMesh
from tfmp.pipeline.layer_group import LayerGroup, move_with_masks
from tfmp.pipeline.schedule import Action, emission_order, stage_orders
from tfmp.pipeline.stages import move_to_stage, scalars_on_stages
from tfmp.pipeline.strategy_hooks import indivisible_batch
from tfmp.strategy.placement import replicate


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
    averaged = _loss_reduction(model) == "mean"
    microbatch_weight = 1.0 / num_microbatches if averaged else 1.0
    step = None
    if num_microbatches > 1:
        step = MicrobatchedStep(num_microbatches, _microbatch_rows(x, num_microbatches))
    pipeline = _Pipeline(model, groups, meshes, strategy.batch_axis, step, averaged)
    xs = _split(x, num_microbatches, meshes[0], strategy.batch_axis)
    ys = _split(y, num_microbatches, meshes[-1], strategy.batch_axis)
    weights = _split(sample_weight, num_microbatches, meshes[-1], strategy.batch_axis)
    with scalars_on_stages(_optimizer_scalars(model.optimizer, meshes)):
        orders = stage_orders(strategy.schedule, len(groups), num_microbatches)
        for action in emission_order(orders):
            pipeline.run(action, xs, ys, weights, microbatch_weight)
        total_loss = pipeline.total_loss()
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
        step: MicrobatchedStep | None,
        losses_average: bool,
    ):
        self.model = model
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
        # With several micro-batches, the step whose micro-batch is being
        # traced: random draws read it.
        self.step = step
        # Where the losses average over micro-batches and masks reach them:
        # each micro-batch's share of unmasked loss values.
        self.losses_average = losses_average
        self.unmasked_shares: dict[int, tf.Tensor] = {}
        # A scalar of each stage's latest pass: the next pass's inputs are
        # tied to it, which makes the stage run its passes one at a time, in
        # the schedule's order (DTensor drops control dependencies, so the
        # order has to be carried by data). 1F1B's memory bound, and
        # recomputing a stage just before its backward pass, hold only in
        # that order. GPipe keeps it too: free to run any ready pass, a stage
        # would run several at once wherever devices share cores (logical CPU
        # devices), taking the other stages' cores instead of running as one
        # device.
        self._tokens: list[tf.Tensor | None] = [None] * len(groups)

    def run(self, action: Action, xs: list, ys: list, weights: list, loss_weight: float) -> None:
        stage, i = action.stage, action.microbatch
        last = len(self.groups) - 1
        if action.kind == "forward":
            if stage == 0:
                stage_input = xs[i]
            else:
                stage_input = move_with_masks(
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
        if token is None:
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
            with self.step.microbatch(i) if self.step else contextlib.nullcontext():
                outputs = group(stage_input, training=True, arrived=True)
            loss = None
            if stage == len(self.groups) - 1:
                loss = self.model.compute_loss(
                    x=None, y=y, y_pred=outputs, sample_weight=weight, training=True
                )
                masks_matter = self.step is not None and self.losses_average
                share = self._unmasked_share(outputs) if masks_matter else None
                if share is not None:
                    self.unmasked_shares[i] = share
                    loss = loss * tf.cast(share, loss.dtype)
                loss = loss * loss_weight
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
            self.output_gradients[stage - 1, i] = move_with_masks(
                gradients[-1], self.meshes[stage], self.meshes[stage - 1], self.batch_axis
            )
        else:
            # The first layer's gradients come last in the backward pass.
            first = next(g for g in gradients if g is not None)
            values = first.values if isinstance(first, tf.IndexedSlices) else first
            self._tokens[stage] = tf.reduce_sum(values)

    def _unmasked_share(self, outputs: Any) -> tf.Tensor | None:
        """The share of a micro-batch's loss values that its output's Keras
        mask keeps (None: no mask reaches the loss).

        Keras averages a masked loss over the unmasked values only, so the
        batch's loss weights each micro-batch's by its unmasked count.
        """
        outputs = tf.nest.flatten(outputs)
        masks = [get_keras_mask(output) for output in outputs]
        if all(mask is None for mask in masks):
            return None
        if len(outputs) > 1:
            raise ValueError(
                f"Pipeline model {self.model.name!r} has {len(outputs)} outputs and Keras "
                "masks reach their losses: each masked loss averages over its own "
                "unmasked count, which tfmp combines over micro-batches for a model of "
                "one output only. Use num_microbatches=1, or losses with reduction='sum'."
            )
        return tf.reduce_mean(tf.cast(masks[0], tf.float32))

    def _mask_correction(self) -> tf.Tensor | None:
        """What the summed micro-batch losses are multiplied by to be the
        batch's: 1 / the mean unmasked share (None: no mask reached the loss)."""
        if not self.unmasked_shares:
            return None
        count = float(len(self.unmasked_shares))
        return tf.math.divide_no_nan(count, tf.add_n(list(self.unmasked_shares.values())))

    def total_loss(self) -> tf.Tensor:
        """The batch's loss: the micro-batches' weighted losses, summed."""
        total = tf.add_n(self.losses)
        correction = self._mask_correction()
        return total if correction is None else total * tf.cast(correction, total.dtype)

    def summed_gradients(self, variables: list) -> list[tuple[Any, Any]]:
        """Each variable's gradient summed over micro-batches, with the masked
        losses' correction applied on its stage's mesh."""
        correction = self._mask_correction()
        if correction is None:
            return [(self.gradients.get(id(v)), v) for v in variables]
        last = len(self.groups) - 1
        stage_of = {id(v): group.stage for group in self.groups for v in group.trainable_weights}
        on_stage = [
            move_to_stage(correction, self.meshes[last], self.meshes[stage], self.batch_axis)
            for stage in range(last)
        ] + [correction]
        return [
            (_scaled(self.gradients.get(id(v)), on_stage[stage_of[id(v)]]), v) for v in variables
        ]


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
    tied = value + tf.cast(zero, value.dtype)
    mask = get_keras_mask(value)
    if mask is not None:  # the stage's layers read it
        set_keras_mask(tied, mask)
    return tied


def _scaled(gradient: Any, factor: tf.Tensor) -> Any:
    """`gradient` times the scalar `factor`; a sparse gradient stays sparse."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


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
    parts_per_tensor = [
        _split_tensor(tensor, num_microbatches, mesh, batch_axis)
        for tensor in tf.nest.flatten(value)
    ]
    return [
        tf.nest.pack_sequence_as(value, [parts[i] for parts in parts_per_tensor])
        for i in range(num_microbatches)
    ]


def _split_tensor(
    tensor: tf.Tensor, num_microbatches: int, mesh: DeviceMesh, batch_axis: str | None
) -> list[tf.Tensor]:
    """`tensor`'s batch cut into `num_microbatches` equal parts on `mesh`."""
    # DTensor cannot split along a sharded dimension: gather the (small)
    # input batch first; each micro-batch is split over the batch axis again.
    whole = replicate(tensor, mesh.dtensor_mesh)
    size = whole.shape[0]
    if size is None:  # known only as the step runs
        size = tf.shape(whole)[0]
        whole = _tied(whole, _divisible_check(size, num_microbatches))
    elif size % num_microbatches:
        raise ValueError(indivisible_batch(size, num_microbatches))
    rows = size // num_microbatches
    rank = tensor.shape.rank
    parts = mesh.axis_size(batch_axis) if batch_axis in mesh.axis_names else 1
    if parts > 1 and isinstance(rows, int) and rows % parts == 0:
        layout = dtensor.Layout.batch_sharded(mesh.dtensor_mesh, batch_axis, rank)
    else:
        layout = dtensor.Layout.replicated(mesh.dtensor_mesh, rank)
    return [
        dtensor.relayout(replicate(whole[i * rows : (i + 1) * rows], mesh.dtensor_mesh), layout)
        for i in range(num_microbatches)
    ]


def _divisible_check(size: tf.Tensor, num_microbatches: int) -> tf.Tensor:
    """A zero that fails the step, with the ValueError's message, unless the
    batch's `size` divides by `num_microbatches`.

    The strategy checks every host batch before placing it
    (`PipelineStages.check_host_batch`), so this fails only for a batch the
    caller placed on the mesh, whose last rows would otherwise be dropped
    without a word. The micro-batches are tied to it, so that nothing
    computed from them runs before the check passes: DTensor drops control
    dependencies (and a `tf.debugging.assert_*` under
    `tf.control_dependencies` left DTensor unable to infer the micro-batches'
    shapes).
    """
    zero_if_divisible = tf.where(size % num_microbatches == 0, 0.0, float("nan"))
    return tf.debugging.check_numerics(zero_if_divisible, indivisible_batch(None, num_microbatches))


def _microbatch_rows(x: Any, num_microbatches: int) -> int | None:
    """The samples of each micro-batch, if known while tracing."""
    size = tf.nest.flatten(x)[0].shape[0]
    return None if size is None else size // num_microbatches


def _loss_reduction(model: keras.Model) -> str:
    """How the model's losses reduce a batch: "mean" (each divides by a
    count of values, so a micro-batch's loss counts for 1/m of the batch's)
    or "sum" (micro-batch losses add up to the batch's)."""
    reductions = {
        getattr(loss, "reduction", "sum_over_batch_size")
        for loss in tf.nest.flatten(model.loss)
        if loss is not None
    }
    if reductions <= {"sum_over_batch_size", "mean"}:
        return "mean"
    if reductions == {"sum"}:
        return "sum"
    raise ValueError(
        f"Pipeline model {model.name!r} has losses with reductions {sorted(reductions)}: "
        "a pipeline sums micro-batch losses, which is exact for "
        "'sum_over_batch_size' (the default), 'mean' and 'sum'. Use one of those."
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
