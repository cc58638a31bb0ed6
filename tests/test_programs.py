"""Whole training programs as Keras' guides write them, on one device and on
a 2x4 mesh with `layout_map="auto"`: the same program, changed only by the
strategy whose scope builds, compiles and loads the model.

Every program trains on 37 samples at batch 8, so its last batch (5 rows)
does not divide the batch axis (2), and is compared with one device from the
same initial weights: History (losses, metrics, learning rate), final
weights and predictions to 1e-5.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tfmp
from helpers import SEED, mesh

SAMPLES, BATCH = 37, 8
VALIDATION_SAMPLES = 13


def on_one_device():
    return tf.distribute.get_strategy()


def on_mesh():
    return tfmp.ModelParallelStrategy(mesh((2, 4)), layout_map="auto")


class LogisticEndpoint(keras.layers.Layer):
    """The endpoint layer of Keras' subclassing guide: it adds its loss with
    `add_loss` and returns the predictions; the model compiles no loss."""

    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets, logits, sample_weights=None):
        self.add_loss(self.loss_fn(targets, logits, sample_weights))
        return ops.sigmoid(logits)


def endpoint_program(strategy):
    rng = np.random.default_rng(0)
    data = {
        "inputs": rng.normal(size=(SAMPLES, 6)).astype("float32"),
        "targets": (rng.random(size=(SAMPLES, 10)) > 0.5).astype("float32"),
    }
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        inputs = keras.Input((6,), name="inputs")
        targets = keras.Input((10,), name="targets")
        hidden = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
        logits = keras.layers.Dense(10, name="logits")(hidden)
        predictions = LogisticEndpoint(name="predictions")(targets, logits)
        model = keras.Model(inputs=[inputs, targets], outputs=predictions)
        model.compile(optimizer=keras.optimizers.Adam(0.01))
    history = model.fit(data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model, history.history, model.predict(data, batch_size=BATCH, verbose=0)


def ticket_program(strategy):
    """The functional API guide's ticket classifier: three inputs, two
    named outputs, a dict of losses with loss weights and a dict of metrics."""
    rng = np.random.default_rng(1)
    vocabulary, tags, departments = 50, 6, 4
    rows = SAMPLES + VALIDATION_SAMPLES
    x = {
        "title": rng.integers(0, vocabulary, size=(rows, 5)),
        "body": rng.integers(0, vocabulary, size=(rows, 12)),
        "tags": (rng.random(size=(rows, tags)) > 0.5).astype("float32"),
    }
    y = {
        "priority": rng.random(size=(rows, 1)).astype("float32"),
        "department": keras.utils.to_categorical(rng.integers(0, departments, rows), departments),
    }
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        title = keras.Input((None,), name="title")
        body = keras.Input((None,), name="body")
        tags_input = keras.Input((tags,), name="tags")
        title_features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocabulary, 16)(title))
        body_features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocabulary, 8)(body))
        features = keras.layers.concatenate([title_features, body_features, tags_input])
        features = keras.layers.Dense(32, activation="relu")(features)
        priority = keras.layers.Dense(1, name="priority")(features)
        department = keras.layers.Dense(departments, name="department")(features)
        model = keras.Model(inputs=[title, body, tags_input], outputs={"priority": priority, "department": department})
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss={
                "priority": keras.losses.BinaryCrossentropy(from_logits=True),
                "department": keras.losses.CategoricalCrossentropy(from_logits=True),
            },
            loss_weights={"priority": 1.0, "department": 0.2},
            metrics={"department": ["accuracy"], "priority": ["mae"]},
        )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, validation_split=VALIDATION_SAMPLES / rows, shuffle=False, verbose=0
    )
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    return model, history.history, np.concatenate([predictions["priority"], predictions["department"]], axis=1)


def callbacks_program(strategy, directory):
    """Checkpoints of the best epoch, early stopping and a learning rate cut
    on a plateau, then the best model loaded and trained on."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(SAMPLES + 10, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32") + 0.1
    best = os.path.join(directory, "best.keras")
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(32, activation="relu", name="up"),
                keras.layers.Dense(1, name="down"),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
    callbacks = [
        keras.callbacks.ModelCheckpoint(best, monitor="val_loss", save_best_only=True),
        keras.callbacks.EarlyStopping(monitor="loss", patience=0, restore_best_weights=True),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
    ]
    history = model.fit(
        x, y, batch_size=BATCH, epochs=4, validation_split=10 / 47, shuffle=False, verbose=0, callbacks=callbacks
    )
    with strategy.scope():
        loaded = keras.models.load_model(best)
    more = loaded.fit(x[:SAMPLES], y[:SAMPLES], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    logs = {**history.history, **{f"after_load_{key}": values for key, values in more.history.items()}}
    return loaded, logs, loaded.predict(x, batch_size=BATCH, verbose=0)


def assert_same_program_results(one_device, on_the_mesh):
    (reference, ref_logs, ref_predictions), (model, logs, predictions) = one_device, on_the_mesh
    assert logs.keys() == ref_logs.keys()
    for key, values in ref_logs.items():
        np.testing.assert_allclose(logs[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    for variable, want, got in zip(model.weights, reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=variable.path)
    np.testing.assert_allclose(predictions, ref_predictions, rtol=1e-5, atol=1e-5)


def assert_splits_over_model(model):
    split = [v.path for v in model.weights if "model" in v.value.layout.sharding_specs]
    assert split, "layout_map='auto' split nothing over 'model'"


def test_add_loss_endpoint_program_trains_as_on_one_device():
    reference, mesh_run = endpoint_program(on_one_device()), endpoint_program(on_mesh())
    assert_same_program_results(reference, mesh_run)
    assert_splits_over_model(mesh_run[0])


def test_multi_input_multi_output_program_trains_as_on_one_device():
    # Its logs include each output's loss ("priority_loss", ...), which Keras
    # weighs by the static batch size of the step's trace: the last batch does
    # not divide the batch axis.
    reference, mesh_run = ticket_program(on_one_device()), ticket_program(on_mesh())
    assert {"priority_loss", "val_department_loss"} <= reference[1].keys()
    assert_same_program_results(reference, mesh_run)
    assert_splits_over_model(mesh_run[0])


def test_checkpoint_early_stopping_and_plateau_then_load_and_train_on(tmp_path):
    # load_model restores the best model with its optimizer, whose slots
    # layout_map="auto" lays out with the model before they are made.
    reference = callbacks_program(on_one_device(), str(tmp_path / "one"))
    mesh_run = callbacks_program(on_mesh(), str(tmp_path / "mesh"))
    assert_splits_over_model(mesh_run[0])
    # The loaded optimizer's state is laid out like the weights it follows.
    slots = {v.path.split("/")[-1]: v.value.layout.sharding_specs for v in mesh_run[0].optimizer.variables}
    for variable in mesh_run[0].trainable_weights:
        momentum = slots[f"{variable.path.replace('/', '_')}_momentum"]
        assert momentum == variable.value.layout.sharding_specs, variable.path
    assert len(reference[1]["loss"]) < 4, "EarlyStopping did not stop the run early"
    assert min(reference[1]["learning_rate"]) < 0.05, "ReduceLROnPlateau did not cut the rate"
    assert_same_program_results(reference, mesh_run)
