"""A TF Model Garden model (tf_keras, Keras 2) trains on a mesh as on one device.

A tiny `tfm.nlp.networks.BertEncoder` with a classification head, split
Megatron-style over a 2x4 batch x model mesh by a LayoutMap over tf_keras
variable names, trained two ways, each against the same model trained on one
device without a strategy:
- with tf_keras' own `fit` (Adam): per-step losses, final weights, evaluation
  and predictions match;
- with Model Garden's `train_lib.run_experiment` (Orbit's loops, Model
  Garden's legacy Adam, checkpoints): per-step losses and accuracies, the
  final evaluation and the final weights match. (Resuming from its
  checkpoint is tested on two clients, in test_multi_client.py.)
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfmp
from garden_helpers import (
    BATCH,
    N,
    build_classifier,
    data,
    initial_weights,
    megatron_layout_map,
    run_experiment,
)
from helpers import assert_weights_close


def compile_classifier(model: tf_keras.Model, **kwargs) -> tf_keras.Model:
    model.compile(
        optimizer=tf_keras.optimizers.Adam(1e-2),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **kwargs,
    )
    return model


class StepLosses(tf_keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def train(model: tf_keras.Model, x, y):
    losses = StepLosses()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[losses]
    )
    return losses.losses, history.history


@pytest.fixture(scope="module")
def reference():
    weights = initial_weights()
    model = build_classifier()
    model.set_weights(weights)
    compile_classifier(model)
    x, y = data()
    losses, history = train(model, x, y)
    return dict(
        weights=weights,
        losses=losses,
        history=history,
        final=model.get_weights(),
        evaluation=model.evaluate(x, y, batch_size=BATCH, verbose=0),
        predictions=model.predict(x, batch_size=BATCH, verbose=0),
    )


@pytest.fixture(scope="module")
def strategy():
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
    return tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh))


def test_fit_matches_single_device(reference, strategy):
    with strategy.scope():
        model = build_classifier()
        model.set_weights(reference["weights"])
        compile_classifier(model)
    x, y = data()

    losses, history = train(model, x, y)

    assert len(losses) == len(reference["losses"]) == 2 * N // BATCH
    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
    for key, values in reference["history"].items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5)
    assert len(model.weights) == len(reference["final"]) == 41
    assert_weights_close(reference["final"], model.get_weights())
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=BATCH, verbose=0), reference["evaluation"], rtol=1e-5
    )
    np.testing.assert_allclose(
        model.predict(x, batch_size=BATCH, verbose=0),
        reference["predictions"],
        rtol=1e-5,
        atol=1e-5,
    )

    # The rules matched the tf_keras names, and Adam's slots follow their weight.
    specs = {v.name.split(":")[0]: v.layout.sharding_specs for v in model.weights}
    query = "transformer/layer_1/self_attention/query/kernel"
    assert specs[query] == ["unsharded", "model", "unsharded"]
    assert specs["transformer/layer_0/output/kernel"] == ["model", "unsharded"]
    assert specs["classifier/kernel"] == ["unsharded", "unsharded"]
    slots = {v.name.split(":")[0]: v.layout.sharding_specs for v in model.optimizer.variables}
    assert slots[f"Adam/m/{query}"] == slots[f"Adam/v/{query}"] == specs[query]
    assert strategy.layout_map.unmatched_keys() == []


def test_legacy_optimizer_with_row_wise_sparse_update_is_refused(strategy):
    # Legacy RMSprop moves only the word-embedding rows in the batch; tfmp
    # cannot run that update and will not apply a dense one in its place.
    with strategy.scope():
        model = build_classifier()
        model.compile(
            optimizer=tf_keras.optimizers.legacy.RMSprop(1e-2),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    x, y = data(BATCH)
    with pytest.raises(ValueError, match="legacy RMSprop updates only the rows"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


def test_steps_per_execution_must_be_one(strategy):
    with strategy.scope():
        model = build_classifier()
        compile_classifier(model, steps_per_execution=2)
    x, y = data(16)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


def test_run_experiment_matches_single_device(reference, strategy, tmp_path):
    single = run_experiment(
        tf.distribute.get_strategy(), reference["weights"], tmp_path / "single", 8
    )
    mesh = run_experiment(strategy, reference["weights"], tmp_path / "mesh", 8)

    for key, values in single[0].items():
        assert len(mesh[0][key]) == 8
        np.testing.assert_allclose(mesh[0][key], values, rtol=1e-5)
    for key, value in single[1].items():
        np.testing.assert_allclose(mesh[1][key], value, rtol=1e-5)
    assert len(mesh[2]) == len(single[2]) == 41
    assert_weights_close(single[2], mesh[2])
    assert (tmp_path / "mesh" / "ckpt-8.index").exists()
