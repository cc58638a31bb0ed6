"""Each step reads the rows one device reads: same elements, same order, same count.

Under any tf.distribute strategy Keras reads a batch to build the model and
opens the epoch again; tfmp's iterators also read ahead. A shuffle then
started another pass, a generator lost a batch, a `tf.random.Generator` in a
`map` drew other values, so the first epoch trained on other rows than on one
device (32 elements per epoch of `range(32).shuffle(32).batch(8)` read 96
times). Each test runs the same program on one device and on a mesh, the
data made afresh for each from the same seeds, and compares what the input
pipeline was asked for (a log its elements write as they are read) and what
training made of it (per-step losses, the History with validation, weights).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import SEED, BatchLosses, assert_weights_close, rules, run_in_fresh_process, strategy_on
from tfmp.strategy.graph_input import without_autotune

ROWS = 37  # batches of 8: the last has 5 rows, which a batch axis of 2 does not split
BATCH = 8


def dense_model() -> keras.Model:
    return keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, name="out")])


def features(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    x = tf.reshape(tf.cast(i, tf.float32) / ROWS, (1,))
    return x, 2 * x + 1


def logged(reads: list, dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` of ids, each appended to `reads` as the pipeline reads it."""

    def record(i):
        reads.append(int(i))
        return i

    return dataset.map(lambda i: tf.py_function(record, [i], tf.int64))


def shuffled_with_uniform_noise(reads: dict) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """A seeded shuffle, reshuffled every pass, then noise from a stateful op."""
    def noisy(i):
        x, y = features(i)
        return x + tf.random.uniform((1,), maxval=0.1), y

    train = logged(reads["train"], tf.data.Dataset.range(ROWS).shuffle(ROWS, seed=0)).map(noisy)
    val = logged(reads["val"], tf.data.Dataset.range(100, 100 + ROWS)).map(features)
    return train.batch(BATCH), val.batch(BATCH)


def fixed_shuffle_with_generator_noise(reads: dict) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """An unseeded shuffle kept over passes; noise from a `tf.random.Generator`,
    whose state every read moves on (an extra read changes later draws), and
    from a stateless op seeded by the element."""
    generator = tf.random.Generator.from_seed(SEED)

    def noisy(i):
        x, y = features(i)
        stateless = tf.random.stateless_uniform((1,), seed=tf.stack([i, i]), maxval=0.1)
        return x + generator.uniform((1,), maxval=0.1) + stateless, y

    shuffled = tf.data.Dataset.range(ROWS).shuffle(16, reshuffle_each_iteration=False)
    val = logged(reads["val"], tf.data.Dataset.range(100, 100 + ROWS).shuffle(ROWS)).map(noisy)
    return logged(reads["train"], shuffled).map(noisy).batch(BATCH), val.batch(BATCH)


def repeated_with_random_flip(reads: dict) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """`repeat()` read `steps_per_epoch` batches at a time (the passes run
    across epochs), through a Keras `RandomFlip` layer in the pipeline."""
    flip = keras.layers.RandomFlip("horizontal", seed=SEED)

    def flipped(i):
        x, y = features(i)
        image = tf.reshape(tf.concat([x, 1 - x], 0), (1, 2, 1))
        return tf.reshape(flip(image, training=True)[0, 0], (1,)), y

    train = logged(reads["train"], tf.data.Dataset.range(ROWS).shuffle(ROWS, seed=1)).map(flipped)
    val = logged(reads["val"], tf.data.Dataset.range(100, 100 + ROWS)).map(features)
    return train.batch(BATCH).repeat(), val.batch(BATCH).repeat()


def logging_generator(reads: list, start: int):
    """An endless Python generator of batches that logs each it yields."""
    rng = np.random.default_rng(start)
    while True:
        ids = rng.integers(0, ROWS, size=BATCH)
        reads.extend(int(i) + start for i in ids)
        x = (ids[:, None] / ROWS).astype("float32")
        yield x, 2 * x + 1


class LoggingPyDataset(keras.utils.PyDataset):
    """Batches of a reshuffled index, logging each batch asked for and each
    epoch's end (where PyDatasets reshuffle)."""

    def __init__(self, reads: list, start: int, **kwargs):
        super().__init__(**kwargs)
        self.reads, self.start = reads, start
        self.order = np.arange(ROWS)
        self.rng = np.random.default_rng(start)

    def __len__(self):
        return -(-ROWS // BATCH)

    def __getitem__(self, index):
        ids = self.order[index * BATCH : (index + 1) * BATCH]
        self.reads.append((self.start, int(index)))
        x = (ids[:, None] / ROWS).astype("float32")
        return x, 2 * x + 1

    def on_epoch_end(self):
        self.reads.append((self.start, "end"))
        self.order = self.rng.permutation(ROWS)


def numpy_arrays(reads: dict):
    del reads  # Keras slices arrays itself: nothing to log
    ids = np.arange(ROWS)
    x = (ids[:, None] / ROWS).astype("float32")
    return (x, 2 * x + 1), (x[::-1].copy(), 2 * x[::-1] + 1)


# name: (mesh, makes (train, validation) data, fit arguments, how the reads
# compare: "in order", "in any order" (PyDataset workers read concurrently),
# "in order as far as both read" (Keras prefetches a generator's batches, as
# many past the last step as the timing lets it, on one device too), or None
# (Keras shuffles arrays itself: the steps' losses say which rows).
CASES = {
    "numpy, shuffled by Keras": ((8, 1), numpy_arrays, {"batch_size": BATCH}, None),
    "tf.data, seeded shuffle, tf.random.uniform": ((2, 4), shuffled_with_uniform_noise, {}, "in order"),
    "tf.data, fixed shuffle, tf.random.Generator and stateless": (
        (8, 1), fixed_shuffle_with_generator_noise, {}, True,
    ),
    "tf.data, repeat and steps_per_epoch, RandomFlip": (
        (2, 4), repeated_with_random_flip, {"steps_per_epoch": 3, "validation_steps": 2}, True,
    ),
    "generator, steps_per_epoch": (
        (8, 1),
        lambda reads: (logging_generator(reads["train"], 0), logging_generator(reads["val"], 1000)),
        {"steps_per_epoch": 3, "validation_steps": 2},
        "in order as far as both read",
    ),
    "PyDataset, 2 worker threads": (
        (2, 4),
        lambda reads: (
            LoggingPyDataset(reads["train"], 0, workers=2),
            LoggingPyDataset(reads["val"], 1000, workers=2),
        ),
        {},
        "in any order",
    ),
    "PyDataset, no workers": (
        (8, 1),
        lambda reads: (LoggingPyDataset(reads["train"], 0), LoggingPyDataset(reads["val"], 1000)),
        {},
        "in order",
    ),
}


def fit_logged(strategy, make_data, fit_kwargs):
    """Fits a linear model for 2 epochs with validation, from fixed weights
    and seeds; returns the reads, per-step losses, History and weights."""
    reads = {"train": [], "val": []}
    keras.utils.set_random_seed(SEED)
    train, val = make_data(reads)
    if isinstance(train, tuple):
        (x, y), val = train, val
        train, fit_kwargs = x, {**fit_kwargs, "y": y}
    with (strategy or tf.distribute.get_strategy()).scope():
        model = dense_model()
        model.set_weights([np.array([[0.5]], "float32"), np.array([0.0], "float32")])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    recorder = BatchLosses()
    history = model.fit(
        train, validation_data=val, epochs=2, verbose=0, callbacks=[recorder], **fit_kwargs
    )
    return reads, recorder.losses, history.history, model.get_weights()


@pytest.mark.parametrize("case", CASES)
def test_fit_with_validation_reads_what_one_device_reads(case):
    mesh_shape, make_data, fit_kwargs, reads_compared = CASES[case]
    want_reads, want_losses, want_history, want_weights = fit_logged(None, make_data, fit_kwargs)
    reads, losses, history, weights = fit_logged(strategy_on(mesh_shape), make_data, fit_kwargs)
    for source in ("train", "val"):
        want, got = want_reads[source], reads[source]
        if reads_compared == "in order":
            assert want and got == want, source
        elif reads_compared == "in order as far as both read":
            # Training steps take 6 batches; each validation pass begins again
            # with the 2 batches Keras peeked to learn the generator's shapes.
            stepped = {"train": 2 * 3, "val": 2}[source] * BATCH
            assert min(len(got), len(want)) >= stepped, source
            assert got[: len(want)] == want[: len(got)], source
        elif reads_compared == "in any order":  # each batch once, epochs end alike
            assert want and sorted(map(str, got)) == sorted(map(str, want)), source
            assert [r for r in got if r[1] == "end"] == [r for r in want if r[1] == "end"], source
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert history.keys() == want_history.keys() and "val_loss" in history
    for key, values in want_history.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5, err_msg=key)
    assert_weights_close(want_weights, weights)


def fit_with_forked_readers() -> None:
    """One device against 2x4 with PyDataset reading in forked processes.

    The readers' log stays in them; the steps' losses say which rows each step
    trained on."""
    def make_data(reads):
        return (
            LoggingPyDataset(reads["train"], 0, workers=2, use_multiprocessing=True),
            LoggingPyDataset(reads["val"], 1000, workers=2, use_multiprocessing=True),
        )

    _, want_losses, want_history, want_weights = fit_logged(None, make_data, {})
    _, losses, history, weights = fit_logged(strategy_on((2, 4)), make_data, {})
    assert len(losses) == 2 * 5
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(history["val_loss"], want_history["val_loss"], rtol=1e-5)
    assert_weights_close(want_weights, weights)


def test_pydataset_with_multiprocessing_trains_on_one_devices_batches():
    """Runs in a process of its own. Forked from a test process that had run
    hundreds of tests, 7 of Keras' 8 readers hung (in a futex wait) after
    the test and lived on, holding that process's pipes to pytest; forked
    from a young process, as from a user's program, they exit."""
    finished = run_in_fresh_process(
        "import conftest, test_data_order; test_data_order.fit_with_forked_readers()"
    )
    assert finished.returncode == 0, finished.stderr[-3000:]


def test_evaluate_and_predict_read_each_element_once_in_order():
    def run(strategy):
        reads = {"train": [], "val": []}
        keras.utils.set_random_seed(SEED)
        dataset, _ = shuffled_with_uniform_noise(reads)
        with (strategy or tf.distribute.get_strategy()).scope():
            model = dense_model()
            model.set_weights([np.array([[0.5]], "float32"), np.array([0.0], "float32")])
            model.compile("sgd", "mse")
        loss = model.evaluate(dataset, verbose=0)
        predictions = model.predict(dataset.map(lambda x, y: x), verbose=0)
        return reads, loss, predictions

    want_reads, want_loss, want_predictions = run(None)
    reads, loss, predictions = run(strategy_on((2, 4)))
    assert len(want_reads["train"]) == 2 * ROWS
    assert reads == want_reads
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(predictions, want_predictions, rtol=1e-5)


def image_mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu", name="up"),
            keras.layers.Dense(4, name="head"),
        ]
    )


MLP_RULES = rules({"up/kernel": (None, "model"), "up/bias": ("model",), "head/kernel": ("model", None)})


def augmented_images():
    """An image pipeline as the Keras augmentation tutorials write it: shuffle,
    batch, a random flip layer and Gaussian noise from a seeded generator."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(ROWS, 6, 6, 3)).astype("float32")
    labels = rng.integers(0, 4, size=ROWS)
    flip = keras.layers.RandomFlip("horizontal", seed=SEED)
    noise = tf.random.Generator.from_seed(SEED)

    def augment(x, y):
        x = flip(x, training=True)
        return x + noise.normal(tf.shape(x), stddev=0.1), y

    train = (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .shuffle(ROWS, seed=0)
        .batch(BATCH)
        .map(augment)
    )
    val = tf.data.Dataset.from_tensor_slices((images[:20], labels[:20])).batch(BATCH)
    return train, val


class ShuffledBatches(keras.utils.PyDataset):
    """A PyDataset as the Keras docs write one: batches of an index it
    reshuffles at each epoch's end."""

    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y
        self.rng = np.random.default_rng(SEED)
        self.order = np.arange(len(x))

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, index):
        ids = self.order[index * BATCH : (index + 1) * BATCH]
        return self.x[ids], self.y[ids]

    def on_epoch_end(self):
        self.order = self.rng.permutation(len(self.x))


def mlp_batches():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 16)).astype("float32")
    y = rng.normal(size=(ROWS, 8)).astype("float32")
    return ShuffledBatches(x, y, workers=2), ShuffledBatches(x[:20], y[:20])


def train_program(strategy, build, loss, make_data):
    """The program: build and compile (in the strategy's scope when there is
    one), fit 2 epochs with validation data."""
    keras.utils.set_random_seed(SEED)
    weights = build().get_weights()
    keras.utils.set_random_seed(SEED)
    train, val = make_data()
    with (strategy or tf.distribute.get_strategy()).scope():
        model = build()
        model.set_weights(weights)
        model.compile(keras.optimizers.Adam(0.01), loss)
    recorder = BatchLosses()
    history = model.fit(train, validation_data=val, epochs=2, verbose=0, callbacks=[recorder])
    return recorder.losses, history.history, model.get_weights()


@pytest.mark.parametrize(
    "build, layout_map_fn, loss, make_data",
    [
        pytest.param(
            image_mlp,
            MLP_RULES,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            augmented_images,
            id="shuffled and augmented tf.data",
        ),
        pytest.param(
            lambda: keras.Sequential(
                [keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="up"),
                 keras.layers.Dense(8, name="down")]
            ),
            rules({"up/kernel": (None, "model"), "up/bias": ("model",), "down/kernel": ("model", None)}),
            "mse",
            mlp_batches,
            id="reshuffled PyDataset",
        ),
    ],
)
def test_program_on_2x4_trains_like_one_device(build, layout_map_fn, loss, make_data):
    """37 rows at batch 8: the last batch's 5 rows do not split over the
    batch axis of 2. Adam from the same weights; losses, History and weights
    agree to 1e-5."""
    want_losses, want_history, want_weights = train_program(None, build, loss, make_data)
    strategy = strategy_on((2, 4), layout_map_fn)
    losses, history, weights = train_program(strategy, build, loss, make_data)
    assert len(losses) == 2 * 5
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert history.keys() == want_history.keys()
    for key, values in want_history.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    assert_weights_close(want_weights, weights)


def test_host_pipeline_reads_without_autotuning_unless_its_options_say():
    """tfmp's host iterator closes at once at the end of `fit`: with
    tf.data's autotuning on it took 0.2-2.6 s (docs/performance.md), so the
    pipeline tfmp reads runs with it off, unless the user's options set it."""
    dataset = tf.data.Dataset.range(ROWS).map(features, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH)
    untuned = without_autotune(dataset)
    assert untuned.options().autotune.enabled is False
    assert [x.numpy().tolist() for x, _ in untuned] == [x.numpy().tolist() for x, _ in dataset]
    for enabled in (True, False):
        options = tf.data.Options()
        options.autotune.enabled = enabled
        chosen = dataset.with_options(options)
        assert without_autotune(chosen).options().autotune.enabled is enabled
