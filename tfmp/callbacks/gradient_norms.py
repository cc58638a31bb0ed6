"""Norms of the synchronized gradients, recorded inside the training step."""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from tfmp import integrations
from tfmp.integrations import Patch


class GradientNormRecorder:
    """Keeps the norm of each synchronized gradient of the latest step.

    The optimizer sums gradients across replicas in
    `_all_reduce_sum_gradients`, on every strategy (the identity where there is
    a single replica, as under tfmp). Wrapping it sees the gradients that
    actually update the weights, once per step, with no extra communication
    under `MirroredStrategy` and one scalar reduction per split variable under
    tfmp. The norms are written to one variable, read only when asked.
    """

    def __init__(self, model: keras.Model):
        self.model = model
        self.paths = [variable.path for variable in model.trainable_variables]
        with model.distribute_strategy.scope():
            self.norms = tf.Variable(
                tf.zeros([len(self.paths)]),
                trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="tfmp_gradient_norms",
            )
        optimizer = model.optimizer
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # loss scaling
        if not hasattr(optimizer, "_all_reduce_sum_gradients"):
            raise ValueError(
                f"GradientSyncMonitor(grad_norms=True) needs a Keras TensorFlow optimizer; "
                f"got {type(optimizer).__name__}."
            )
        all_reduce = optimizer._all_reduce_sum_gradients

        def all_reduce_and_record(grads_and_vars: Any) -> Any:
            reduced = all_reduce(grads_and_vars)
            self.norms.assign(tf.stack([_norm(gradient) for gradient, _ in reduced]))
            return reduced

        optimizer._all_reduce_sum_gradients = all_reduce_and_record
        # A train function traced before the wrapping would not record.
        model.train_function = None

    def logs(self) -> dict[str, float]:
        """`grad_norm/global` and `grad_norm/<variable path>` of the latest step."""
        norms = [float(n) for n in self.norms.numpy()]
        logs = {"grad_norm/global": math.sqrt(sum(n * n for n in norms))}
        logs.update({f"grad_norm/{path}": n for path, n in zip(self.paths, norms)})
        return logs


def _norm(gradient: Any) -> tf.Tensor:
    if gradient is None:
        return tf.constant(0.0)
    if isinstance(gradient, tf.IndexedSlices):
        # Rows may repeat; the norm is that of the summed dense gradient.
        gradient = tf.convert_to_tensor(gradient)
    return tf.cast(tf.norm(gradient), tf.float32)


integrations.declare(
    __name__,
    (
        Patch(
            "keras.src.backend.tensorflow.optimizer:TFOptimizer",
            "_all_reduce_sum_gradients",
            GradientNormRecorder,
            "GradientSyncMonitor(grad_norms=True) records the synchronized gradients.",
            parameters=("grads_and_vars",),
            kind="instance",
        ),
    ),
)
