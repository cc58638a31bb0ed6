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

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import assert_weights_close, build_mlp, initial_weights, mesh, mlp_data, mlp_layout_map, summary_events

GLOBAL_BATCH_SIZE = 8
WEIGHTS = initial_weights(build_mlp)
DATA = mlp_data(37)


def tutorial_program(strategy, checkpoint_dir, build=build_mlp, epochs=2):
    """The tutorial's program: trains `epochs` epochs, saving a checkpoint
    after the first, then restores it into a new model and optimizer and
    trains one more epoch. Returns per-epoch losses, the metric, the final
    weights and the up kernel's sharding (None off the mesh)."""
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
    layout = getattr(model.get_layer("up").kernel.value, "layout", None)
    return losses, float(mae.result()), model.get_weights(), layout and layout.sharding_specs


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return tutorial_program(tf.distribute.get_strategy(), str(tmp_path_factory.mktemp("one")))


def assert_same_training(got, want):
    losses, metric, weights, _ = got
    np.testing.assert_allclose(losses, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metric, want[1], rtol=1e-5)
    assert_weights_close(want[2], weights)


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
    if callable(layout_map):
        layout_map = layout_map(device_mesh)
    got = tutorial_program(tfmp.ModelParallelStrategy(device_mesh, layout_map), str(tmp_path))
    assert_same_training(got, one_device)
    # The restored model trained with the ruled or planned layout, not replicated.
    assert got[3] == [dtensor.UNSHARDED, "model" if shape == (2, 4) else dtensor.UNSHARDED]


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
    assert_weights_close(want_weights, weights)
    assert sharding == [dtensor.UNSHARDED, "model"]


def reductions_probe(strategy) -> list[dict]:
    """Runs one step per batch of 13 rows in batches of 8 (8 and 5 rows) and
    reads its outputs back the ways the tutorial shows."""
    x = np.arange(13 * 3, dtype="float32").reshape(13, 3)
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH_SIZE)

    def step(batch):
        per_example = tf.reduce_sum(batch, axis=1)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH_SIZE)
        summed = tf.distribute.get_replica_context().all_reduce("SUM", loss)
        average = tf.nn.compute_average_loss(per_example)
        return batch * 2.0, loss, summed, average, tf.reduce_mean(per_example)

    @tf.function
    def distributed_step(batch):
        outputs, loss, summed, average, mean = strategy.run(step, args=(batch,))
        return (
            outputs,
            strategy.reduce("SUM", loss, axis=None),
            strategy.reduce("MEAN", summed, axis=None),
            strategy.reduce("SUM", average, axis=None),
            strategy.reduce("MEAN", mean, axis=None),
            strategy.reduce("MEAN", outputs, axis=0),
            strategy.reduce("SUM", outputs, axis=0),
        )

    results = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        outputs, loss, summed, average, mean, mean_rows, sum_rows = distributed_step(batch)
        local = [np.asarray(value) for value in strategy.experimental_local_results(outputs)]
        inputs = [np.asarray(value) for value in strategy.experimental_local_results(batch)]
        result = {
            "local_rows": [len(value) for value in local],
            "local": np.concatenate(local).tolist(),
            "inputs": np.concatenate(inputs).tolist(),
            "loss": float(loss),
            "all_reduced": float(summed),
            "mean_rows": np.asarray(mean_rows).tolist(),
            "sum_rows": np.asarray(sum_rows).tolist(),
        }
        if len(local[0]) == len(local[-1]):  # equal parts add up element by element
            # Without a global batch size, MirroredStrategy's replicas count
            # their own rows times the replicas, and a mean of replicas' means
            # weighs each part alike: the global mean for equal parts only.
            result["average"] = float(average)
            result["mean"] = float(mean)
            result["sum_of_parts"] = np.asarray(strategy.reduce("SUM", outputs, axis=None)).tolist()
        results.append(result)
    return results


def test_reductions_and_local_results_are_mirrored_strategys():
    # Reducing through one device: MirroredStrategy's collective ops and
    # DTensor's share group keys, and would clash in one process.
    mirrored = tf.distribute.MirroredStrategy(
        ["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    want = reductions_probe(mirrored)
    got = reductions_probe(tfmp.ModelParallelStrategy(mesh((2, 4))))
    assert [result["local_rows"] for result in got] == [[4, 4], [3, 2]]
    assert got == want


def in_function_epoch_program(strategy, closes_over_dataset):
    """The tutorial's variant that iterates the dataset inside a
    `tf.function`: two epochs of a shuffled dataset (a new order each epoch),
    with the dataset passed to the epoch function or closed over by it.
    Returns the epoch losses and the final weights."""
    GLOBAL = (GLOBAL_BATCH_SIZE // strategy.num_replicas_in_sync) * strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices(DATA).shuffle(37, seed=3).batch(GLOBAL)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    with strategy.scope():
        model = build_mlp()
        model.set_weights(WEIGHTS)
        optimizer = keras.optimizers.Adam(0.01)
    loss_object = keras.losses.MeanSquaredError(reduction=None)

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_object(labels, model(features, training=True)), global_batch_size=GLOBAL
            )
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    def train_epoch(dataset):
        total_loss, num_batches = 0.0, 0
        for x in dataset:
            per_replica_losses = strategy.run(train_step, args=(x,))
            total_loss += strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)
            num_batches += 1
        return total_loss / tf.cast(num_batches, tf.float32)

    if closes_over_dataset:
        distributed_train_epoch = tf.function(lambda: train_epoch(dist_dataset))
        losses = [float(distributed_train_epoch()) for _ in range(2)]
    else:
        distributed_train_epoch = tf.function(train_epoch)
        losses = [float(distributed_train_epoch(dist_dataset)) for _ in range(2)]
    return losses, model.get_weights()


@pytest.fixture(scope="module")
def one_device_in_function_epochs():
    return in_function_epoch_program(tf.distribute.get_strategy(), closes_over_dataset=False)


@pytest.mark.parametrize("closes_over_dataset", [False, True], ids=["argument", "closure"])
def test_an_epoch_iterated_inside_a_tf_function_trains_as_one_device(
    closes_over_dataset, one_device_in_function_epochs
):
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    losses, weights = in_function_epoch_program(strategy, closes_over_dataset)
    want_losses, want_weights = one_device_in_function_epochs
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_weights_close(want_weights, weights)


def test_an_epoch_in_a_tf_function_whose_batches_change_is_a_named_error():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)))
    epoch_rows = iter([16, 8])  # two batches while tracing, then one
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(np.ones((next(epoch_rows), 4), "float32")),
        output_signature=tf.TensorSpec((4,), tf.float32),
    ).batch(GLOBAL_BATCH_SIZE)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def epoch_sum():
        total = 0.0
        for batch in dist_dataset:
            total += strategy.reduce("SUM", strategy.run(tf.reduce_sum, args=(batch,)), axis=None)
        return total

    assert float(epoch_sum()) == 64.0
    with pytest.raises(ValueError, match=r"compiled for the batches of the epoch it was traced.*iterate it eagerly"):
        epoch_sum()


def test_auto_layout_of_a_model_not_built_before_the_first_step_is_a_named_error():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)), layout_map="auto")
    with strategy.scope():
        model = TwoLayers()
    with pytest.raises(ValueError, match=r"model 'mlp' at the first strategy.run.*must be built"):
        strategy.run(lambda x: model(x), args=(tf.zeros((8, 16)),))


def test_unmatched_rules_are_checked_at_the_first_step_not_when_data_is_distributed():
    device_mesh = mesh((2, 4))
    layout_map = mlp_layout_map(device_mesh)
    layout_map["renamed_layer/kernel"] = (None, "model")
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_dataset = strategy.experimental_distribute_dataset(  # before the model, as the tutorial
            tf.data.Dataset.from_tensor_slices(DATA).batch(GLOBAL_BATCH_SIZE)
        )
        assert not caught
        with strategy.scope():
            model = build_mlp()
        step = tf.function(lambda features: strategy.run(model, args=(features,)))
        for features, _ in dist_dataset:
            step(features)
    unmatched = [w for w in caught if "matched no variable" in str(w.message)]
    assert len(unmatched) == 1 and "['renamed_layer/kernel']" in str(unmatched[0].message)


def test_an_elementwise_reduce_of_parts_of_unequal_rows_is_a_named_error():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)))
    dataset = tf.data.Dataset.from_tensor_slices(DATA[0][:5]).batch(GLOBAL_BATCH_SIZE)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    assert dist_dataset.element_spec == iter(dist_dataset).element_spec == dataset.element_spec
    (batch,) = dist_dataset
    outputs = strategy.run(tf.identity, args=(batch,))
    with pytest.raises(ValueError, match=r"5 rows.*2 replicas.*Pass axis=0"):
        strategy.reduce("SUM", outputs, axis=None)
    np.testing.assert_allclose(strategy.reduce("SUM", outputs, axis=0), DATA[0][:5].sum(0), rtol=1e-6)


def summarized_program(strategy, logdir):
    """TensorFlow's "TensorBoard in a custom training loop": each step's loss
    and the split kernel's histogram, written with a writer that is dropped
    as the function returns (as Orbit and Keras drop theirs). Returns the
    losses, read only after the writer is gone, what the events file held
    after each step's flush, and what it holds at the end: {tag: [(step,
    value), ...]}."""
    dataset = tf.data.Dataset.from_tensor_slices(DATA).batch(GLOBAL_BATCH_SIZE)
    with strategy.scope():
        model = build_mlp()
        model.set_weights(WEIGHTS)
        optimizer = keras.optimizers.Adam(0.01)
    loss_object = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(batch):
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = loss_object(labels, model(features, training=True))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        return strategy.run(step, args=batch)

    def train():
        writer = tf.summary.create_file_writer(logdir)
        losses, flushed = [], []
        for batch in strategy.experimental_distribute_dataset(dataset):
            loss = train_step(batch)
            with writer.as_default(step=optimizer.iterations):
                tf.summary.scalar("loss", loss)
                tf.summary.histogram("up_kernel", model.get_layer("up").kernel)
            writer.flush()
            flushed.append({tag: len(values) for tag, values in summary_events(logdir).items()})
            losses.append(loss)
        return losses, flushed

    losses, flushed = train()
    return [float(loss) for loss in losses], flushed, summary_events(logdir)


def test_summaries_of_mesh_values_are_written_when_the_program_writes_them(tmp_path):
    """DTensor queues the mesh's eager ops, and a writer's flush and deletion
    run at once on the host: unless the values are fetched to the host
    writer first, a flush can miss the step's values, and a write still
    queued when the writer is dropped fails and poisons the losses read
    afterwards. The histogram of a split kernel is computed from its whole
    value, as on one device."""
    want_losses, _, want = summarized_program(tf.distribute.get_strategy(), str(tmp_path / "one"))
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    losses, flushed, got = summarized_program(strategy, str(tmp_path / "mesh"))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert flushed == [{"loss": step, "up_kernel": step} for step in range(1, 6)]
    assert sorted(got) == sorted(want) == ["loss", "up_kernel"]
    for tag in want:
        assert [step for step, _ in got[tag]] == [step for step, _ in want[tag]] == [1, 2, 3, 4, 5]
        for (_, value), (_, expected) in zip(got[tag], want[tag]):
            np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
