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
error (docs/custom-loops.md). The `for` loop over the dataset runs through
the dataset's `reduce`, as under MirroredStrategy: the full batches in one
`tf.while_loop`, then the partial last batch, which it keeps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import assert_weights_close, build_mlp, initial_weights, layouts_made, mesh, mlp_data, mlp_layout_map

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


def test_a_graph_loops_iterators_read_without_tf_data_autotuning():
    """Each device's iterator of a graph loop reads its shard from the
    multi-device iterator when the step asks, with no prefetch and no
    tf.data autotuning of its own, as do the host pipeline (unless its
    options set it) and tfmp's part of it. Closing an iterator waits for its
    autotuning thread: with them, one Python garbage collection after this
    file's first two tests held the main thread 79 s alone and 192 s with
    the cores loaded (docs/custom-loops.md)."""
    strategy = tfmp.ModelParallelStrategy(mesh((8, 1)))
    dataset = tf.data.Dataset.from_tensor_slices(DATA[0]).batch(GLOBAL_BATCH_SIZE, drop_remainder=True)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    first = tf.function(lambda: strategy.run(tf.reduce_sum, args=(next(iterator),)))()
    np.testing.assert_allclose(strategy.reduce("SUM", first, axis=None), DATA[0][:8].sum(), rtol=1e-5)
    assert iterator._host_iterator._dataset.options().autotune.enabled is False  # noqa: SLF001
    _, device_iterators = iterator._graph_batches._iterators  # noqa: SLF001
    assert len(device_iterators) == 8
    for device_iterator in device_iterators:
        device_dataset = device_iterator._dataset  # noqa: SLF001
        assert device_dataset.options().autotune.enabled is False
        assert type(device_dataset._input_dataset).__name__ == "_ReincarnatedPerDeviceGenerator"  # noqa: SLF001


def test_fit_with_steps_per_execution_runs_its_steps_in_a_loop_as_one_device(monkeypatch):
    """`steps_per_execution=4` on 37 samples at batch 8: each epoch is one
    call of 4 batches of the same shapes, whose last 3 steps run in a
    `tf.while_loop`, then one call of the partial batch of 5 rows."""
    from tfmp.strategy import stacked_batches

    same_layouts = stacked_batches.same_layouts
    looped = []
    monkeypatch.setattr(
        stacked_batches, "same_layouts", lambda batches: looped.append(same_layouts(batches)) or looped[-1]
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


def position_weighted_sum(strategy, traces):
    """A `reduce_fn` over batches of `Dataset.range` rows: the state is
    (rows so far, the sum of each row's value times its place in the epoch
    counted from 1), which tells the rows' order. Each trace of the step
    appends its batch's shape to `traces`."""

    def step(batch, offset):
        traces.append(batch.shape)
        places = tf.cast(offset, tf.int64) + tf.range(1, batch.shape[0] + 1, dtype=tf.int64)
        return tf.reduce_sum(batch * places)

    def add(state, batch):
        rows, total = state
        weighted = strategy.run(step, args=(batch, rows))
        return rows + batch.shape[0], total + strategy.reduce("SUM", weighted, axis=None)

    return add


def host_weighted_sum(epoch) -> int:
    values = np.concatenate([np.asarray(batch) for batch in epoch])
    return int((values * np.arange(1, len(values) + 1)).sum())


@pytest.mark.parametrize("rows", [37, 101], ids=["5-batches", "13-batches"])
@pytest.mark.parametrize("through", ["for", "reduce"])
def test_a_compiled_epoch_traces_its_step_for_the_full_batches_and_the_partial_one(rows, through):
    """The epoch's full batches run in one loop, the partial last batch on
    its own after them: two traces of the step however many batches, and
    every row read once, in order."""
    strategy = strategy_for((2, 4), None)
    dataset = tf.data.Dataset.range(rows).batch(GLOBAL_BATCH_SIZE)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    traces = []
    add = position_weighted_sum(strategy, traces)

    @tf.function
    def epoch():
        state = (tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        if through == "reduce":
            return dist_dataset.reduce(state, add)
        for batch in dist_dataset:
            state = add(state, batch)
        return state

    counted, total = epoch()
    assert int(counted) == rows
    assert int(total) == host_weighted_sum(dataset)
    assert traces == [tf.TensorShape([GLOBAL_BATCH_SIZE]), tf.TensorShape([rows % GLOBAL_BATCH_SIZE])]


def test_a_for_loop_over_an_iterator_in_a_tf_function_is_one_graph_loop():
    """`for batch in iterator` (an iterator of a distributed dataset passed
    to the function) runs as a `tf.while_loop` over `get_next_as_optional()`,
    as for MirroredStrategy's iterators: one trace; it used to trace forever."""
    strategy = strategy_for((2, 4), None)
    dataset = tf.data.Dataset.range(40).batch(GLOBAL_BATCH_SIZE, drop_remainder=True)
    traces = []
    add = position_weighted_sum(strategy, traces)

    @tf.function
    def epoch(iterator):
        state = (tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        for batch in iterator:
            state = add(state, batch)
        return state

    counted, total = epoch(iter(strategy.experimental_distribute_dataset(dataset)))
    assert (int(counted), int(total)) == (40, host_weighted_sum(dataset))
    assert traces == [tf.TensorShape([GLOBAL_BATCH_SIZE])]


def test_reduce_eagerly_gives_what_it_gives_in_a_graph():
    strategy = strategy_for((8, 1), None)
    dataset = tf.data.Dataset.range(37).batch(GLOBAL_BATCH_SIZE)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    add = position_weighted_sum(strategy, [])
    eager = dist_dataset.reduce((0, 0), add)
    traced = tf.function(lambda: dist_dataset.reduce((0, tf.constant(0, tf.int64)), add))()
    assert [int(value) for value in eager] == [int(value) for value in traced] == [37, host_weighted_sum(dataset)]


def test_later_calls_of_a_shuffled_compiled_epoch_read_new_epochs_and_lay_out_nothing():
    """Each call reads the next epoch of the reshuffled dataset, in order.
    The partial last batch (5 int64 values, replicated) is new each call:
    DTensor would fold it as a constant and lay the function out again, so
    it reaches the function in a dtype DTensor does not fold
    (`tfmp.strategy.small_batch_values`). The second and third calls lay
    out nothing."""

    def shuffled():
        return tf.data.Dataset.range(37).shuffle(37, seed=3).batch(GLOBAL_BATCH_SIZE)

    host = shuffled()
    want = [host_weighted_sum(host) for _ in range(3)]
    strategy = strategy_for((2, 4), None)
    dist_dataset = strategy.experimental_distribute_dataset(shuffled())
    traces = []
    add = position_weighted_sum(strategy, traces)
    epoch = tf.function(lambda: dist_dataset.reduce((tf.constant(0, tf.int64), tf.constant(0, tf.int64)), add))
    got, laid_out = [], []
    for _ in range(3):
        before = layouts_made()
        got.append(int(epoch()[1]))
        laid_out.append(layouts_made() - before)
    assert got == want
    assert len(set(want)) == 3  # every epoch in another order
    assert laid_out[0] > 0 and laid_out[1:] == [0, 0]
    assert len(traces) == 2


def test_break_in_a_for_loop_over_a_distributed_dataset_in_a_tf_function_is_autographs_error():
    """As under MirroredStrategy: AutoGraph runs the loop through `reduce`."""
    strategy = strategy_for((8, 1), None)
    dist_dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.range(16).batch(GLOBAL_BATCH_SIZE))

    @tf.function
    def first_batch_sum():
        total = tf.constant(0, tf.int64)
        for batch in dist_dataset:
            total += strategy.reduce("SUM", strategy.run(tf.reduce_sum, args=(batch,)), axis=None)
            break
        return total

    with pytest.raises(NotImplementedError, match="break and return statements are not yet supported"):
        first_batch_sum()
