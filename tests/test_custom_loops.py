"""Custom training loops written for `tf.distribute` run unchanged on the mesh.

The programs follow TensorFlow's tutorial "Custom training with
tf.distribute.Strategy": a global batch of `BATCH_SIZE_PER_REPLICA *
strategy.num_replicas_in_sync`, `experimental_distribute_dataset`,
`compute_average_loss` in the replica function, `strategy.run` in a
`tf.function`, `strategy.reduce(SUM, ...)`, an Adam whose slots the first
`apply_gradients` makes inside the `tf.function`, a metric updated in the step
and a `CheckpointManager`. Each is compared with the same program on one
device (TensorFlow's default strategy) on the same global batch, which is what
MirroredStrategy computes; 37 samples make a last batch of 5 rows, which
divides by no batch axis here. The replica count and the reductions are
compared with MirroredStrategy itself (docs/custom-loops.md).
"""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import SEED, build_mlp, initial_weights, mesh, mlp_data, mlp_layout_map

GLOBAL_BATCH_SIZE = 8
WEIGHTS = initial_weights(build_mlp)
DATA = mlp_data(37)


def tutorial_program(strategy, checkpoint_dir, build=build_mlp, epochs=2):
    """The tutorial's program: trains `epochs` epochs, saving a checkpoint
    after the first, then restores it into a new model and optimizer and
    trains one more epoch. Returns per-epoch losses, the metric and the
    final weights."""
    BATCH_SIZE_PER_REPLICA = GLOBAL_BATCH_SIZE // strategy.num_replicas_in_sync
    GLOBAL = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices(DATA).batch(GLOBAL)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def make_state():
        with strategy.scope():
            model = build()
            model.set_weights(WEIGHTS)
            optimizer = keras.optimizers.Adam(0.01)
            mae = keras.metrics.MeanAbsoluteError()
        return model, optimizer, mae

    loss_object = keras.losses.MeanSquaredError(reduction=None)
    model, optimizer, mae = make_state()

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            loss = tf.nn.compute_average_loss(
                loss_object(labels, predictions), global_batch_size=GLOBAL
            )
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        mae.update_state(labels, predictions)
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    def train_epoch():
        total_loss, num_batches = 0.0, 0
        for batch in dist_dataset:
            total_loss += distributed_train_step(batch)
            num_batches += 1
        return float(total_loss / num_batches)

    losses = [train_epoch()]
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=optimizer), checkpoint_dir, max_to_keep=1
    )
    manager.save()
    # A new process would start here: new objects, restored, training on.
    model, optimizer, mae = make_state()
    with strategy.scope():
        # Keras 3 optimizers restore their slots only once they have them.
        optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    losses += [train_epoch() for _ in range(epochs - 1)]
    return losses, float(mae.result()), [np.asarray(w) for w in model.get_weights()]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return tutorial_program(tf.distribute.get_strategy(), str(tmp_path_factory.mktemp("one")))


def assert_same_training(got, want):
    losses, metric, weights = got
    np.testing.assert_allclose(losses, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metric, want[1], rtol=1e-5)
    for w, reference in zip(weights, want[2], strict=True):
        np.testing.assert_allclose(w, reference, rtol=1e-5, atol=1e-5)


def test_num_replicas_in_sync_counts_the_batch_axis_as_mirrored_strategy_does():
    mirrored = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(8)])
    strategy = tfmp.ModelParallelStrategy(mesh((8, 1)))
    assert strategy.num_replicas_in_sync == mirrored.num_replicas_in_sync == 8
    assert tfmp.ModelParallelStrategy(mesh((2, 4))).num_replicas_in_sync == 2
    assert tfmp.ModelParallelStrategy(mesh((2, 4)), batch_axis=None).num_replicas_in_sync == 1
    # In the step, one replica holds the global batch: compute_average_loss
    # without a global batch size divides by the rows it sees.
    seen = strategy.run(lambda: tf.constant(tf.distribute.get_replica_context().num_replicas_in_sync))
    assert int(seen) == 1
    with strategy.scope():
        assert strategy.num_replicas_in_sync == 8


@pytest.mark.parametrize(
    "shape, layout_map",
    [((8, 1), None), ((2, 4), mlp_layout_map), ((2, 4), "auto")],
    ids=["8x1", "2x4-rules", "2x4-auto"],
)
def test_tutorial_program_trains_as_one_device(shape, layout_map, one_device, tmp_path):
    device_mesh = mesh(shape)
    strategy = tfmp.ModelParallelStrategy(
        device_mesh, layout_map if isinstance(layout_map, str) or layout_map is None else layout_map(device_mesh)
    )
    got = tutorial_program(strategy, str(tmp_path))
    assert_same_training(got, one_device)
    if shape == (2, 4):  # the planned or ruled layout, not silently replicated
        with strategy.scope():
            model = build_mlp()
        strategy.run(lambda: model(tf.zeros((8, 16))))
        assert model.get_layer("up").kernel.value.layout.sharding_specs == [dtensor.UNSHARDED, "model"]


class TwoLayers(keras.Model):
    """A subclassed model, built by its first call (in the step); seeded
    initializers give it the same weights on one device and on the mesh."""

    def __init__(self):
        super().__init__(name="mlp")
        glorot = keras.initializers.GlorotUniform
        self.up = keras.layers.Dense(32, "relu", kernel_initializer=glorot(1), name="up")
        self.down = keras.layers.Dense(8, kernel_initializer=glorot(2), name="down")

    def call(self, x):
        return self.down(self.up(x))


def lazy_program(strategy):
    """Two epochs of the tutorial's loop with a model and an optimizer that
    both make their variables in the first traced step. Returns the epoch
    losses, the weights and the up kernel's sharding."""
    GLOBAL = (GLOBAL_BATCH_SIZE // strategy.num_replicas_in_sync) * strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices(DATA).batch(GLOBAL)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    with strategy.scope():
        model = TwoLayers()
        optimizer = keras.optimizers.Adam(0.01)

    def train_step(features, labels):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(features) - labels), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(features, labels):
        losses = strategy.run(train_step, args=(features, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    epoch_losses = []
    for _ in range(2):
        iterator = iter(dist_dataset)  # iter()/next(), as the tutorial also shows
        total, batches = 0.0, 0
        while (optional := iterator.get_next_as_optional()).has_value():
            total += distributed_train_step(*optional.get_value())
            batches += 1
        epoch_losses.append(float(total / batches))
    layout = getattr(model.up.kernel.value, "layout", None)
    return epoch_losses, model.get_weights(), layout and layout.sharding_specs


def test_subclassed_model_built_in_the_step_trains_as_one_device():
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    losses, weights, sharding = lazy_program(strategy)
    want_losses, want_weights, _ = lazy_program(tf.distribute.get_strategy())
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    for w, reference in zip(weights, want_weights, strict=True):
        np.testing.assert_allclose(w, reference, rtol=1e-5, atol=1e-5)
    assert sharding == [dtensor.UNSHARDED, "model"]
