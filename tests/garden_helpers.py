"""The Model Garden model, layout rules, data and experiment that the Model
Garden tests (one process and several clients) train."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tensorflow_models as tfm
import tf_keras
from official.core import base_task, train_lib
from official.core import config_definitions as cfg
from official.modeling import optimization

import tfmp

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


def data(n: int = N):
    rng = np.random.default_rng(0)
    x = {
        "input_word_ids": rng.integers(0, VOCAB, (n, SEQ)).astype("int32"),
        "input_mask": np.ones((n, SEQ), "int32"),
        "input_type_ids": rng.integers(0, 2, (n, SEQ)).astype("int32"),
    }
    y = rng.integers(0, 2, (n,)).astype("int32")
    return x, y


def initial_weights() -> list[np.ndarray]:
    tf_keras.utils.set_random_seed(1)
    return build_classifier().get_weights()


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


def run_experiment(strategy, initial_weights, model_dir, train_steps, mode="train_and_eval"):
    """Per-step training logs, the final evaluation and weights."""
    params = experiment(train_steps)
    logs = []
    model, evaluation = train_lib.run_experiment(
        distribution_strategy=strategy,
        task=ClassifierTask(params.task, initial_weights),
        mode=mode,
        params=params,
        model_dir=str(model_dir),
        run_post_eval=True,
        train_actions=[lambda output: logs.append(output)],
    )
    steps = {key: [float(log[key]) for log in logs] for key in ("training_loss", "accuracy")}
    evaluation = {key: float(evaluation[key]) for key in ("validation_loss", "accuracy")}
    return steps, evaluation, model.get_weights()
