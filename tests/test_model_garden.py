"""A TF Model Garden model (tf_keras, Keras 2) trains on a mesh as on one device.

A tiny `tfm.nlp.networks.BertEncoder` with a classification head, split
Megatron-style over a 2x4 batch x model mesh by a LayoutMap over tf_keras
variable names, trained two ways, each against the same model trained on one
device without a strategy:
- with tf_keras' own `fit` (Adam): per-step losses, final weights, evaluation
  and predictions match;
- with Model Garden's `train_lib.run_experiment` (Orbit's loops, Model
  Garden's legacy Adam, checkpoints): per-step losses and accuracies, the
  evaluations and the final weights match, also across a resume from the
  checkpoint it wrote.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_models as tfm
import tf_keras
from official.core import base_task, train_lib
from official.core import config_definitions as cfg
from official.modeling import optimization

import tfmp
from helpers import assert_weights_close

# Needed for dropout > 0: DTensor refuses tf_keras' stateful random ops in a
# step (initializers run on the host under tfmp and need nothing).
tf_keras.backend.experimental.enable_tf_random_generator()

SEQ, VOCAB, N, BATCH = 8, 64, 32, 8


def build_classifier() -> tf_keras.Model:
    encoder = tfm.nlp.networks.BertEncoder(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_sequence_length=SEQ,
        type_vocab_size=2,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        dict_outputs=True,
    )
    inputs = {
        name: tf_keras.Input((SEQ,), dtype=tf.int32, name=name)
        for name in ("input_word_ids", "input_mask", "input_type_ids")
    }
    pooled = encoder(inputs)["pooled_output"]
    logits = tf_keras.layers.Dense(2, name="classifier")(pooled)
    return tf_keras.Model(inputs, logits)


def megatron_layout_map(mesh: tfmp.DeviceMesh) -> tfmp.LayoutMap:
    """Rules over tf_keras variable names (name scopes), e.g.
    "transformer/layer_0/self_attention/query/kernel"."""
    layout_map = tfmp.LayoutMap(mesh)
    # Hidden-split: DTensor cannot gather rows of a vocabulary-split table.
    layout_map["word_embeddings/embeddings"] = (None, "model")
    # Attention: heads split (column-parallel in, row-parallel out).
    layout_map[r"self_attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[r"self_attention/(query|key|value)/bias"] = ("model", None)
    layout_map["self_attention/attention_output/kernel"] = ("model", None, None)
    # Feed-forward: column-parallel, then row-parallel.
    layout_map["intermediate/kernel"] = (None, "model")
    layout_map["intermediate/bias"] = ("model",)
    layout_map[r"layer_\d+/output/kernel"] = ("model", None)
    layout_map["pooler_transform/kernel"] = (None, "model")
    return layout_map


def compile_classifier(model: tf_keras.Model, **kwargs) -> tf_keras.Model:
    model.compile(
        optimizer=tf_keras.optimizers.Adam(1e-2),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **kwargs,
    )
    return model


def data(n: int = N):
    rng = np.random.default_rng(0)
    x = {
        "input_word_ids": rng.integers(0, VOCAB, (n, SEQ)).astype("int32"),
        "input_mask": np.ones((n, SEQ), "int32"),
        "input_type_ids": rng.integers(0, 2, (n, SEQ)).astype("int32"),
    }
    y = rng.integers(0, 2, (n,)).astype("int32")
    return x, y


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
    tf_keras.utils.set_random_seed(1)
    model = build_classifier()
    weights = model.get_weights()
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


class ClassifierTask(base_task.Task):
    """The classifier as a Model Garden task, on generated data: 4 batches an
    epoch, repeated for training."""

    def __init__(self, params: cfg.TaskConfig, initial_weights: list):
        super().__init__(params)
        self.initial_weights = initial_weights

    def build_model(self) -> tf_keras.Model:
        return build_classifier()

    def initialize(self, model: tf_keras.Model) -> None:
        model.set_weights(self.initial_weights)

    def build_inputs(self, params: cfg.DataConfig, input_context=None) -> tf.data.Dataset:
        dataset = tf.data.Dataset.from_tensor_slices(data())
        if params.is_training:
            dataset = dataset.repeat()
        return dataset.batch(params.global_batch_size)

    def build_losses(self, labels, model_outputs, aux_losses=None) -> tf.Tensor:
        return tf.reduce_mean(
            tf_keras.losses.sparse_categorical_crossentropy(
                labels, model_outputs, from_logits=True
            )
        )

    def build_metrics(self, training: bool = True) -> list:
        return [tf_keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def experiment(train_steps: int) -> cfg.ExperimentConfig:
    """Model Garden's defaults (steps in a `tf.while_loop`, legacy Adam), with a
    log every step and a checkpoint and evaluation every 4."""
    return cfg.ExperimentConfig(
        task=cfg.TaskConfig(
            train_data=cfg.DataConfig(global_batch_size=BATCH, is_training=True),
            validation_data=cfg.DataConfig(global_batch_size=BATCH, is_training=False),
        ),
        trainer=cfg.TrainerConfig(
            train_steps=train_steps,
            steps_per_loop=1,
            summary_interval=1,
            checkpoint_interval=4,
            validation_interval=4,
            validation_steps=-1,
            optimizer_config=optimization.OptimizationConfig(
                {
                    "optimizer": {"type": "adam"},
                    "learning_rate": {"type": "constant", "constant": {"learning_rate": 1e-2}},
                }
            ),
        ),
    )


def run_experiment(strategy, initial_weights, model_dir, train_steps):
    """Per-step training logs, the final evaluation and weights."""
    params = experiment(train_steps)
    logs = []
    model, evaluation = train_lib.run_experiment(
        distribution_strategy=strategy,
        task=ClassifierTask(params.task, initial_weights),
        mode="train_and_eval",
        params=params,
        model_dir=str(model_dir),
        run_post_eval=True,
        train_actions=[lambda output: logs.append(output)],
    )
    steps = {key: [float(log[key]) for log in logs] for key in ("training_loss", "accuracy")}
    evaluation = {key: float(evaluation[key]) for key in ("validation_loss", "accuracy")}
    return steps, evaluation, model.get_weights()


def test_run_experiment_matches_single_device(reference, strategy, tmp_path):
    single = run_experiment(
        tf.distribute.get_strategy(), reference["weights"], tmp_path / "single", 12
    )
    # 8 steps (2 epochs), then a second run_experiment that restores step 8 from
    # the checkpoint and trains to 12: the data starts over at an epoch
    # boundary, so it sees the batches that 12 steps in a row see.
    first = run_experiment(strategy, reference["weights"], tmp_path / "mesh", 8)
    resumed = run_experiment(strategy, reference["weights"], tmp_path / "mesh", 12)

    for key, values in single[0].items():
        assert len(first[0][key]) == 8 and len(resumed[0][key]) == 4
        np.testing.assert_allclose(first[0][key] + resumed[0][key], values, rtol=1e-5)
    for key, value in single[1].items():
        np.testing.assert_allclose(resumed[1][key], value, rtol=1e-5)
    assert len(resumed[2]) == len(single[2]) == 41
    assert_weights_close(single[2], resumed[2])
    # The resumed run trained 4 steps only: it restored step 8's checkpoint.
    checkpoints = {p.name for p in (tmp_path / "mesh").glob("ckpt-*.index")}
    assert {"ckpt-8.index", "ckpt-12.index"} <= checkpoints
