"""Batches read inside a `tf.function`, as TensorFlow's multi-step loops read them.

The programs are the loops of TensorFlow's distributed-training guides:
`next(iterator)` in a `for _ in tf.range(steps)` loop, a `tf.range` loop over
`get_next_as_optional()` that breaks when `has_value()` is False, and `for
batch in dist_dataset` in a `tf.function` epoch. Each trains an MLP with
Adam on a shuffled dataset of 37 samples at a global batch of 8 and is
compared with the same program on one device (TensorFlow's default strategy,
MirroredStrategy's numbers), from the same initial weights, to 1e-5.

Inside a graph loop DTensor compiles the step for one batch shape, so the
`tf.range` loops batch with `drop_remainder=True` (4 batches; the 5 rows left
over are dropped on one device too), and a partial last batch is a named
error (docs/custom-loops.md). The `for` loop over the dataset is unrolled
per batch and keeps the partial last batch.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import assert_weights_close, build_mlp, initial_weights, mesh, mlp_data, mlp_layout_map

GLOBAL_BATCH_SIZE = 8
WEIGHTS = initial_weights(build_mlp)
DATA = mlp_data(37)


def multi_step_program(strategy, loop, drop_remainder=True, epochs=2):
    """Trains `epochs` epochs, each from a new iterator, with one call of a
    compiled multi-step `loop` ("range", "optional" or "for") per epoch.
    Returns the epoch losses, the metric and the weights."""
    BATCH_SIZE_PER_REPLICA = GLOBAL_BATCH_SIZE // strategy.num_replicas_in_sync
    GLOBAL = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices(DATA).shuffle(37, seed=3)
    dataset = dataset.batch(GLOBAL, drop_remainder=drop_remainder)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    steps_per_epoch = len(DATA[0]) // GLOBAL

    with strategy.scope():
        model = build_mlp()
        model.set_weights(WEIGHTS)
        optimizer = keras.optimizers.Adam(0.01)
        mae = keras.metrics.MeanAbsoluteError()
    loss_object = keras.losses.MeanSquaredError(reduction=None)

    def step_fn(inputs):
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
    def train_multiple_steps(iterator, steps):
        total_loss = 0.0
        for _ in tf.range(steps):
            per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
            total_loss += strategy.reduce("SUM", per_replica_losses, axis=None)
        return total_loss

    @tf.function
    def train_until_the_end(iterator):
        total_loss = 0.0
        for _ in tf.range(steps_per_epoch + 1):
            optional_data = iterator.get_next_as_optional()
            if not optional_data.has_value():
                break
            per_replica_losses = strategy.run(step_fn, args=(optional_data.get_value(),))
            total_loss += strategy.reduce("SUM", per_replica_losses, axis=None)
        return total_loss

    @tf.function
    def train_epoch(dataset):
        total_loss = 0.0
        for batch in dataset:
            per_replica_losses = strategy.run(step_fn, args=(batch,))
            total_loss += strategy.reduce("SUM", per_replica_losses, axis=None)
        return total_loss

    losses = []
    for _ in range(epochs):
        if loop == "range":
            loss = train_multiple_steps(iter(dist_dataset), tf.constant(steps_per_epoch))
        elif loop == "optional":
            loss = train_until_the_end(iter(dist_dataset))
        else:
            loss = train_epoch(dist_dataset)
        losses.append(float(loss))
    return losses, float(mae.result()), model.get_weights()


@pytest.fixture(scope="module")
def one_device():
    results = {}

    def run(loop):
        if loop not in results:
            results[loop] = multi_step_program(tf.distribute.get_strategy(), loop, loop != "for")
        return results[loop]

    return run


def assert_same_training(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    assert_weights_close(want[2], got[2])


def strategy_for(shape, layout_map_fn):
    device_mesh = mesh(shape)
    return tfmp.ModelParallelStrategy(device_mesh, layout_map_fn and layout_map_fn(device_mesh))


@pytest.mark.parametrize(
    "shape, layout_map_fn, loop",
    [((2, 4), mlp_layout_map, "range"), ((8, 1), None, "range"),
     ((2, 4), mlp_layout_map, "optional"), ((8, 1), None, "optional"), ((8, 1), None, "for")],
    ids=["2x4-range", "8x1-range", "2x4-optional", "8x1-optional", "8x1-for"],
)
def test_a_multi_step_loop_in_a_tf_function_trains_as_one_device(shape, layout_map_fn, loop, one_device):
    # The for loop over the dataset on 2x4: tests/test_custom_loops.py.
    got = multi_step_program(strategy_for(shape, layout_map_fn), loop, loop != "for")
    assert_same_training(got, one_device(loop))


def sum_of_features(strategy, dataset, steps):
    """`steps` reads of `next(iterator)` in a compiled `tf.range` loop, each
    batch's features summed in `strategy.run`."""
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def sum_steps(iterator):
        total = 0.0
        for _ in tf.range(steps):
            features, _ = next(iterator)
            total += strategy.reduce("SUM", strategy.run(tf.reduce_sum, args=(features,)), axis=None)
        return total

    return float(sum_steps(iterator))


def test_a_partial_last_batch_in_a_graph_loop_is_a_named_error():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)))
    dataset = tf.data.Dataset.from_tensor_slices(DATA).batch(GLOBAL_BATCH_SIZE)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"other shapes than the first batch.*drop_remainder=True"):
        sum_of_features(strategy, dataset, 5)


def test_next_past_the_last_batch_in_a_graph_loop_is_a_named_error():
    strategy = tfmp.ModelParallelStrategy(mesh((8, 1)))
    dataset = tf.data.Dataset.from_tensor_slices(DATA).batch(GLOBAL_BATCH_SIZE, drop_remainder=True)
    total = sum_of_features(strategy, dataset, 4)
    np.testing.assert_allclose(total, DATA[0][:32].sum(), rtol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"past its last batch.*get_next_as_optional"):
        sum_of_features(strategy, dataset, 5)


def test_an_iterator_read_eagerly_then_in_a_graph_is_a_named_error():
    strategy = tfmp.ModelParallelStrategy(mesh((8, 1)))
    dataset = tf.data.Dataset.from_tensor_slices(DATA[0]).batch(GLOBAL_BATCH_SIZE)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    next(iterator)
    with pytest.raises(RuntimeError, match=r"already read eagerly.*new iterator with iter\(\)"):
        tf.function(lambda: next(iterator))()


def test_next_in_a_graph_with_several_clients_is_refused_by_name(monkeypatch):
    strategy = tfmp.ModelParallelStrategy(mesh((8, 1)))
    dataset = tf.data.Dataset.from_tensor_slices(DATA[0]).batch(GLOBAL_BATCH_SIZE)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    monkeypatch.setattr(dtensor, "num_clients", lambda: 2)
    with pytest.raises(ValueError, match=r"not supported with several DTensor clients.*outside the tf.function"):
        tf.function(lambda: next(iterator))()


def test_fit_with_steps_per_execution_runs_its_steps_in_a_loop_as_one_device(monkeypatch):
    """`steps_per_execution=4` on 37 samples at batch 8: each epoch is one
    call of 4 batches of the same shapes, whose last 3 steps run in a
    `tf.while_loop`, then one call of the partial batch of 5 rows."""
    from tfmp.strategy import steps_per_call

    same_layouts = steps_per_call._same_layouts
    looped = []
    monkeypatch.setattr(
        steps_per_call, "_same_layouts", lambda batches: looped.append(same_layouts(batches)) or looped[-1]
    )
    x, y = DATA
    histories, weights = [], []
    for strategy in (None, strategy_for((2, 4), mlp_layout_map)):
        with (strategy or tf.distribute.get_strategy()).scope():
            model = build_mlp()
            model.set_weights(WEIGHTS)
            model.compile(
                optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], steps_per_execution=4
            )
        histories.append(model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history)
        weights.append(model.get_weights())
    assert looped == [True, True]  # the partial batch's calls hold one batch
    for key in ("loss", "mae"):
        np.testing.assert_allclose(histories[1][key], histories[0][key], rtol=1e-5)
    assert_weights_close(weights[0], weights[1])
