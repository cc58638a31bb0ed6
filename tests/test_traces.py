"""Epochs after the first trace nothing and lay out nothing, as plain Keras.

Two tutorial programs, each on one device and on a mesh: a convnet fit on
arrays with `validation_split` (2x4, `layout_map="auto"`), and a
bidirectional LSTM over padded, masked sequences of 2 to 5 tokens fit on a
`PyDataset` that reshuffles every epoch, with validation data (8x1). 37
rows at batch 8: the training and the validation data both end with a batch
that does not divide the batch axis (27 training rows: a last batch of 3;
10 validation rows: 2). Per epoch (its validation included) two counts:
the Python traces of the model's `train_step` and `test_step` (Keras calls
them only while tracing its step functions), and the functions DTensor lays
out for the mesh (misses of its function cache: a new trace, or another
layout, shape or folded constant of one).

tfmp traces each step function for the full batches, then once more, with
the batch dimension relaxed, for the last one; DTensor lays out each trace
once for the layouts its batches come in (`FIRST_EPOCH_LAYOUTS`). Later
epochs, and an evaluate after fit, trace and lay out nothing. The last
training batch's inputs and targets are fewer than 20 replicated values,
which DTensor folds into the function as constants and lays out again
when they change: the reshuffled LSTM's second epoch laid out its step once
more (4-40 s; `tfmp.strategy.small_batch_values`). Seeded, Keras shuffles
arrays in the same order every epoch, so the convnet's last batch keeps its
values. Losses, metrics, predictions and weights stay those of one device.
"""

import collections
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import SEED, assert_weights_close, layouts_made

ROWS, BATCH, EPOCHS, VALIDATION_SPLIT = 37, 8, 3, 0.25
# The train and the test step, each for its full and its partial batches,
# and one read of a variable (fewer when an earlier model ran that read).
FIRST_EPOCH_LAYOUTS = 5


def build_convnet() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((10, 10, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2),
        ],
        name="convnet",
    )


def build_bilstm() -> keras.Model:
    tokens = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(30, 8, mask_zero=True)(tokens)
    x = keras.layers.Bidirectional(keras.layers.LSTM(4))(x)
    return keras.Model(tokens, keras.layers.Dense(4)(x), name="bilstm")


def convnet_data():
    """Images and two regression targets, distinct in every row: a shuffled
    last batch brings other targets each epoch."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 10, 10, 3)).astype("float32"), rng.normal(size=(ROWS, 2)).astype("float32")


def bilstm_data():
    """Sequences of 2 to 5 tokens, padded with 0 (masked) to 5."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 30, size=(ROWS, 5))
    lengths = rng.integers(2, 6, size=ROWS)
    tokens[np.arange(5) >= lengths[:, None]] = 0
    return tokens.astype("int32"), rng.integers(0, 4, ROWS)


class TracesPerEpoch(keras.callbacks.Callback):
    """Each epoch's Python traces of `train_step` and `test_step`, and the
    functions DTensor laid out."""

    def __init__(self, model: keras.Model, on_mesh: bool):
        super().__init__()
        self.traces = collections.Counter()
        self.on_mesh = on_mesh
        self.epochs = []
        for name in ("train_step", "test_step"):
            step = getattr(model, name)

            def counted(data, step=step, name=name):
                self.traces[name] += 1
                return step(data)

            setattr(model, name, counted)

    def counts(self) -> dict:
        return {**self.traces, "layouts": layouts_made() if self.on_mesh else 0}

    def on_epoch_begin(self, epoch, logs=None):
        self._begin = self.counts()

    def on_epoch_end(self, epoch, logs=None):
        end = self.counts()
        self.epochs.append({key: end[key] - self._begin.get(key, 0) for key in end})


def run(build, data, fit_data, loss, metric, strategy):
    """The tutorial program: build and compile (in the strategy's scope),
    fit with validation, evaluate, predict."""
    keras.utils.set_random_seed(SEED)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=[metric])
    x, y = data()
    traces = TracesPerEpoch(model, on_mesh=strategy is not None)
    history = model.fit(**fit_data(x, y), epochs=EPOCHS, callbacks=[traces], verbose=0)
    before_evaluate = traces.counts()
    results = [model.evaluate(x, y, batch_size=BATCH, verbose=0) for _ in range(2)]
    after_evaluate = traces.counts()
    return {
        "epochs": traces.epochs,
        "evaluate traces": after_evaluate["test_step"] - before_evaluate.get("test_step", 0),
        "history": history.history,
        "evaluate": results,
        "predictions": model.predict(x, batch_size=BATCH, verbose=0),
        "weights": model.get_weights(),
        "evaluate again layouts": evaluate_layouts(model, x, y),
    }


def evaluate_layouts(model, x, y) -> int:
    before = layouts_made()
    model.evaluate(x, y, batch_size=BATCH, verbose=0)
    return layouts_made() - before


class ReshuffledEachEpoch(keras.utils.PyDataset):
    """Batches of `x` and `y` in a new order every epoch (numpy's, seeded),
    as Keras' `PyDataset` guide shuffles in `on_epoch_end`."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size
        self.order = np.arange(len(x))
        self.rng = np.random.default_rng(2)

    def __len__(self):
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, index):
        rows = self.order[index * self.batch_size : (index + 1) * self.batch_size]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.rng.shuffle(self.order)


def split_off_validation(x, y):
    # Shuffled with a seed, Keras' arrays come in the same order every epoch.
    return dict(x=x, y=y, batch_size=BATCH, validation_split=VALIDATION_SPLIT)


def reshuffled_with_validation(x, y):
    # Another last batch every epoch: its replicated inputs change values.
    train_rows = int(ROWS * (1 - VALIDATION_SPLIT))
    return dict(
        x=ReshuffledEachEpoch(x[:train_rows], y[:train_rows], BATCH),
        validation_data=(x[train_rows:], y[train_rows:]),
        validation_batch_size=BATCH,
    )


CLASSES = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CASES = {
    "convnet 2x4 auto": (build_convnet, convnet_data, split_off_validation, "mse", "mae", (2, 4), "auto"),
    "bilstm 8x1": (build_bilstm, bilstm_data, reshuffled_with_validation, CLASSES, "accuracy", (8, 1), None),
}


@pytest.fixture(scope="module", params=list(CASES))
def runs(request):
    *program, shape, layout_map = CASES[request.param]
    plain = run(*program, None)
    mesh = tfmp.DeviceMesh(shape, ("batch", "model"))
    return plain, run(*program, tfmp.ModelParallelStrategy(mesh, layout_map))


def test_later_epochs_trace_and_lay_out_nothing(runs):
    plain, on_mesh = runs
    first, *later = on_mesh["epochs"]
    print("per epoch, one device:", plain["epochs"], "mesh:", on_mesh["epochs"])
    print("evaluate traces, one device:", plain["evaluate traces"], "mesh:", on_mesh["evaluate traces"])
    # tfmp traces each step for the full batches, then relaxed for the last
    # one; plain Keras, which steps over a `tf.data` iterator (its batch
    # dimension unknown), traces its train step twice and its test step once.
    assert {key: first[key] for key in ("train_step", "test_step")} == {"train_step": 2, "test_step": 2}
    for step in ("train_step", "test_step"):
        assert first[step] <= plain["epochs"][0][step] + 1, step
    assert 4 <= first["layouts"] <= FIRST_EPOCH_LAYOUTS, first
    for epoch in later:
        assert epoch == {"train_step": 0, "test_step": 0, "layouts": 0}
    # evaluate after fit: its last batch of 5 fits the relaxed trace; a
    # second evaluate lays out nothing.
    assert on_mesh["evaluate traces"] <= plain["evaluate traces"]
    assert on_mesh["evaluate again layouts"] == 0


def test_numbers_are_one_devices(runs):
    plain, on_mesh = runs
    assert on_mesh["history"].keys() == plain["history"].keys()
    for key, values in plain["history"].items():
        np.testing.assert_allclose(on_mesh["history"][key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(on_mesh["evaluate"], plain["evaluate"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(on_mesh["predictions"], plain["predictions"], rtol=1e-5, atol=1e-5)
    assert_weights_close(plain["weights"], on_mesh["weights"])
